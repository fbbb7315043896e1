"""The one-query stage with a job on a stretch cluster, on local Spark: results checked against
plain Python on the same rows, in append and update mode, through a task that Spark retries after
a node joined, a node removed mid-query, a restart of the query from its checkpoint, a node killed
(checkpointed job), by URL to nodes that share no memory with Spark, and on nodes that run inside
Spark's executors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stretch.cluster import StretchCluster
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import OutputTag, StreamExecutionEnvironment, aggregates
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.window import TumblingEventTimeWindows
from stretch.errors import JobEnded
from stretch.spark import stage
from tests.spark.steps import fail_first_attempt
from tests.spark.test_stage import _files

RECORD = Types.TUPLE([Types.LONG(), Types.LONG()])  # user, amount


def totals_job(checkpoint_ms: int | None = None) -> StreamExecutionEnvironment:
    """Running totals per user, keyed by a function (routed by it on the cluster)."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    if checkpoint_ms:
        env.enable_checkpointing(checkpoint_ms)
    env.from_source(ChannelSource("in", RECORD), None, "in").key_by(lambda r: r[0]).sum(1).name(
        "totals"
    ).sink_to(ChannelSink("out"))
    return env


def update_reference(files, totals=None) -> list[list[tuple[int, int]]]:
    """Per micro-batch (a file each), each of its keys' total after it."""
    totals = dict(totals or {})
    out = []
    for records in files:
        for k, v in records:
            totals[k] = totals.get(k, 0) + v
        out.append(sorted((k, totals[k]) for k in {k for k, _ in records}))
    return out


def assert_running_sums(results, rows, before=None) -> None:
    """Append mode: one result per row, each key's results its distinct running sums (amounts
    are positive), ending at its total (``before``: totals earlier rows left)."""
    before = before or {}
    assert sorted(k for k, _ in results) == sorted(k for k, _ in rows)
    totals = dict(before)
    for k, v in rows:
        totals[k] = totals.get(k, 0) + v
    by_key: dict = {}
    for k, v in results:
        by_key.setdefault(k, []).append(v)
    for k, sums in by_key.items():
        assert len(set(sums)) == len(sums) and max(sums) == totals[k] and min(sums) > before.get(k, 0), k


def streamed(spark, client, source, checkpoint, mode: str, sink, step=None):
    """A streaming query, a file per micro-batch, through the stage into ``sink`` (foreachBatch)."""
    clicks = spark.readStream.schema("user long, amount long").option("maxFilesPerTrigger", 1)
    keys = {"key": "user", "result_key": "f0"} if mode == "update" else {}
    results = stage(clicks.parquet(str(source)), client, into="in", out="out", mode=mode, **keys)
    if step is not None:
        results = results.mapInArrow(step, results.schema)
    return (
        results.writeStream.outputMode("update" if mode == "update" else "append")
        .foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )


def test_append_and_update_mode_give_each_task_the_results_its_rows_caused_on_every_node(spark):
    """Batch DataFrames through a job on two nodes: every task's rows split over both; a task
    retried after the stage gets its first attempt's results, its rows taken once."""
    with StretchCluster.local(nodes=2) as cluster:
        client = totals_job().execute_async("cluster stage modes", cluster=cluster)
        rows = [(i % 11, i + 1) for i in range(400)]
        df = spark.createDataFrame(rows, "user long, amount long").repartition(2)
        results = stage(df, client, into="in", out="out")
        appended = [tuple(r) for r in results.mapInArrow(fail_first_attempt, results.schema).collect()]
        more = [(i % 13, 2 * i + 1) for i in range(300)]
        df = spark.createDataFrame(more, "user long, amount long")
        updated = stage(df, client, into="in", out="out", mode="update", key="user", result_key="f0")
        latest = sorted(tuple(r) for r in updated.collect())
        client.cancel()
    assert_running_sums(appended, rows)
    totals: dict = {}
    for k, v in rows + more:
        totals[k] = totals.get(k, 0) + v
    assert latest == sorted(totals.items())  # each key once, its latest total


