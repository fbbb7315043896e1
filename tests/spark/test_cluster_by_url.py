"""Spark and a cluster by URL: a streaming query's executors send their rows straight to the
owning nodes (nothing staged), exactly once across a micro-batch Spark replays after a node joined;
results and keyed state read back over Flight, a removed node's results included."""

from __future__ import annotations

import pytest

from stretch.cluster import StretchCluster
from tests.cluster.jobs import count_sum_job, reference
from tests.cluster.test_hosts import network_address
from tests.spark.test_cluster_sink import files


def stream_into(spark, url: str, secret: str, job: str, source, checkpoint):
    stream = spark.readStream.schema("user STRING, amount BIGINT").option("maxFilesPerTrigger", 1)
    writer = (
        stream.parquet(str(source))
        .writeStream.format("stretch")
        .option("cluster", url)
        .option("secret", secret)
        .option("job", job)
        .option("channel", "in")
        .option("checkpointLocation", str(checkpoint))
    )
    query = writer.trigger(availableNow=True).start()
    query.awaitTermination()
    return query


@pytest.mark.long  # about two minutes on two busy cores, most of it Spark's micro-batches
def test_spark_writes_and_reads_a_cluster_by_url_exactly_once_across_a_replay(spark, tmp_path):
    source, checkpoint = tmp_path / "in", tmp_path / "ckpt"
    host = network_address()
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster", host=host) as cluster:
        url, secret = cluster.url, cluster.secret
        client = count_sum_job().execute_async("url-job", cluster=cluster)
        rows = files(source, parts=2, rows=200, seed=11)
        first = stream_into(spark, url, secret, "url-job", source, checkpoint)
        assert [p["batchId"] for p in first.recentProgress if p["numInputRows"]] == [0, 1]
        cluster.add_node()
        for name in ("1", ".1.crc"):  # Spark forgets it committed micro-batch 1: it runs it again
            (checkpoint / "commits" / name).unlink(missing_ok=True)
        rows += files(source, parts=1, rows=200, seed=12)
        second = stream_into(spark, url, secret, "url-job", source, checkpoint)
        assert [p["batchId"] for p in second.recentProgress if p["numInputRows"]] == [1, 2]
        cluster.remove_node("node-0")
        assert not list((tmp_path / "cluster" / "staging").iterdir())  # nothing staged by URL

        def read():
            reader = spark.read.format("stretch").option("cluster", url).option("secret", secret)
            return reader.option("job", "url-job")

        state_df = read().option("state", "counts").load()
        state = {r["key"]: (r["count"], r["sum"]) for r in state_df.collect()}
        plan = state_df._jdf.queryExecution().toString()
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        results = [tuple(r) for r in read().option("channel", "out").load().collect()]
        streamed = (
            spark.readStream.format("stretch")
            .option("cluster", url)
            .option("secret", secret)
            .option("job", "url-job")
            .option("channel", "out")
            .load()
            .writeStream.format("memory")
            .queryName("url_results")
            .trigger(availableNow=True)
            .start()
        )
        streamed.awaitTermination(120)
        again = [tuple(r) for r in spark.sql("select * from url_results").collect()]
    want = reference(rows)
    assert state == want  # each key once, from the node that owns it now
    assert secret not in plan  # a Python data source's plan shows no options (Spark would redact "secret")
    assert sorted(results) == sorted(again)
    assert len(results) == len(rows)  # one result per row: the replay added none, node-0's are read
    final: dict = {}
    for key, count, total in results:
        final[key] = max(final.get(key, (0, 0)), (count, total))
    assert final == want
