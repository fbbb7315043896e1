"""What a user sees when a cluster call goes wrong: the reason, in a few words, and nothing started
or left behind (no node's traceback in the message, no node process for a closed cluster)."""

from __future__ import annotations

import threading

import pyarrow.flight as flight
import pytest

from stretch.cluster import StretchCluster
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.errors import JobExecutionError, UnpicklableFunction
from tests.cluster.jobs import PAIR, count_sum_job, failing_job


def test_wrong_names_empty_state_and_a_failed_job_say_what_happened(tmp_path):
    with StretchCluster.local(nodes=2, directory=tmp_path / "c") as cluster:
        client = count_sum_job().execute_async("counts", cluster=cluster)
        empty = client.query_state("counts")  # no row yet: a table without rows, as on one machine
        assert empty.num_rows == 0 and "key" in empty.column_names
        with pytest.raises(
            LookupError, match=r"no node 'node-9' in the cluster \(nodes: \['node-0', 'node-1'\]\)"
        ):
            client.rescale("counts", 2, node="node-9")
        with pytest.raises(
            flight.FlightServerError, match="KeyError: job 'counts' has no input channel 'nope'"
        ) as e:
            client.end("nope")
        assert "Traceback" not in str(e.value)
        lock = threading.Lock()
        unshippable = StreamExecutionEnvironment.get_execution_environment()
        keyed = unshippable.from_source(ChannelSource("in", PAIR), None, "in").key_by(0).sum(1)
        keyed.map(lambda r: (lock, r)[1], PAIR).name("guarded").sink_to(DiscardingSink())
        with pytest.raises(UnpicklableFunction, match="map function of operator 'guarded' cannot be shipped"):
            unshippable.execute_async("unshippable", cluster=cluster)
        failing = failing_job().execute_async("fails", cluster=cluster)
        with failing.writer("in") as w:
            w.write([("a", 1), ("b", 13), ("c", 2)])
        with pytest.raises(
            JobExecutionError, match=r"job 'fails' failed on node node-\d: UserFunctionError: .*thirteen"
        ):
            failing.wait(timeout=60)  # the node without key 'b' is cancelled: the whole job failed
        failed_on = cluster.failures["fails"]["node"]
        statuses = {
            n: r["status"]
            for n, r in ((n, cluster.connection.action(n, "wait", {"job": "fails"})) for n in cluster.nodes)
        }
        assert statuses == {n: "FAILED" if n == failed_on else "CANCELED" for n in cluster.nodes}
        client.cancel()


def test_a_closed_cluster_refuses_node_changes_writers_and_jobs_and_starts_no_node(tmp_path):
    cluster = StretchCluster.local(nodes=1, directory=tmp_path / "c")
    cluster.close()
    cluster.close()  # twice: nothing more to do
    for call in (cluster.add_node, lambda: cluster.remove_node("node-0"), lambda: cluster.writer("j", "in")):
        with pytest.raises(RuntimeError, match="is closed"):
            call()
    with pytest.raises(RuntimeError, match="is closed"):
        count_sum_job().execute_async("counts", cluster=cluster)
    assert cluster.launcher.pids() == {} and cluster.nodes == []
