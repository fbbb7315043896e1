"""Stretch nodes inside Spark: each a long-running Spark task; a node added and one removed while a
job runs, with the result checked against the plain-Python reference."""

from __future__ import annotations

from stretch.cluster import StretchCluster
from stretch.common.records import to_batch
from tests.cluster.jobs import PAIR, count_sum_job, reference
from tests.cluster.test_cluster import batches, outputs


def test_nodes_run_as_spark_tasks_and_hand_key_groups_over(spark, tmp_path):
    data = batches(5, 20, 40)
    # local[2,2] has two task slots: one node, then two while the second joins and the first leaves
    with StretchCluster.on_spark(spark, nodes=1, directory=tmp_path / "cluster") as cluster:
        tracker = spark.sparkContext.statusTracker()
        assert set(tracker.getJobIdsForGroup("stretch-node-node-0")) & set(tracker.getActiveJobsIds())
        client = count_sum_job().execute_async("on-spark", cluster=cluster)
        with client.writer("in") as w:
            for i, records in enumerate(data[:10]):
                w.write(to_batch(records, PAIR), query="q", batch=i)
            added = cluster.add_node()
            assert added.key_groups_moved == 64
            for i, records in enumerate(data[10:], start=10):
                w.write(to_batch(records, PAIR), query="q", batch=i)
            removed = cluster.remove_node("node-0")
            assert removed.key_groups_moved == 64
            w.write(to_batch(data[3], PAIR), query="q", batch=3)  # a replay: dropped
        client.end("in")
        assert client.wait(120) == {"node-1": "FINISHED"}
        got = outputs("on-spark", ["node-0", "node-1"])
    rows = [r for records in data for r in records]
    final = {}
    for key, count, total in got:
        final[key] = max(final.get(key, (0, 0)), (count, total))
    assert final == reference(rows)
    assert len(got) == len(rows)
