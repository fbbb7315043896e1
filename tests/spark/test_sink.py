"""Spark writes into a running job with format("stretch"), on local Spark: exactly once per
micro-batch, checked against plain PySpark batch code on the same rows."""

from __future__ import annotations

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

from stretch import channels
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.spark import StretchDataSource
from tests.spark.processes import kill_when

RECORD = Types.TUPLE([Types.LONG(), Types.LONG()])  # user, amount


def files(directory, parts: int, rows: int, seed: int = 0):
    """``parts`` parquet files of (user, amount) rows; returns every row."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for p in range(parts):
        users = [(seed * 7919 + p * rows + i) * 31 % 13 for i in range(rows)]
        amounts = [(p * rows + i) % 101 for i in range(rows)]
        pq.write_table(
            pa.table({"user": pa.array(users, pa.int64()), "amount": pa.array(amounts, pa.int64())}),
            directory / f"part-{seed}-{p:03d}.parquet",
        )
        out += list(zip(users, amounts))
    return out


class Job:
    """Running totals per user; the results read back from the output channel by a thread."""

    def __init__(self, name: str, checkpoint_ms: int | None = None):
        env = StreamExecutionEnvironment.get_execution_environment()
        env.set_parallelism(2)
        if checkpoint_ms:
            env.enable_checkpointing(checkpoint_ms)
        env.from_source(ChannelSource("in", RECORD), None, "in").key_by(lambda r: r[0]).sum(1).sink_to(
            ChannelSink("out")
        )
        self.name = name
        self.client = env.execute_async(name)
        self.out: list = []
        reader = channels.open_reader(self.client, "out")
        self.reader = threading.Thread(target=lambda: self.out.extend(reader), daemon=True)
        self.reader.start()

    def finish(self) -> dict:
        channels.open_writer(self.client, "in").end()
        self.reader.join(60)
        assert self.client.wait().name == "FINISHED"
        totals = {}
        for user, total in self.out:
            totals[user] = total  # running totals: the last one is the user's total
        return totals


def stream_into(spark, job: str, source, checkpoint, channel="in", schema="user BIGINT, amount BIGINT"):
    stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(str(source))
    writer = stream.writeStream.format("stretch").option("job", job).option("channel", channel)
    query = writer.option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start()
    query.awaitTermination()
    return query


def reference(spark, source) -> dict:
    """The same totals by plain PySpark batch code."""
    rows = spark.read.parquet(str(source)).groupBy("user").sum("amount").collect()
    return {r[0]: r[1] for r in rows}


def test_round_trip_in_several_micro_batches(spark, tmp_path):
    rows = files(tmp_path / "in", parts=4, rows=500)
    job = Job("spark round trip")
    query = stream_into(spark, job.name, tmp_path / "in", tmp_path / "ckpt")
    assert len(query.recentProgress) >= 4  # one file per micro-batch
    assert job.finish() == reference(spark, tmp_path / "in")
    assert len(job.out) == len(rows)  # one result per row: nothing twice, nothing lost


def test_a_checkpointed_job_that_loses_a_worker_mid_stream_keeps_spark_exactly_once(spark, tmp_path):
    """Spark -> a checkpointed job -> Spark: a worker killed with SIGKILL while micro-batches
    arrive; the job recovers, and both the channel reader and Spark's read of the output see
    every running total once."""
    rows = files(tmp_path / "in", parts=6, rows=400, seed=3)
    job = Job("spark exactly once", checkpoint_ms=50)
    co = job.client._coordinator

    def kill_once():
        while co.describe()["operators"][0]["records_in"] < 400 and not co.done:
            time.sleep(0.01)
        busy = [w for w in co.workers.all() if w.task is not None and w.pid]
        os.kill(busy[-1].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once, daemon=True)
    killer.start()
    stream_into(spark, job.name, tmp_path / "in", tmp_path / "ckpt")
    killer.join(60)
    assert job.finish() == reference(spark, tmp_path / "in")
    assert len(co.recoveries) == 1
    assert len(job.out) == len(rows)  # one result per row: nothing twice, nothing lost
    back = spark.read.format("stretch").option("job", job.name).option("channel", "out").load()
    assert sorted(tuple(r) for r in back.collect()) == sorted(job.out)


def test_a_restarted_query_continues_from_its_checkpoint(spark, tmp_path):
    source = tmp_path / "in"
    rows = files(source, parts=2, rows=300, seed=1)
    job = Job("spark restart")
    stream_into(spark, job.name, source, tmp_path / "ckpt")
    rows += files(source, parts=2, rows=300, seed=2)  # more data arrives while the query is down
    stream_into(spark, job.name, source, tmp_path / "ckpt")
    assert job.finish() == reference(spark, source)
    assert len(job.out) == len(rows)


def test_a_replayed_or_retried_batch_is_published_once(spark, tmp_path):
    """Spark replays a batch whose commit it did not record; a failed task's files are never
    committed. Both are driven here through the writer's own calls, as Spark makes them."""
    from pyspark.sql.types import LongType, StructField, StructType

    job = Job("spark replay")
    schema = StructType([StructField("user", LongType()), StructField("amount", LongType())])
    options = {"job": job.name, "channel": "in", "checkpointLocation": str(tmp_path / "ckpt")}
    writer = StretchDataSource(options).streamWriter(schema, False)
    batch = pa.record_batch(
        {"user": pa.array([1, 2, 1], pa.int64()), "amount": pa.array([5, 6, 7], pa.int64())}
    )
    failed_attempt = writer.write(iter([batch]))  # a task attempt that failed: Spark never commits it
    messages = [writer.write(iter([batch]))]
    writer.commit(messages, 0)
    writer.commit([writer.write(iter([batch]))], 0)  # the same batch replayed after a restart
    writer.abort([failed_attempt], 0)
    writer.commit([writer.write(iter([batch.slice(2)]))], 1)
    with pytest.raises(RuntimeError, match="went back from micro-batch 1 to 0"):  # a reset checkpoint
        writer.commit([writer.write(iter([batch]))], 0)
    assert not list(
        job.client._coordinator.channels.publisher.staging.iterdir()
    )  # published, duplicate, aborted
    assert job.finish() == {1: 5 + 7 + 7, 2: 6}
    assert len(job.out) == 4


