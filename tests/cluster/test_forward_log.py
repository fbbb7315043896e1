"""A checkpointed job that re-keys, on a cluster (cluster.forward_log): its forwards go through logs
its nodes' checkpoints commit, so a node killed with SIGKILL (mid-stream, or at any point of a
handoff) is restored with nothing lost and nothing twice: the job keyed by user then by region
matches the plain-Python model, each region's rows numbered 1..n once, each user's totals in order."""

from __future__ import annotations

import threading

import pytest

from stretch.cluster import NodeLost, StretchCluster
from stretch.cluster.forward_log import ForwardLog
from stretch.cluster.rekey_plans import split_rekeys
from stretch.runtime.chain import HELD
from tests.cluster.test_recovery import kill, wait_for
from tests.cluster.test_rekey import check, clicks, rekeyed_job, run, run_windowed, windowed_job
from tests.cluster.test_source_plans import plan_of


def checkpointed_job(interval=None):
    env = rekeyed_job()
    env.enable_checkpointing(interval)  # None: on demand, the test says when
    return env


def test_a_checkpointed_job_forwards_through_a_log_sent_as_checkpoints_commit_it():
    plan, forwards = split_rekeys(plan_of(rekeyed_job()), {"job": "j", "address": "/x"}, logged=True)
    assert [(f.channel, f.logged) for f in forwards] == [("users->regions", True)]
    sink = next(s for s in plan.sinks if isinstance(s.sink, ForwardLog))
    assert sink.runs_in == "job"  # an output channel of the node's job, committed by its checkpoints
    users = plan.stage("users")
    assert [step.kind for step in users.chain] == ["to_sink"] and users.chain[0].sink == sink.id
    assert users.chain[0].fn == HELD  # a gate entry's records go into the log together: one write


@pytest.mark.parametrize("nodes", [2, pytest.param(3, marks=pytest.mark.long)])
def test_a_node_killed_mid_stream_forwards_nothing_twice_and_loses_nothing(nodes, tmp_path):
    rows = clicks(12000, seed=5)
    with StretchCluster.local(
        nodes=nodes, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "ck"
    ) as cluster:

        def checkpoints_then_a_kill(client, i):
            client.trigger_checkpoint()  # half the rows forwarded, half still in the logs
            kill(cluster, "node-1")
            wait_for(lambda: cluster.recoveries)

        got = run(cluster, rows, checkpointed_job(200), batches=20, during=checkpoints_then_a_kill)
    assert cluster.recoveries[0]["nodes"] == ["node-1"]
    check(got, rows)


@pytest.mark.long  # the default run moves a checkpointed job's key groups in the kill test below
def test_node_changes_and_rescales_of_a_checkpointed_job_keep_every_row_once(tmp_path):
    """A node joins, the producing operator scales up there, the first node leaves: each move's
    new owner forwards its key groups' records only after the old owner sent what it committed."""
    rows = clicks(12000, seed=7)
    with StretchCluster.local(
        nodes=2, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "ck"
    ) as cluster:
        changes = []

        def change(client, i):
            changes.append(cluster.add_node())
            client.rescale("users", 3, node=cluster.nodes[-1])
            changes.append(cluster.remove_node(cluster.nodes[0]))

        got = run(cluster, rows, checkpointed_job(250), batches=20, during=change)
    assert [r.key_groups_moved > 0 for r in changes] == [True, True]
    check(got, rows)


@pytest.mark.parametrize("nodes", [2, pytest.param(3, marks=pytest.mark.long)])
def test_event_time_windows_after_a_checkpointed_re_key_match_the_model_through_a_kill(nodes, tmp_path):
    """The logs keep the records' timestamps and each node's watermark: every window fires once
    with the model's rows through a node killed mid-stream (its split holds the windows back until
    its key groups' records came again), and rows written after their windows fired are late."""

    def checkpoint_then_kill(client, i):
        if i == 5:
            client.trigger_checkpoint()
        if i == 8:  # rows and watermarks in its log since the checkpoint are cut
            kill(cluster, "node-1")
            wait_for(lambda: cluster.recoveries)

    with StretchCluster.local(
        nodes=nodes, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "ck", max_parallelism=32
    ) as cluster:
        env = windowed_job()
        env.enable_checkpointing(200)
        run_windowed(cluster, env, 8, checkpoint_then_kill, name="timed-logged")


POINTS = ["release", "load", "adopt", "forwarded", "adopted"]


@pytest.mark.parametrize(
    "point,victim",
    [
        pytest.param(point, victim, marks=() if (point, victim) == ("forwarded", "src") else pytest.mark.long)
        for point in POINTS
        for victim in ("src", "dst")
    ],
)
def test_a_node_killed_at_any_point_of_a_handoff_forwards_every_row_once(point, victim, tmp_path):
    """2 -> 3 nodes in steps of 8 key groups while rows stream in: the old (src) or the new (dst)
    owner of the second step is killed at ``point`` of it."""
    rows = clicks(16000, seed=6)
    with StretchCluster.local(
        nodes=2, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "ck", step=8
    ) as cluster:
        moves = []

        def hook(at, src, dst):
            moves.append(at)
            if at == point and moves.count(point) == 2:
                kill(cluster, src if victim == "src" else dst)

        def add_a_node_meanwhile(client, i):
            client.trigger_checkpoint()
            cluster._step_hook = hook
            changing = threading.Thread(target=add_node, args=(cluster, failures))
            changing.start()
            threads.append(changing)

        failures, threads = [], []
        got = run(
            cluster,
            rows,
            checkpointed_job(300),
            batches=20,
            during=add_a_node_meanwhile,
            before_end=lambda: [t.join(300) for t in threads] and wait_for(lambda: cluster.recoveries),
        )
    if point != "adopted":
        assert failures and isinstance(failures[0], NodeLost)
    check(got, rows)


def add_node(cluster, failures):
    try:
        cluster.add_node()
    except BaseException as e:
        failures.append(e)
