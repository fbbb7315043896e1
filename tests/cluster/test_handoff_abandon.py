"""A pre-copied move given up before its routing version is saved (the driver's call fails right
after the pre-copy, or the new owner refuses to pre-adopt): the old owner takes its key groups
back and processes them on, the rows it pre-copied and those it took meanwhile first, each once;
its gates are no longer pinned (writers go on past a full ring of the gate), and the same node
change made again succeeds. Every key's running count and sum equal a plain-Python model's, in
order, and no node leaves a shared-memory segment behind."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import pytest

from stretch.cluster import StretchCluster
from stretch.common.records import to_batch
from tests.cluster.jobs import PAIR, count_sum_job, reference
from tests.cluster.test_cluster import batches, outputs
from tests.cluster.test_handoff_backlog import BURST, COST_US, Backlog, assert_in_order
from tests.cluster.test_recovery import _state, wait_for

RING = 64  # a gate's entries (Coordinator config gate_slots): a pin left open stalls writers past it


class Injected(RuntimeError):
    """The failure a test makes a move meet."""


def watch_undo(cluster: StretchCluster, refuse: bool) -> dict[str, dict]:
    """The replies to the driver's ``unpreadopt`` and ``unprecopy``; with ``refuse``, the new owner
    of the next move refuses its pre-adoption (after fetching its state and rows)."""
    connection = cluster.connection
    action = connection.action
    replies: dict[str, dict] = {}

    def watched(node, kind, body=b""):
        if kind == "preadopt" and refuse and "refused" not in replies:
            replies["refused"] = {"node": node}
            raise Injected(f"{node} refuses to pre-adopt")
        reply = action(node, kind, body)
        if kind in ("unpreadopt", "unprecopy"):
            replies[kind] = reply
        return reply

    connection.action = watched
    return replies


@pytest.mark.parametrize("failure", ["driver", "refused"])
def test_a_move_abandoned_after_its_pre_copy_is_taken_back_by_its_old_owner(tmp_path, failure):
    """2 nodes under a backlog, node-1 removed without checkpoints: its first move fails after the
    pre-copy, with rows of the moving key groups taken meanwhile (``driver``: the new owner had
    pre-adopted them and worked some off, and gives the state they reached back; ``refused``: it
    had not, and the old owner goes on from its own copy). The node change fails, the routing
    table is as before, node-1 holds no pre-copy; more micro-batches than its gate's ring holds go
    through; the node change made again moves every key group."""
    data = batches(21, 40 + RING * 2, 20)
    burst = batches(22, BURST, 60)
    name = f"abandon-{failure}"
    written = [*data[:10], *burst, *data[10:]]  # micro-batch i is written[i]
    during = iter(range(10 + BURST, 10 + BURST + 3))
    with StretchCluster.local(nodes=2, step=8) as cluster:
        pids = list(cluster.launcher.pids().values())  # their segments: none is left after the close
        client = count_sum_job(cost_us=COST_US).execute_async(name, cluster=cluster)
        writer = client.writer("in")
        for i in range(10):
            writer.write(to_batch(written[i], PAIR), query="q", batch=i)

        def meanwhile(at, src, dst):  # rows for the old owner while its key groups are pre-copied
            if at == "precopied":
                for i in itertools.islice(during, 1):
                    writer.write(to_batch(written[i], PAIR), query="q", batch=i)
                if failure == "driver":
                    raise Injected("the driver gives up the move after its pre-copy")

        replies = watch_undo(cluster, refuse=failure == "refused")
        before = cluster.table
        leaving = len(before.key_groups_of("node-1"))
        cluster._step_hook = Backlog(cluster, client, writer, written, first=10, also=meanwhile)
        with pytest.raises(Injected):
            cluster.remove_node("node-1")
        cluster._step_hook = None
        # the new owner gave back the state its pre-adopted rows reached, or had none to give
        assert bool(replies["unpreadopt"]["returned"]) == (failure == "driver"), replies
        assert replies["unprecopy"]["taken_back"], replies
        assert cluster.table.version == before.version and cluster.table.owners == before.owners
        for node in cluster.nodes:
            status = cluster.connection.action(node, "status")
            assert status["precopies"] == [], status["precopies"]  # no gate pinned
            assert len(status["key_groups"]) == len(before.key_groups_of(node))

        later = [*during, *range(10 + BURST + 3, 10 + BURST + 3 + RING * 2)]
        errors = []

        def stream():  # more entries than a gate holds: a pin left open would stall them for good
            try:
                for i in later:
                    writer.write(to_batch(written[i], PAIR), query="q", batch=i)
            except BaseException as e:
                errors.append(e)

        feeder = threading.Thread(target=stream)
        feeder.start()
        feeder.join(120)
        assert not feeder.is_alive(), "writers stalled: a gate of the old owner is still pinned"
        assert not errors, errors

        # the same node change again, once the backlog is worked off (the test of many epochs in a
        # row under one is tests/runtime/test_rescaler.py's)
        expected = reference([r for records in written[: later[-1] + 1] for r in records])
        wait_for(lambda: _state(client) == expected)  # each key's count and sum: the model's
        removed = cluster.remove_node("node-1")
        assert removed.key_groups_moved == leaving
        assert len(removed.precopy_ms) == len(removed.step_ms) > 0
        for i in range(later[-1] + 1, len(written)):
            writer.write(to_batch(written[i], PAIR), query="q", batch=i)
        writer.close()
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        assert_in_order(outputs(name, ["node-0", "node-1"]), written)
    left = [p.name for pid in pids for p in Path("/dev/shm").glob(f"stretch-{os.getuid()}-{pid}-*")]
    assert not left, left