def test_a_job_that_re_keys_across_nodes_is_refused_by_the_stage_saying_why(spark):
    """Its results come from the nodes owning the next key groups, not from those taking a
    task's rows: the stage cannot return them, and says what to do instead; once the job ended,
    the stage says that."""
    env = StreamExecutionEnvironment.get_execution_environment()
    totals = env.from_source(ChannelSource("in", RECORD), None, "in").key_by(0).sum(1).name("totals")
    totals.key_by(1).sum(0).name("by total").sink_to(ChannelSink("out"))
    with StretchCluster.local(nodes=1) as cluster:
        client = env.execute_async("re-keyed stage", cluster=cluster)
        df = spark.createDataFrame([(1, 2)], "user long, amount long")
        with pytest.raises(ValueError, match=r"re-keys across nodes \(totals->by total\).*readStream"):
            stage(df, client, into="in", out="out")
        client.cancel()
        client.wait(30)
        # an ended job is refused before anything is asked of it, saying how it ended
        ended = "job 're-keyed stage' has ended on the cluster \\(CANCELED\\): it cannot be staged; start it again"
        with pytest.raises(JobEnded, match=ended):
            stage(df, client, into="in", out="out")


@pytest.mark.long
def test_append_and_update_mode_are_exact_through_a_task_retried_after_a_node_joined(spark, tmp_path):
    """The first attempt of micro-batch 1's tasks asks the cluster's driver for a node, then fails
    after the stage: Spark retries each task, whose rows now go to other owners for a third of
    the key groups; those answer with the results the first attempt caused, which moved with them."""
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster") as cluster:
        client = totals_job().execute_async("cluster stage", cluster=cluster)
        rows = [(i % 7, i + 1) for i in range(300)]
        df = spark.createDataFrame(rows, "user long, amount long").repartition(3)
        appended = [tuple(r) for r in stage(df, client, into="in", out="out").collect()]
        files = _files(tmp_path / "in", parts=3, rows=200)
        address = cluster.address
        got: dict[int, list] = {}

        def add_a_node_then_fail(batches):
            from pyspark import TaskContext

            from stretch.cluster.client import ClusterConnection

            batches = list(batches)
            context = TaskContext.get()
            if context.getLocalProperty("streaming.sql.batchId") == "1" and context.attemptNumber() == 0:
                if context.partitionId() == 0:
                    with ClusterConnection(address) as connection:
                        assert connection.driver_action("add_node")["ok"]
                raise RuntimeError("injected task failure")
            yield from batches

        def collect(df, batch_id):
            got[batch_id] = sorted(tuple(r) for r in df.collect())

        query = streamed(
            spark, client, tmp_path / "in", tmp_path / "ckpt", "update", collect, add_a_node_then_fail
        )
        query.awaitTermination(300)
        assert query.exception() is None
        assert cluster.nodes == ["node-0", "node-1", "node-2"]
        client.cancel()
    assert_running_sums(appended, rows)
    before = {}
    for k, v in rows:
        before[k] = before.get(k, 0) + v
    assert [got[b] for b in sorted(got)] == update_reference(files, before)


