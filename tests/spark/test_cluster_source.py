"""Spark reads a cluster job's results and keyed state with .option("cluster", address): every
node's, a removed node's last results included, each result and each key once; from and to the
offsets asked, per node."""

from __future__ import annotations

import json
import re

import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from stretch.cluster import StretchCluster
from stretch.common.records import to_batch
from stretch.runtime.channel_log import ChannelLog
from stretch.runtime.state_dir import channel_dir
from stretch.spark.cluster_source import ClusterBatchReader, ClusterStreamReader
from tests.cluster.jobs import PAIR, count_sum_job, reference
from tests.cluster.test_cluster import batches, write_all


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


RESULTS = StructType(
    [StructField("f0", StringType()), StructField("f1", LongType()), StructField("f2", LongType())]
)


def held(job: str, node: str) -> tuple[int, list[list[tuple]]]:
    """Node ``node``'s output log of ``job``, read straight from its files: its oldest offset and
    the rows of each batch from there on."""
    log = ChannelLog(channel_dir(f"{job}@{node}", "out"), create=False)
    try:
        start = log.start_offset
        return start, [[tuple(r.values()) for r in b.to_pylist()] for b in log.read(start)]
    finally:
        log.close()


@pytest.mark.long  # about 50 s: two clusters, seven Spark reads and two queries
def test_cluster_reads_start_and_end_at_the_offsets_asked_on_each_node(spark, tmp_path):
    """startingOffsets and endingOffsets of a cluster read, by the cluster's directory and by its
    URL, against each node's log read directly, after two clusters ran the job under one name:
    the second run's results by default, every run's from earliest, ranges per node as Spark
    shows this source's offsets, and impossible offsets refused naming the node."""
    job = "offsets per node"
    runs = [batches(21, 3, 30), batches(22, 4, 30)]
    for n, data in enumerate(runs):
        with StretchCluster.local(nodes=2, directory=tmp_path / f"cluster-{n}") as cluster:
            client = count_sum_job().execute_async(job, cluster=cluster)
            with client.writer("in") as writer:
                write_all(writer, data)
            client.end("in")
            assert set(client.wait(120).values()) == {"FINISHED"}
            if n == 0:  # where the second run's results start on each node
                first = {}
                for node in cluster.nodes:
                    start, rows = held(job, node)
                    first[node] = start + len(rows)
                continue
            logs = {node: held(job, node) for node in cluster.nodes}
            end = {node: start + len(rows) for node, (start, rows) in logs.items()}

            def model(a: dict, b: dict) -> list[tuple]:
                """What the logs hold of each node's offsets a[node] .. b[node], by plain slicing."""
                out = []
                for node, (start, rows) in logs.items():
                    out += [r for batch in rows[max(a[node], start) - start : b[node] - start] for r in batch]
                return sorted(out)

            def options_of(address=cluster.address, **options) -> dict[str, str]:
                out = {"cluster": address, "job": job, "channel": "out", **options}
                if address == cluster.url:
                    out["secret"] = cluster.secret
                for key, value in options.items():
                    out[key] = value if isinstance(value, str) else json.dumps({"nodes": value})
                return out

            def read(address=cluster.address, **options) -> list[tuple]:
                reader = spark.read.format("stretch")
                for key, value in options_of(address, **options).items():
                    reader = reader.option(key, value)
                return sorted(tuple(r) for r in reader.load().collect())

            def refused(match: str, reader=ClusterBatchReader, **options) -> None:
                """Refused where Spark creates the reader (a batch read's start), or by a streaming
                query's first offsets."""
                with pytest.raises(ValueError, match=match):
                    created = reader(options_of(**options), RESULTS)
                    if isinstance(created, ClusterStreamReader):
                        created.initialOffset()

            nodes = sorted(logs)
            assert nodes == ["node-0", "node-1"]
            earliest = {node: start for node, (start, _) in logs.items()}
            assert all(first[node] >= earliest[node] + 1 and end[node] >= first[node] + 3 for node in nodes)
            this_run, both = model(first, end), model(earliest, end)
            expected = reference([r for records in runs[1] for r in records])  # the model checked itself
            assert len(this_run) == sum(map(len, runs[1]))  # one result per record
            assert len(both) == len(this_run) + sum(map(len, runs[0]))
            assert {k: (c, s) for k, c, s in this_run if (c, s) == expected[k]} == expected

            assert read() == this_run  # "run" by default: the second run's results only
            assert read(startingOffsets="earliest") == both
            a, b = {"node-0": 1}, {"node-1": first["node-1"] + 2}  # node-0 from the first run on
            assert read(startingOffsets=a, endingOffsets=b) == model({**first, **a}, {**end, **b})
            past = {"node-0": end["node-0"] + 100, "node-1": end["node-1"] + 9}  # up to the end
            assert read(startingOffsets={"node-1": end["node-1"] + 5}, endingOffsets=past) == model(
                first, {**end, "node-1": first["node-1"]}
            )
            by_url = {"node-0": first["node-0"] + 1}  # by URL: each node's log over Flight, the same
            assert read(cluster.url, startingOffsets="run", endingOffsets=by_url) == model(
                first, {**end, **by_url}
            )

            at = f"channel 'out' of job '{job}' on node"
            holds = f"its log holds offsets {earliest['node-1']} to {end['node-1'] - 1}"
            ending_first = (
                f"endingOffsets 1 is before startingOffsets {first['node-1']} on {at} 'node-1': {holds}"
            )
            with pytest.raises(Exception, match=ending_first):  # as Spark shows it, by URL
                read(cluster.url, endingOffsets={"node-1": 1})
            refused(ending_first, endingOffsets={"node-1": 1})
            for reader in (ClusterBatchReader, ClusterStreamReader):
                refused(
                    f"startingOffsets -1 is before the oldest batch {at} 'node-1' still holds: {holds}",
                    reader,
                    startingOffsets={"node-1": -1},
                )
                refused(
                    f"startingOffsets names node 'node-9', which job '{job}' never ran on: it ran on node-0, node-1",
                    reader,
                    startingOffsets={"node-9": 0},
                )
            accepted = (
                r'must be run, earliest, latest or \{"nodes": \{"<node>": <offset>, \.\.\.\}\} on a cluster'
            )
            with pytest.raises(Exception, match=f"startingOffsets {accepted}, got 'soon'"):
                read(startingOffsets="soon")  # as Spark shows it
            for bad in ("5", '{"nodes": {"node-0": 1}', '{"nodes": {"node-0": "1"}}', '{"node-0": 1}'):
                for reader in (ClusterBatchReader, ClusterStreamReader):
                    refused(
                        f"startingOffsets {accepted}, got {re.escape(repr(bad))}", reader, startingOffsets=bad
                    )
            refused(r"endingOffsets must be latest or \{\"nodes\"", endingOffsets="earliest")
            assert ClusterBatchReader(options_of(startingOffsets="latest"), RESULTS).partitions() == []

            def stream(name: str, starting: str):
                return (
                    spark.readStream.format("stretch")
                    .option("cluster", cluster.address)
                    .option("job", job)
                    .option("channel", "out")
                    .option("startingOffsets", starting)
                    .load()
                    .writeStream.format("memory")
                    .queryName(name)
                    .trigger(availableNow=True)
                    .start()
                )

            offsets = {"node-0": 1, "node-1": end["node-1"] + 3}  # node-1: past its end, nothing yet
            streamed = stream("cluster_offsets", json.dumps({"nodes": offsets}))
            streamed.awaitTermination(120)
            got = sorted(tuple(r) for r in spark.sql("select * from cluster_offsets").collect())
            assert got == model(offsets, end)
            shown = streamed.lastProgress["sources"][0]["endOffset"]  # what a user may copy
            shown = json.loads(shown) if isinstance(shown, str) else shown
            assert shown == {"nodes": {**end, "node-1": offsets["node-1"]}}  # node-1 waits for its offset
            with pytest.raises(
                Exception, match=f"startingOffsets -1 is before the oldest batch {at} 'node-0' still holds"
            ):
                stream("cluster_offsets_refused", json.dumps({"nodes": {"node-0": -1}})).awaitTermination(120)
