"""Spark reads a job's output channel with format("stretch"), on local Spark: streaming by
offsets (continuing from its checkpoint) and in batch, checked against plain PySpark."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from stretch import channels
from stretch.common import Row, Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.runtime.channel_log import ChannelLog
from stretch.runtime.state_dir import channel_dir
from tests.spark.processes import kill_when

TOTALS = Types.ROW_NAMED(["user", "total"], [Types.LONG(), Types.LONG()])


def start(name: str):
    """Running totals per user, as named rows, into the output channel "totals"."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    (
        env.from_source(ChannelSource("in", Types.TUPLE([Types.LONG(), Types.LONG()])), None, "in")
        .key_by(lambda r: r[0])
        .reduce(lambda a, b: (a[0], a[1] + b[1]))
        .map(lambda r: Row(user=r[0], total=r[1]), TOTALS)
        .sink_to(ChannelSink("totals"))
    )
    client = env.execute_async(name)
    return client, channels.open_writer(client, "in")


def rows(part: int, n: int = 400):
    return [((part * n + i) * 17 % 11, (part * n + i) % 97) for i in range(n)]


def running_totals(records):
    acc, out = {}, []
    for user, amount in records:
        acc[user] = acc.get(user, 0) + amount
        out.append((user, acc[user]))
    return out