@pytest.mark.long
def test_by_url_without_shared_memory_a_removed_node_and_a_query_restart_lose_and_repeat_nothing(
    spark, tmp_path
):
    """Nodes in mount namespaces of their own (nothing shared with Spark's tasks) listening beyond
    loopback: the stage reaches them by the cluster's URL, over Flight. A node is removed while
    the query runs; the query's sink then fails at micro-batch 3, after the stage answered it, and
    the restarted query replays that micro-batch: the stage gives the same results again."""
    from tests.cluster.test_hosts import network_address

    host = network_address()
    with StretchCluster.local(
        nodes=3, directory=tmp_path / "cluster", host=host, private_shm_mb=256
    ) as cluster:
        client = totals_job().execute_async("cluster stage url", cluster=cluster)
        files = _files(tmp_path / "in", parts=6, rows=300)
        got: dict[int, list] = {}
        first_run = {"failed": False}

        def collect(df, batch_id):
            rows = [tuple(r) for r in df.collect()]
            if batch_id == 3 and not first_run["failed"]:
                first_run["failed"] = True
                raise RuntimeError("injected sink failure")
            got[batch_id] = rows

        def remove_when_going():
            while 1 not in got:
                time.sleep(0.05)
            cluster.remove_node("node-0")

        remover = threading.Thread(target=remove_when_going)
        remover.start()
        query = streamed(spark, client, tmp_path / "in", tmp_path / "ckpt", "append", collect)
        with pytest.raises(Exception, match="injected sink failure"):
            query.awaitTermination(300)
        remover.join(120)
        assert cluster.nodes == ["node-1", "node-2"] and 3 not in got
        query = streamed(spark, client, tmp_path / "in", tmp_path / "ckpt", "append", collect)
        query.awaitTermination(300)
        assert query.exception() is None
        client.cancel()
    assert sorted(got) == list(range(6))
    assert_running_sums([r for b in got.values() for r in b], [r for f in files for r in f])


@pytest.mark.long
def test_a_checkpointed_job_loses_and_repeats_nothing_when_a_node_is_killed_mid_query(spark, tmp_path):
    """checkpoint_dir: node-1 is killed while micro-batches run; its key groups are restored on
    node-0 from the checkpoint directory (the rows it took since its checkpoint replayed from its
    journal, as parts of their transactions), and the tasks waiting on it get their results there."""
    with StretchCluster.local(
        nodes=2, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "checkpoints"
    ) as cluster:
        client = totals_job(checkpoint_ms=100).execute_async("cluster stage killed", cluster=cluster)
        files = _files(tmp_path / "in", parts=6, rows=300)
        got: dict[int, list] = {}

        def collect(df, batch_id):
            got[batch_id] = sorted(tuple(r) for r in df.collect())
            if batch_id == 2:
                os.kill(cluster.launcher.pids()["node-1"], signal.SIGKILL)

        query = streamed(spark, client, tmp_path / "in", tmp_path / "ckpt", "update", collect)
        query.awaitTermination(300)
        assert query.exception() is None
        assert [r["nodes"] for r in cluster.recoveries] == [["node-1"]] and not cluster.supervisor_errors
        client.cancel()
    assert [got[b] for b in sorted(got)] == update_reference(files)


ON_SPARK = textwrap.dedent(
    """
    import json, sys, threading, time
    from pyspark.sql import SparkSession
    from stretch.cluster import StretchCluster
    from stretch.spark import stage
    from tests.spark.test_cluster_stage import totals_job, update_reference
    from tests.spark.test_stage import _files
    from pathlib import Path

    spark = (
        SparkSession.builder.master("local-cluster[2,2,1024]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.python.authenticate.socketTimeout", "120s")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    work = Path(sys.argv[1])
    files = _files(work / "in", parts=4, rows=300)
    got = {}
    try:
        with StretchCluster.on_spark(spark, nodes=2, directory=work / "cluster", host="0.0.0.0") as cluster:
            client = totals_job().execute_async("on-spark-stage", cluster=cluster)

            def collect(df, batch_id):
                got[batch_id] = sorted(tuple(r) for r in df.collect())
                if batch_id == 1:
                    cluster.add_node()

            clicks = spark.readStream.schema("user long, amount long").option("maxFilesPerTrigger", 1)
            results = stage(clicks.parquet(str(work / "in")), client, into="in", out="out", mode="update",
                            key="user", result_key="f0")
            query = (results.writeStream.outputMode("update").foreachBatch(collect)
                     .option("checkpointLocation", str(work / "ckpt")).trigger(availableNow=True).start())
            query.awaitTermination(300)
            nodes = cluster.nodes
            client.cancel()
    finally:
        spark.stop()
    print(json.dumps({"nodes": nodes, "exact": [got[b] for b in sorted(got)] == update_reference(files)}))
    """
)


