"""Spark reads a cluster job's results and keyed state with .option("cluster", address): every
node's, a removed node's last results included, each result and each key once."""

from __future__ import annotations

import pytest

from stretch.cluster import StretchCluster
from stretch.common.records import to_batch
from tests.cluster.jobs import PAIR, count_sum_job, reference


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_results_and_state_of_every_node_across_node_changes(spark, tmp_path):
    rows = [[(f"u{(b * 37 + i) % 89}", (b + i) % 13) for i in range(150)] for b in range(3)]
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster") as cluster:
        client = count_sum_job().execute_async("read-cluster", cluster=cluster)
        with client.writer("in") as w:
            w.write(to_batch(rows[0], PAIR), query="q", batch=0)
            cluster.add_node()
            w.write(to_batch(rows[1], PAIR), query="q", batch=1)
            cluster.remove_node("node-0")
            w.write(to_batch(rows[2], PAIR), query="q", batch=2)

        def read():
            return (
                spark.read.format("stretch").option("cluster", cluster.address).option("job", "read-cluster")
            )

        state = {r["key"]: (r["count"], r["sum"]) for r in read().option("state", "counts").load().collect()}
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        results = [tuple(r) for r in read().option("channel", "out").load().collect()]
        streamed = (
            spark.readStream.format("stretch")
            .option("cluster", cluster.address)
            .option("job", "read-cluster")
            .option("channel", "out")
            .load()
            .writeStream.format("memory")
            .queryName("cluster_results")
            .trigger(availableNow=True)
            .start()
        )
        streamed.awaitTermination(120)
        again = [tuple(r) for r in spark.sql("select * from cluster_results").collect()]
    want = reference([r for b in rows for r in b])
    assert state == want  # each key once, from the node that owns it now
    assert sorted(results) == sorted(again)  # the streaming read: the same, node by node
    assert len(results) == sum(map(len, rows))  # one result per row, the removed node's included
    final: dict = {}
    for key, count, total in results:
        final[key] = max(final.get(key, (0, 0)), (count, total))
    assert final == want