def test_clear_errors_for_unknown_jobs_channels_and_schemas(spark, tmp_path):
    """Spark builds a Python sink's writer when the query first runs: the errors come from the
    query (``awaitTermination`` raises) before any row is written."""
    files(tmp_path / "in", parts=1, rows=10)
    job = Job("spark errors")
    try:
        with pytest.raises(Exception, match="no running stretch job 'no such job'"):
            stream_into(spark, "no such job", tmp_path / "in", tmp_path / "c1")
        with pytest.raises(Exception, match="has no channel 'nope'"):
            stream_into(spark, job.name, tmp_path / "in", tmp_path / "c2", channel="nope")
        with pytest.raises(Exception, match="does not fit") as e:
            stream_into(
                spark, job.name, tmp_path / "in", tmp_path / "c3", schema="user BIGINT, amount STRING"
            )
        assert "amount string" in str(e.value) and "`f1` BIGINT" in str(e.value)  # both schemas
    finally:
        assert job.finish() == {}


def test_a_failed_task_that_spark_retries_publishes_its_rows_once(spark, tmp_path):
    """The first attempt of each task dies in the middle of its partition (after the writer
    staged part of it); Spark retries it (maxFailures 2) and commits only the retry."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    marks = tmp_path / "failed-once"
    marks.mkdir()

    def fail_first_attempt(user, amount):
        import os

        from pyspark import TaskContext

        ctx = TaskContext.get()
        mark = marks / f"p{ctx.partitionId()}-{ctx.stageId()}"
        if amount == 50 and not mark.exists():
            mark.touch()
            raise RuntimeError(f"task attempt dies (pid {os.getpid()})")
        return amount

    rows = files(tmp_path / "in", parts=3, rows=400, seed=4)
    job = Job("spark task retry")
    stream = (
        spark.readStream.schema("user BIGINT, amount BIGINT")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(tmp_path / "in"))
    )
    stream = stream.select("user", F.udf(fail_first_attempt, LongType())("user", "amount").alias("amount"))
    query = (
        stream.writeStream.format("stretch")
        .option("job", job.name)
        .option("channel", "in")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert len(list(marks.iterdir())) >= 3  # every micro-batch lost a task attempt
    assert job.finish() == reference(spark, tmp_path / "in")
    assert len(job.out) == len(rows)


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_a_killed_writing_query_restarts_from_its_checkpoint_without_loss_or_duplicates(spark, tmp_path):
    source, checkpoint = tmp_path / "in", tmp_path / "ckpt"
    rows = files(source, parts=6, rows=400, seed=5)
    job = Job("spark kill")
    script = textwrap.dedent(f"""
        from pyspark.sql import SparkSession
        from stretch.spark import StretchDataSource
        spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
        spark.dataSource.register(StretchDataSource)
        (spark.readStream.schema("user BIGINT, amount BIGINT").option("maxFilesPerTrigger", 1)
            .parquet({str(source)!r}).writeStream.format("stretch").option("job", {job.name!r})
            .option("channel", "in").option("checkpointLocation", {str(checkpoint)!r})
            .trigger(processingTime="1 second").start().awaitTermination())
    """)
    other = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    kill_when(
        other, lambda: job.client.describe()["operators"][0]["records_in"] >= 400
    )  # a micro-batch is in
    stream_into(spark, job.name, source, checkpoint)  # the same query, restarted
    assert job.finish() == reference(spark, source)
    assert len(job.out) == len(rows)
