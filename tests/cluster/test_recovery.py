"""Failures on a cluster with a checkpoint directory: a node killed with SIGKILL while rows stream
in (or at any point of a key-group handoff) is restored on the surviving nodes from its latest
checkpoint and journal, and the job's output equals a plain-Python reference: nothing lost,
nothing twice, replays of Spark micro-batches included."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from stretch.cluster import NodeLost, StretchCluster
from stretch.common.records import to_batch
from stretch.state.key_groups import key_group
from tests.cluster.jobs import PAIR, count_sum_job, reference
from tests.cluster.test_cluster import batches, outputs


def checkpointed_job(name: str, cluster: StretchCluster):
    env = count_sum_job()
    env.enable_checkpointing()  # on demand: the test says when
    return env.execute_async(name, cluster=cluster)


def kill(cluster: StretchCluster, node: str) -> None:
    os.kill(cluster.launcher.pids()[node], signal.SIGKILL)


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def assert_exactly_once(got, data) -> None:
    """Every key's running count went 1, 2, ..., n exactly once; its last sum is the reference's."""
    expected = reference([r for records in data for r in records])
    by_key: dict[str, list[tuple[int, int]]] = {}
    for key, count, total in got:
        by_key.setdefault(key, []).append((count, total))
    assert {k: sorted(v)[-1] for k, v in by_key.items()} == expected
    for key, seen in by_key.items():
        assert sorted(c for c, _ in seen) == list(range(1, expected[key][0] + 1)), key


def finish(client, cluster, name: str, data) -> None:
    client.end("in")
    assert set(client.wait(120).values()) == {"FINISHED"}
    assert_exactly_once(outputs(name, ["node-0", "node-1", "node-2"]), data)


def test_a_node_killed_mid_stream_is_restored_from_its_checkpoint_and_journal(tmp_path):
    data = batches(2, 60, 40)
    with StretchCluster.local(
        nodes=3, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "checkpoints", private_shm_mb=128
    ) as cluster:
        client = checkpointed_job("killed", cluster)
        with client.writer("in") as writer:
            for i, records in enumerate(data):
                writer.write(to_batch(records, PAIR), query="q", batch=i)
                if i % 10 == 9:  # Spark replays a micro-batch it had already sent
                    writer.write(to_batch(data[i - 5], PAIR), query="q", batch=i - 5)
                if i == 20:
                    reports = client.trigger_checkpoint()
                    assert all(r["bytes"] > 0 for r in reports.values())
                if i == 35:  # after the checkpoint: node-1 took batches 21..35 only into its journal
                    kill(cluster, "node-1")
            wait_for(lambda: cluster.recoveries)
            # replays after the restore: dropped by the key groups' restored marks
            for i in (3, 30, 59):
                writer.write(to_batch(data[i], PAIR), query="q", batch=i)
        (recovered,) = cluster.recoveries
        assert recovered["nodes"] == ["node-1"] and recovered["rows_replayed"] > 0
        assert cluster.nodes == ["node-0", "node-2"]
        assert "node-1" not in cluster.table.owners and cluster.table.version == 1
        assert not cluster.supervisor_errors
        finish(client, cluster, "killed", data)


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_nodes_killed_one_after_another_around_a_handoff_are_each_restored(tmp_path):
    """node-0 dies before any checkpoint (restored from its journal alone onto node-1); node-2
    joins (node-1 releases key groups it restored, and they move); node-1 dies (restored from its
    release checkpoint and journal onto node-2)."""
    data = batches(3, 30, 30)
    with StretchCluster.local(
        nodes=2, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "ck"
    ) as cluster:
        client = checkpointed_job("one-after-another", cluster)
        with client.writer("in") as writer:
            for i, records in enumerate(data):
                writer.write(to_batch(records, PAIR), query="q", batch=i)
                if i == 8:
                    kill(cluster, "node-0")
                    wait_for(lambda: len(cluster.recoveries) == 1)
                    assert cluster.nodes == ["node-1"]
                if i == 15:
                    assert cluster.add_node().key_groups_moved == 64
                    writer.write(to_batch(data[4], PAIR), query="q", batch=4)  # a replay: dropped
                if i == 22:
                    kill(cluster, "node-1")
                    wait_for(lambda: len(cluster.recoveries) == 2)
                    assert cluster.nodes == ["node-2"] and set(cluster.table.owners) == {"node-2"}
        assert [r["nodes"] for r in cluster.recoveries] == [["node-0"], ["node-1"]]
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        assert_exactly_once(outputs("one-after-another", ["node-0", "node-1", "node-2"]), data)


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_a_node_that_dies_restoring_another_is_restored_in_turn(tmp_path):
    data = batches(6, 24, 30)
    with StretchCluster.local(
        nodes=3, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "ck"
    ) as cluster:
        client = checkpointed_job("restorer-dies", cluster)
        killed = []

        def hook(at, dead, target):
            if at == "recover" and not killed:
                killed.append(target)
                kill(cluster, target)

        cluster._step_hook = hook
        with client.writer("in") as writer:
            for i, records in enumerate(data):
                writer.write(to_batch(records, PAIR), query="q", batch=i)
                if i == 8:
                    client.trigger_checkpoint()
                if i == 14:
                    kill(cluster, "node-0")
                    wait_for(lambda: len(cluster.recoveries) == 2)
        (survivor,) = cluster.nodes
        assert [r["nodes"] for r in cluster.recoveries] == [["node-0"], killed]
        assert set(cluster.table.owners) == {survivor}
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        assert_exactly_once(outputs("restorer-dies", ["node-0", "node-1", "node-2"]), data)


def test_output_shows_only_what_a_checkpoint_covers(tmp_path):
    from stretch.runtime.channel_log import ChannelLog
    from stretch.runtime.state_dir import channel_dir

    with StretchCluster.local(
        nodes=1, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "ck"
    ) as cluster:
        client = checkpointed_job("committed", cluster)
        log = channel_dir("committed@node-0", "out", "out")
        with client.writer("in") as writer:
            writer.write([("a", 1), ("b", 2)], query="q", batch=0)
        client.trigger_checkpoint()
        assert ChannelLog(log, create=False).readable_end >= 1
        before = ChannelLog(log, create=False).readable_end
        with client.writer("in") as writer:
            writer.write([("a", 3)], query="q", batch=1)
        time.sleep(0.3)
        assert ChannelLog(log, create=False).readable_end == before  # not yet covered
        client.trigger_checkpoint()
        assert ChannelLog(log, create=False).readable_end > before
        client.end("in")
        client.wait(60)
        assert sorted(outputs("committed", ["node-0"])) == [("a", 1, 1), ("a", 2, 4), ("b", 1, 2)]


def test_on_spark_keeps_checkpoints_next_to_sparks_checkpoint_location():
    from stretch.cluster.cluster import spark_checkpoint_dir

    class Conf:
        def __init__(self, value):
            self.value = value

        def get(self, key, default=None):
            return self.value if key == "spark.sql.streaming.checkpointLocation" else default

    class Session:
        def __init__(self, value):
            self.conf = Conf(value)

    assert str(spark_checkpoint_dir(Session("file:///data/ck"))) == "/data/ck/stretch-cluster"
    assert str(spark_checkpoint_dir(Session("/data/ck"))) == "/data/ck/stretch-cluster"
    assert spark_checkpoint_dir(Session(None)) is None


POINTS = ["release", "load", "adopt", "adopted"]
QUICK: set = set()  # all run with -m long (the suite keeps within its time); test_handoff_backlog
# kills a node inside a handoff by default


@pytest.mark.parametrize(
    "point,victim",
    [
        pytest.param(point, victim, marks=() if (point, victim) in QUICK else pytest.mark.long)
        for point in POINTS
        for victim in ("src", "dst")
    ],
)
def test_a_node_killed_at_any_point_of_a_handoff_loses_and_repeats_nothing(tmp_path, point, victim):
    """2 -> 3 nodes, one step of 8 key groups at a time; the old (src) or new (dst) owner of the
    second step is killed just before the release, the load, the adoption, or just after it."""
    data = batches(4, 40, 30)
    name = f"handoff-{point}-{victim}"
    with StretchCluster.local(
        nodes=2, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "ck", step=8
    ) as cluster:
        client = checkpointed_job(name, cluster)
        writer = client.writer("in")
        for i in range(15):
            writer.write(to_batch(data[i], PAIR), query="q", batch=i)
        client.trigger_checkpoint()
        for i in range(15, 20):
            writer.write(to_batch(data[i], PAIR), query="q", batch=i)
        moves = []

        def hook(at, src, dst):
            moves.append((at, src, dst))
            if at == point and sum(1 for m in moves if m[0] == point) == 2:
                kill(cluster, src if victim == "src" else dst)

        cluster._step_hook = hook
        stop = threading.Event()
        errors = []

        def stream():  # rows keep coming while the handoff runs and fails
            try:
                for i in range(20, 40):
                    writer.write(to_batch(data[i], PAIR), query="q", batch=i)
                    if i == 30:
                        writer.write(to_batch(data[12], PAIR), query="q", batch=12)  # a replay
            except BaseException as e:
                errors.append(e)
            finally:
                stop.set()

        feeder = threading.Thread(target=stream)
        feeder.start()
        try:
            cluster.add_node()
            failed = None
        except NodeLost as e:
            failed = e
        feeder.join(300)
        assert not errors, errors
        wait_for(lambda: cluster.recoveries)
        if point != "adopted":  # killed inside the step: the node change stops, saying so
            assert failed is not None
        owners = cluster.table.owners
        assert set(owners) == set(cluster.nodes)  # every key group owned by exactly one live node
        status = cluster.status()
        assert sorted(kg for s in status.values() for kg in s["key_groups"]) == list(range(128))
        writer.close()
        finish(client, cluster, name, data)


DRIVER = """
import json, os, sys
from stretch.cluster import StretchCluster
from stretch.common.records import to_batch
from tests.cluster.jobs import PAIR, count_sum_job
from tests.cluster.test_cluster import batches