@pytest.mark.long
def test_the_stage_runs_on_nodes_inside_spark_executors(tmp_path):
    """local-cluster[2,2,1024]: two executor JVMs, the nodes are tasks of them, listening beyond
    loopback; the stage's tasks reach them by the cluster's URL, and a node joins mid-query."""
    from tests.spark.test_cluster_on_spark import _leftovers

    run = subprocess.run(
        [sys.executable, "-c", ON_SPARK, str(tmp_path)],
        capture_output=True,
        check=False,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"nodes": ["node-0", "node-1", "node-2"], "exact": True}
    deadline = time.monotonic() + 30
    while _leftovers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _leftovers(tmp_path)


@pytest.mark.parametrize(
    "nodes", [pytest.param(1, marks=pytest.mark.long), 2, pytest.param(3, marks=pytest.mark.long)]
)
def test_event_time_windows_on_a_cluster_keep_the_micro_batch_rule(spark, tmp_path, nodes):
    """Three files a micro-batch, each a later stretch of event time, their tasks' rows spread
    over the nodes: every node's watermark moves only between micro-batches (each task tells every
    node its rows' largest timestamp), so no record is late; the stage returns windows its
    micro-batches closed, and the rest fire when the input ends, each window once."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(0)).with_timestamp_assigner(
        "ts"
    )
    clicks = Types.ROW_NAMED(["user", "ts"], [Types.LONG(), Types.LONG()])
    late = OutputTag("late", clicks)
    windows = (
        env.from_source(ChannelSource("in", clicks), strategy, "in")
        .key_by("user")
        .window(TumblingEventTimeWindows.of(Time.milliseconds(100)))
        .side_output_late_data(late)
        .aggregate([aggregates.count()])
        .name("windows")
    )
    windows.sink_to(ChannelSink("out"))
    windows.get_side_output(late).sink_to(ChannelSink("late"))
    (tmp_path / "in").mkdir()
    want: dict = {}
    for f in range(9):  # file f: event times [250 f, 250 (f + 1)), in order within the file
        ts = list(range(250 * f, 250 * (f + 1)))
        users = [t * 7 % 5 for t in ts]
        for u, t in zip(users, ts):
            want[(u, t - t % 100)] = want.get((u, t - t % 100), 0) + 1
        path = tmp_path / "in" / f"part-{f:03d}.parquet"
        pq.write_table(pa.table({"user": users, "ts": ts}), path)
        os.utime(path, (1_700_000_000 + f, 1_700_000_000 + f))
    with StretchCluster.local(nodes=nodes, directory=tmp_path / "cluster") as cluster:
        client = env.execute_async("stage windows", cluster=cluster)
        source = spark.readStream.schema("user long, ts long").option("maxFilesPerTrigger", 3)
        results = stage(source.parquet(str(tmp_path / "in")), client, into="in", out="out")
        query = (
            results.writeStream.format("parquet")
            .option("path", str(tmp_path / "results"))
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(300)
        assert query.exception() is None
        client.end("in")  # the windows still open fire at the end of input
        client.wait()
        every = [(r["key"], r["window_start"], r["count"]) for r in client.open_reader("out")]
        assert list(client.open_reader("late")) == []
    staged = [
        (r["key"], r["window_start"], r["count"]) for r in pq.read_table(tmp_path / "results").to_pylist()
    ]
    assert sorted(every) == sorted((u, s, c) for (u, s), c in want.items())  # each window once
    assert staged and set(staged) <= set(every) and len(staged) == len(set(staged))
    assert len(staged) < len(want)  # the last micro-batch's windows close only at the end of input