def read_stream(spark, job: str, checkpoint, target):
    query = (
        spark.readStream.format("stretch")
        .option("job", job)
        .option("channel", "totals")
        .option("query", "totals to parquet")
        .load()
        .writeStream.format("parquet")
        .option("path", str(target))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return query


def wait_for_output(client, n: int) -> None:
    reader = channels.open_reader(client, "totals")
    for _ in range(n):
        reader.read_batch(timeout=60)
    reader.close()


def test_streaming_read_continues_from_its_checkpoint(spark, tmp_path):
    client, writer = start("spark source streaming")
    sent = rows(0)
    writer.write(sent)
    wait_for_output(client, 1)  # some results are out; more may follow
    read_stream(spark, "spark source streaming", tmp_path / "ckpt", tmp_path / "out")
    log = ChannelLog(channel_dir("spark source streaming", "totals"), create=False)
    first_read = log.end_offset  # at least (more results may have come meanwhile)
    sent += rows(1)
    writer.write(rows(1))
    writer.end()
    assert client.wait().name == "FINISHED"
    read_stream(spark, "spark source streaming", tmp_path / "ckpt", tmp_path / "out")  # the rest
    got = [(r["user"], r["total"]) for r in spark.read.parquet(str(tmp_path / "out")).collect()]
    assert sorted(got) == sorted(running_totals(sent))  # every result once
    # the named query's commits reached the log (Spark commits a batch when the next one runs)
    assert first_read <= log.commits()["totals to parquet"] <= log.end_offset


def test_batch_read_of_a_channel_while_and_after_the_job_runs(spark, tmp_path):
    client, writer = start("spark source batch")
    sent = rows(0) + rows(1)
    writer.write(sent)
    writer.end()
    assert client.wait().name == "FINISHED"
    df = spark.read.format("stretch").option("job", "spark source batch").option("channel", "totals").load()
    assert df.schema.simpleString() == "struct<user:bigint,total:bigint>"
    got = [(r["user"], r["total"]) for r in df.collect()]
    assert sorted(got) == sorted(running_totals(sent))
    # the same totals as plain PySpark computes from the rows sent
    ref = spark.createDataFrame(sent, "user BIGINT, amount BIGINT").groupBy("user").sum("amount").collect()
    final = df.groupBy("user").max("total").collect()
    assert sorted(map(tuple, final)) == sorted(map(tuple, ref))


def read_batch(spark, job: str, **options) -> list[tuple[int, int]]:
    """A batch read of the job's "totals" with these options: its (user, total) rows, sorted."""
    reader = spark.read.format("stretch").option("job", job).option("channel", "totals")
    for key, value in options.items():
        reader = reader.option(key, value)
    return sorted((r["user"], r["total"]) for r in reader.load().collect())


def test_a_read_by_job_name_after_two_runs_gives_the_last_runs_results_unless_asked_earliest(spark, tmp_path):
    """A script run twice under one name: Spark's reads by name after the runs, batch and
    streaming, give the second run's results, not the first run's again."""
    name = "spark source two runs"
    runs = []
    for run in range(2):
        client, writer = start(name)
        sent = rows(run, 200)
        for i in range(0, len(sent), 50):
            writer.write(sent[i : i + 50])
        writer.end()
        assert client.wait().name == "FINISHED"
        runs.append(sent)
    last, both = sorted(running_totals(runs[1])), sorted(running_totals(runs[0]) + running_totals(runs[1]))
    assert read_batch(spark, name) == last  # each run's job starts from empty state
    assert read_batch(spark, name, startingOffsets="run") == last
    assert read_batch(spark, name, startingOffsets="earliest") == both
    read_stream(spark, name, tmp_path / "ckpt", tmp_path / "out")  # streaming: from the run's first too
    got = [(r["user"], r["total"]) for r in spark.read.parquet(str(tmp_path / "out")).collect()]
    assert sorted(got) == last


def test_batch_offsets_past_the_end_read_nothing_and_impossible_ones_are_refused(spark):
    name = "spark source offsets"
    client, writer = start(name)
    sent = rows(0, 200)
    for i in range(0, len(sent), 20):
        writer.write(sent[i : i + 20])
    writer.end()
    assert client.wait().name == "FINISHED"
    log = ChannelLog(channel_dir(name, "totals"), create=False)
    end = log.end_offset
    assert end >= 3

    def logged(a: int, b: int) -> list[tuple[int, int]]:  # the log's batches a .. b, read directly
        return sorted((r["user"], r["total"]) for batch in log.read(a, b) for r in batch.to_pylist())

    assert logged(0, end) == sorted(running_totals(sent))
    for a, b in [(1, 3), (0, end), (2, end + 100), (end, end), (1, 1), (end + 5, end + 9)]:
        want = logged(min(a, end), min(b, end))  # offsets past the end: nothing there (yet)
        assert read_batch(spark, name, startingOffsets=str(a), endingOffsets=str(b)) == want, (a, b)
    assert read_batch(spark, name, startingOffsets=str(end + 3)) == []  # to "latest"
    assert read_batch(spark, name, startingOffsets="latest") == []
    holds = f"its log holds offsets 0 to {end - 1}"
    with pytest.raises(Exception, match=f"endingOffsets 2 is before startingOffsets 5 .*: {holds}"):
        read_batch(spark, name, startingOffsets="5", endingOffsets="2")
    with pytest.raises(
        Exception, match=f"endingOffsets {end} is before startingOffsets {end + 7} .*: {holds}"
    ):
        read_batch(spark, name, startingOffsets=str(end + 7), endingOffsets=str(end))
    with pytest.raises(
        Exception, match=f"startingOffsets -1 is before the oldest batch .* still holds: {holds}"
    ):
        read_batch(spark, name, startingOffsets="-1")
    with pytest.raises(
        Exception, match="endingOffsets must be run, earliest, latest or an offset, got 'soon'"
    ):
        read_batch(spark, name, endingOffsets="soon")


def test_a_batch_write_is_refused_saying_what_to_use_instead(spark):
    df = spark.createDataFrame([(1, 2)], "user BIGINT, amount BIGINT")
    for mode in ("append", "overwrite"):
        with pytest.raises(
            Exception, match=r"takes no batch write \(df.write\).*writeStream.*stretch.spark.stage"
        ):
            df.write.format("stretch").option("job", "clicks").option("channel", "in").mode(mode).save()


def test_unknown_job_or_channel_fails_at_load(spark):
    with pytest.raises(Exception, match="no channel 'nope' kept"):
        spark.read.format("stretch").option("job", "never ran").option("channel", "nope").load()


def test_batch_read_of_an_operators_keyed_state_while_it_runs(spark):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    (
        env.from_source(ChannelSource("in", Types.TUPLE([Types.LONG(), Types.LONG()])), None, "in")
        .key_by(lambda r: r[0])
        .sum(1)
        .name("totals")
        .sink_to(ChannelSink("out"))
    )
    client = env.execute_async("spark state read")
    writer = channels.open_writer(client, "in")
    sent = rows(0) + rows(1)
    writer.write(sent)
    results = iter(channels.open_reader(client, "out"))
    for _ in range(len(sent)):  # every record is in the state once its result is out
        next(results)
    df = spark.read.format("stretch").option("job", "spark state read").option("state", "totals").load()
    got = {r["key"]: r["sum(f1)"] for r in df.collect()}
    want: dict = {}
    for user, amount in sent:
        want[user] = want.get(user, 0) + amount
    assert got == want
    assert client.get_job_status().result().name == "RUNNING"  # read without stopping the job
    with pytest.raises(Exception, match="no keyed operator 'nope'"):
        spark.read.format("stretch").option("job", "spark state read").option("state", "nope").load()
    writer.end()
    assert client.wait().name == "FINISHED"


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_a_killed_reading_query_restarts_from_its_checkpoint_without_loss_or_duplicates(spark, tmp_path):
    client, writer = start("spark source kill")
    sent = rows(0, 1000)
    for i in range(0, len(sent), 100):
        writer.write(sent[i : i + 100])
    out, checkpoint = tmp_path / "out", tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        from pyspark.sql import SparkSession
        from stretch.spark import StretchDataSource
        spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
        spark.dataSource.register(StretchDataSource)
        (spark.readStream.format("stretch").option("job", "spark source kill").option("channel", "totals")
            .option("startingOffsets", "earliest").load()
            .writeStream.format("parquet").option("path", {str(out)!r})
            .option("checkpointLocation", {str(checkpoint)!r})
            .trigger(processingTime="200 milliseconds").start().awaitTermination())
    """)
    other = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    kill_when(other, (checkpoint / "commits" / "0").exists)  # once it has written some results
    more = rows(1, 1000)
    for i in range(0, len(more), 100):  # results it never saw
        writer.write(more[i : i + 100])
    sent += more
    writer.end()
    assert client.wait().name == "FINISHED"
    query = (
        spark.readStream.format("stretch")
        .option("job", "spark source kill")
        .option("channel", "totals")
        .load()
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    got = [(r["user"], r["total"]) for r in spark.read.parquet(str(out)).collect()]
    assert sorted(got) == sorted(running_totals(sent))