directory, checkpoints, point, name = sys.argv[1:5]
data = batches(5, 30, 30)
cluster = StretchCluster.local(nodes=2, directory=directory, checkpoint_dir=checkpoints, step=8)
print(json.dumps(list(cluster.launcher.pids().values())), flush=True)
env = count_sum_job()
env.enable_checkpointing()
client = env.execute_async(name, cluster=cluster)
writer = client.writer("in")
for i in range(15):
    writer.write(to_batch(data[i], PAIR), query="q", batch=i)
client.trigger_checkpoint()
for i in range(15, 20):
    writer.write(to_batch(data[i], PAIR), query="q", batch=i)

def hook(at, src, dst):
    if at == point:
        os.kill(os.getpid(), 9)

if point.startswith("remove-"):  # killed in the last step of a node's removal
    cluster.add_node()
    point = point[len("remove-"):]
    cluster._step_hook = lambda at, src, dst: not cluster.table.key_groups_of("node-0") and hook(at, src, dst)
    cluster.remove_node("node-0")
cluster._step_hook = hook
if point == "none":
    os.kill(os.getpid(), 9)
cluster.add_node()
"""


@pytest.mark.parametrize(
    "point",
    [
        pytest.param(p, marks=() if p == "none" else pytest.mark.long)
        for p in ("none", "load", "adopt", "adopted", "collect", "remove-load")
    ],
)
def test_a_restarted_driver_restores_the_cluster_its_killed_predecessor_ran(tmp_path, point):
    """The driver is killed (its nodes end with it) mid-stream or at a point of a handoff, or in
    the middle of the collection of checkpoints the handoff superseded; a new driver on the same
    directories starts new nodes, restores every key group from the checkpoint directory, and the
    job goes on: Spark replays the micro-batches it never saw committed."""
    import json
    import subprocess
    import sys

    from stretch.cluster import job_nodes
    from stretch.cluster.routing import RoutingStore

    directory, checkpoints = tmp_path / "cluster", tmp_path / "ck"
    name = f"restart-{point}"  # job names are unique in the test session's state directory
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(directory), str(checkpoints), point, name],
        stdout=subprocess.PIPE,
        cwd=os.getcwd(),
    )
    pids = json.loads(proc.stdout.readline())
    proc.wait(300)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids))
    before = RoutingStore(directory).load()
    data = batches(5, 30, 30)
    with StretchCluster.local(nodes=2, directory=directory, checkpoint_dir=checkpoints) as cluster:
        assert len(cluster.nodes) == len(before.nodes)  # new nodes, as many as the table had
        assert not set(cluster.nodes) & set(before.nodes)
        assert cluster.table.version == before.version + 1
        assert set(cluster.table.owners) == set(cluster.nodes)
        client = cluster.job(name)
        with client.writer("in") as writer:
            for i in range(30):  # Spark replays what it never saw committed, then goes on
                writer.write(to_batch(data[i], PAIR), query="q", batch=i)
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        nodes = job_nodes(cluster.address, name)
        assert nodes[:2] == ["node-0", "node-1"] and nodes[-len(cluster.nodes) :] == cluster.nodes
        assert_exactly_once(outputs(name, nodes), data)
    assert not list((directory / "jobs").glob("*.job"))  # closed, not died: a next driver resumes none


def test_a_job_without_checkpoints_goes_on_in_a_dead_nodes_key_groups_from_empty_state(tmp_path):
    """Such a job loses what the dead node held, as in Flink without checkpoints; the survivors take
    its key groups' new rows, which keep state and are read like any other."""
    data = batches(4, 30, 40)
    with StretchCluster.local(
        nodes=2, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "ck"
    ) as cluster:
        checkpointed = checkpointed_job("durable", cluster)  # a failure is restored for this one
        plain = count_sum_job().execute_async("plain", cluster=cluster)
        dead = set(cluster.table.key_groups_of("node-1"))
        assert _state(plain) == {}  # no key yet: a table without rows
        with plain.writer("in") as writer:
            for i, records in enumerate(data[:15]):
                writer.write(to_batch(records, PAIR), query="q", batch=i)
            kill(cluster, "node-1")
            wait_for(lambda: cluster.recoveries)
            for i, records in enumerate(data[15:], 15):
                writer.write(to_batch(records, PAIR), query="q", batch=i)
        kept = [r for records in data for r in records if key_group(r[0], 128) not in dead]
        fresh = [r for records in data[15:] for r in records if key_group(r[0], 128) in dead]
        expected = reference(kept + fresh)
        wait_for(lambda: _state(plain) == expected, timeout=60)
        checkpointed.cancel()
        plain.cancel()


