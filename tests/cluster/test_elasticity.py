"""The cluster's node elasticity: the policy sees one busy fraction per node and decides a node
count; the controller adds and removes nodes accordingly while the job runs, losing nothing."""

from __future__ import annotations

import threading
import time

import pytest

from stretch.cluster import StretchCluster
from stretch.common.records import to_batch
from tests.cluster.jobs import PAIR, count_sum_job, reference


class Scripted:
    """A policy that answers from a script, then keeps the node count; remembers what it saw."""

    def __init__(self, answers):
        self.answers, self.loads = list(answers), []

    def decide(self, load):
        self.loads.append(load)
        return self.answers.pop(0) if self.answers else load.parallelism


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_the_controller_adds_and_removes_nodes_as_the_policy_decides(tmp_path):
    rows = [[(f"k{(b * 7 + i) % 53}", i % 5) for i in range(100)] for b in range(40)]
    policy = Scripted([9, 2])  # more than max_nodes: clamped to 3; then back to 2
    with StretchCluster.local(nodes=2, directory=tmp_path / "c") as cluster:
        client = count_sum_job().execute_async("elastic-nodes", cluster=cluster)
        done = threading.Event()

        def feed():
            with client.writer("in") as w:
                for b, batch in enumerate(rows):
                    w.write(to_batch(batch, PAIR), query="q", batch=b)
                    time.sleep(0.05)
            done.set()

        feeder = threading.Thread(target=feed)
        feeder.start()
        elasticity = cluster.enable_elasticity(policy, min_nodes=1, max_nodes=3, interval_ms=200)
        deadline = time.monotonic() + 60
        while len(elasticity.changes) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        feeder.join(60)
        assert done.is_set() and elasticity.error is None
        state = {r["key"]: (r["count"], r["sum"]) for r in client.query_state("counts").to_pylist()}
        client.cancel()
    assert [(kind, node) for kind, node, _ in elasticity.changes] == [("add", "node-2"), ("remove", "node-2")]
    assert elasticity.changes[0][2].key_groups_moved > 0
    first = policy.loads[0]
    assert first.parallelism == 2 and len(first.busy) == 2 and all(0 <= b <= 1.5 for b in first.busy)
    assert any(load.parallelism == 3 and len(load.busy) == 3 for load in policy.loads)
    assert state == reference([r for b in rows for r in b])


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_a_node_change_cut_short_by_a_nodes_death_does_not_end_the_controller(tmp_path):
    """The node the controller adds dies while it adopts key groups: the cluster restores them
    from its checkpoint directory, the controller notes the loss and adds a node again."""
    import os
    import signal

    rows = [[(f"k{(b * 7 + i) % 53}", i % 5) for i in range(100)] for b in range(30)]
    policy = Scripted([3, 3])
    with StretchCluster.local(nodes=2, directory=tmp_path / "c", checkpoint_dir=tmp_path / "ck") as cluster:
        env = count_sum_job()
        env.enable_checkpointing()
        client = env.execute_async("elastic-lost", cluster=cluster)
        killed = []

        def hook(at, src, dst):
            if at == "adopt" and not killed:
                killed.append(dst)
                os.kill(cluster.launcher.pids()[dst], signal.SIGKILL)

        cluster._step_hook = hook
        with client.writer("in") as w:
            for b, batch in enumerate(rows[:10]):
                w.write(to_batch(batch, PAIR), query="q", batch=b)
            elasticity = cluster.enable_elasticity(policy, min_nodes=1, max_nodes=3, interval_ms=200)
            for b, batch in enumerate(rows[10:], start=10):
                w.write(to_batch(batch, PAIR), query="q", batch=b)
                time.sleep(0.05)
            deadline = time.monotonic() + 120
            while not elasticity.changes and time.monotonic() < deadline:
                time.sleep(0.05)
        elasticity.stop()
        assert elasticity.error is None and len(elasticity.lost) == 1
        assert killed == ["node-2"] and [(k, n) for k, n, _ in elasticity.changes] == [("add", "node-3")]
        assert cluster.nodes == ["node-0", "node-1", "node-3"]
        state = {r["key"]: (r["count"], r["sum"]) for r in client.query_state("counts").to_pylist()}
        client.cancel()
    assert state == reference([r for b in rows for r in b])