def _state(client) -> dict:
    return {r["key"]: (r["count"], r["sum"]) for r in client.query_state("counts").to_pylist()}


@pytest.mark.long
def test_a_driver_whose_resume_fails_leaves_the_jobs_to_the_next_one(tmp_path, monkeypatch):
    """A restarted driver that fails while restoring (here: its recovery raises) must not forget
    the checkpointed jobs it was resuming: the driver started after it resumes them, exactly."""
    import json
    import subprocess
    import sys

    from stretch.cluster import job_nodes
    from stretch.cluster.failover import Failover

    directory, checkpoints, name = tmp_path / "cluster", tmp_path / "ck", "resume-fails"
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(directory), str(checkpoints), "none", name],
        stdout=subprocess.PIPE,
        cwd=os.getcwd(),
    )
    pids = json.loads(proc.stdout.readline())
    proc.wait(300)
    proc.stdout.close()
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids))

    def broken(self, *args, **kwargs):
        raise OSError("the checkpoint directory is not mounted")

    with monkeypatch.context() as m:
        m.setattr(Failover, "recover", broken)
        with pytest.raises(OSError, match="not mounted"):
            StretchCluster.local(nodes=2, directory=directory, checkpoint_dir=checkpoints)
    data = batches(5, 30, 30)
    with StretchCluster.local(nodes=2, directory=directory, checkpoint_dir=checkpoints) as cluster:
        client = cluster.job(name)
        with client.writer("in") as writer:
            for i in range(30):
                writer.write(to_batch(data[i], PAIR), query="q", batch=i)
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        assert_exactly_once(outputs(name, job_nodes(cluster.address, name)), data)
