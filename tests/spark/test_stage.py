"""A stretch job as a stage inside one Spark query, on local Spark: results checked against plain
Python on the same rows, in append and update mode, with task retries, a schema that does not fit
and a job that dies mid-query."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stretch import channels, jobs
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import StreamExecutionEnvironment, aggregates
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.window import TumblingEventTimeWindows
from stretch.errors import JobEnded
from stretch.spark import stage
from stretch.spark.schemas import spark_arrow_schema
from tests.runtime.test_transactions import checkpointed_sums, start_job_script
from tests.spark.steps import fail_first_attempt

RECORD = Types.TUPLE([Types.LONG(), Types.LONG()])  # user, amount


def _job(name: str, parallelism: int = 2):
    """Running totals per user."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.from_source(ChannelSource("in", RECORD), None, "in").key_by("f0").sum(1).name("totals").sink_to(
        ChannelSink("out")
    )
    return env.execute_async(name)


def _files(directory, parts: int, rows: int) -> list[list[tuple[int, int]]]:
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for p in range(parts):
        records = [((p * rows + i) * 37 % 23, 1 + (p * rows + i) % 50) for i in range(rows)]
        path = directory / f"part-{p:03d}.parquet"
        pq.write_table(pa.table({"user": [r[0] for r in records], "amount": [r[1] for r in records]}), path)
        os.utime(path, (1_700_000_000 + p, 1_700_000_000 + p))  # Spark reads files oldest first
        out.append(records)
    return out


def test_append_mode_gives_one_result_per_row_also_to_a_retried_task(spark):
    client = _job("stage append")
    try:
        rows = [(i % 7, i + 1) for i in range(500)]
        df = spark.createDataFrame(rows, "user long, amount long").repartition(3)
        results = stage(df, client, into="in", out="out")  # a batch query: its tasks named by Spark's stage
        got = [tuple(r) for r in results.mapInArrow(fail_first_attempt, results.schema).collect()]
    finally:
        client.cancel()
    totals: dict = {}
    for k, v in rows:
        totals[k] = totals.get(k, 0) + v
    by_key: dict = {}
    for k, v in got:
        by_key.setdefault(k, []).append(v)
    assert sorted(k for k, _ in got) == sorted(k for k, _ in rows)  # one result per row
    for k, values in by_key.items():  # running sums of the key's rows, in some order, ending at the total
        assert len(set(values)) == len(values) and max(values) == totals[k]


@pytest.mark.parametrize("retried", [False, True])
def test_update_mode_gives_each_keys_latest_total_per_micro_batch_exactly_once(spark, tmp_path, retried):
    name = f"stage update {retried}"
    client = _job(name)
    parts = _files(tmp_path / "in", parts=4, rows=300)
    got: dict[int, list] = {}

    def collect(df, batch_id):
        got[batch_id] = sorted(tuple(r) for r in df.collect())

    try:
        clicks = spark.readStream.schema("user long, amount long").option("maxFilesPerTrigger", 1)
        results = stage(
            clicks.parquet(str(tmp_path / "in")),
            name,
            into="in",
            out="out",
            mode="update",
            key="user",
            result_key="f0",
        )
        if retried:  # a step after the stage fails each task's first attempt: Spark retries the task

            def fail_first_attempt(batches):
                from pyspark import TaskContext

                batches = list(batches)
                if TaskContext.get().attemptNumber() == 0 and batches:
                    raise RuntimeError("injected task failure")
                yield from batches

            results = results.mapInArrow(fail_first_attempt, results.schema)
        query = (
            results.writeStream.outputMode("update")
            .foreachBatch(collect)
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(300)
        assert query.exception() is None
    finally:
        client.cancel()
    totals: dict = {}
    want = []
    for records in parts:  # a file per micro-batch, oldest first
        for k, v in records:
            totals[k] = totals.get(k, 0) + v
        want.append(sorted((k, totals[k]) for k in {k for k, _ in records}))
    assert [got[b] for b in sorted(got)] == want


def test_event_time_windows_lose_nothing_when_a_micro_batch_holds_files_of_different_times(spark, tmp_path):
    """Three files a micro-batch, each a later stretch of event time: the micro-batch's tasks
    publish in any order, and the watermark moves only between micro-batches, so no record is late."""
    name = "stage windows"
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(0)).with_timestamp_assigner(
        "ts"
    )
    (
        env.from_source(
            ChannelSource("in", Types.ROW_NAMED(["user", "ts"], [Types.LONG(), Types.LONG()])), strategy, "in"
        )
        .key_by("user")
        .window(TumblingEventTimeWindows.of(Time.milliseconds(100)))
        .aggregate([aggregates.count()])
        .name("windows")
        .sink_to(ChannelSink("out"))
    )
    client = env.execute_async(name)
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
    try:
        clicks = spark.readStream.schema("user long, ts long").option("maxFilesPerTrigger", 3)
        results = stage(clicks.parquet(str(tmp_path / "in")), name, into="in", out="out")
        query = (
            results.writeStream.format("parquet")
            .option("path", str(tmp_path / "results"))
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(300)
        assert query.exception() is None
        channels.open_writer(client, "in").end()  # the windows still open fire at the end of input
        assert client.wait().name == "FINISHED"
        every = {
            (r["key"], r["window_start"]): r["count"]
            for r in channels.open_reader(name, "out", from_offset=0)
        }
    finally:
        client.cancel()
    staged = {
        (r["key"], r["window_start"]): r["count"] for r in pq.read_table(tmp_path / "results").to_pylist()
    }
    assert every == want
    assert staged and staged.items() <= want.items()  # what the stage returned: windows its rows closed
    assert len(staged) < len(want)  # the last micro-batch's windows close only at the end of input


def test_a_dataframe_that_does_not_fit_the_channel_fails_before_anything_is_written(spark):
    client = _job("stage misfit")
    try:
        df = spark.createDataFrame([("a", 1)], "user string, amount long")
        with pytest.raises(
            ValueError, match=r"(?s)does not fit channel 'in'.*Spark:.*user string.*channel:.*BIGINT"
        ):
            stage(df, client, into="in", out="out")
        assert client.describe()["operators"][0]["records_in"] == 0
    finally:
        client.cancel()


def test_a_job_cancelled_mid_query_fails_the_query_saying_how_it_ended(spark, tmp_path):
    name = "stage dies"
    client = _job(name)
    _files(tmp_path / "in", parts=3, rows=100)
    clicks = spark.readStream.schema("user long, amount long").option("maxFilesPerTrigger", 1)
    results = stage(clicks.parquet(str(tmp_path / "in")), name, into="in", out="out")
    client.cancel()
    query = results.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "ckpt")).start()
    with pytest.raises(
        Exception,
        match=f"stretch job '{name}' .* of this stage is not running any more: job '{name}' was cancelled; "
        "start it again",
    ):
        query.awaitTermination(120)


@pytest.mark.parametrize(
    ("ending", "given"), [("cancelled", "client"), ("cancelled", "id"), ("finished", "name")]
)
def test_a_stage_of_a_job_that_ended_is_refused_at_once_saying_how(spark, ending, given):
    name = f"stage of a job {ending}"
    client = _job(name)
    channels.open_writer(client, "in").write([(1, 2), (1, 3)])
    if ending == "cancelled":
        client.cancel()
    else:
        channels.open_writer(client, "in").end()
        assert client.wait(60).name == "FINISHED"
    job = {"client": client, "id": client.get_job_id(), "name": name}[given]
    df = spark.createDataFrame([(1, 5)], "user long, amount long")
    how = "was cancelled" if ending == "cancelled" else "has finished"
    again = (
        r"restore=True continues a checkpointed job" if ending == "cancelled" else r"\(execute_async\) and"
    )
    with pytest.raises(JobEnded, match=f"job '{name}' {how}: it cannot be staged; start it again .*{again}"):
        stage(df, job, into="in", out="out")


def test_stage_options_that_cannot_be_done_are_refused_saying_what_to_do(spark):
    client = _job("stage options")
    try:
        rows = [(1, 2), (2, 5), (1, 4)]
        df = spark.createDataFrame(rows, "user long, amount long")
        update = {"into": "in", "out": "out", "mode": "update", "result_key": "f0"}
        with pytest.raises(
            ValueError,
            match=r"key= names \['usr'\], which the DataFrame has no column of: its columns are \['user', 'amount'\]",
        ):
            stage(df, client, key="usr", **update)
        for n in (0, -2, 1.5):
            with pytest.raises(ValueError, match=f"partitions= .*: a positive int, got {n}"):
                stage(df, client, key="user", partitions=n, **update)
        with pytest.raises(
            ValueError, match=r"key= is for update mode .*: give mode='update', or leave key= out$"
        ):
            stage(df, client, into="in", out="out", key="user")
        with pytest.raises(ValueError, match=r"key=, partitions= are for update mode .*df.repartition\(n\)"):
            stage(df, client, into="in", out="out", mode="append", key="user", partitions=4)
        assert client.describe()["operators"][0]["records_in"] == 0  # nothing refused reached the job
        got = sorted(tuple(r) for r in stage(df, client, key="user", partitions=1, **update).collect())
    finally:
        client.cancel()
    totals: dict = {}
    for user, amount in rows:
        totals[user] = totals.get(user, 0) + amount
    assert got == sorted(totals.items())  # one micro-batch: each key's latest total


class _Context:
    """A streaming query's task context, as the stage's task reads it."""

    def __init__(self, batch: int):
        self.batch = batch

    def getLocalProperty(self, key):
        return {"sql.streaming.queryId": "q", "streaming.sql.batchId": str(self.batch)}.get(key)

    def partitionId(self):
        return 0


def test_a_task_stages_sparks_small_batches_as_few_and_gives_each_keys_latest_total(monkeypatch):
    import importlib

    module = importlib.import_module("stretch.spark.stage")
    client = _job("stage staged batches")
    try:
        target = module.EngineStage(jobs.find("stage staged batches"), "in", "out")
        schema = pa.schema([("user", pa.int64()), ("amount", pa.int64())])  # as Spark hands them
        out = spark_arrow_schema(target.output_schema())
        task = target.task(target.input_schema(), out, ["f0"])
        staged: list[list[int]] = []
        stage_rows = module.StageTask._stage

        def spy(self, batches):
            path = stage_rows(self, batches)
            with pa.memory_map(path) as f:
                staged.append([b.num_rows for b in pa.ipc.open_stream(f)])
            return path

        monkeypatch.setattr(module.StageTask, "_stage", spy)
        rng = np.random.default_rng(11)
        totals: dict[int, int] = {}
        for batch_id in range(3):
            n = module.STAGED_ROWS * 2 + 1234  # Spark's 10 000-row batches, staged as two
            table = pa.table(
                {"user": rng.integers(0, 5000, n), "amount": rng.integers(1, 9, n)}, schema=schema
            )
            latest = {}
            for user, amount in zip(table.column("user").to_pylist(), table.column("amount").to_pylist()):
                totals[user] = latest[user] = totals.get(user, 0) + amount
            monkeypatch.setattr(module.TaskContext, "get", lambda b=batch_id: _Context(b))
            got = pa.Table.from_batches(list(task(iter(table.to_batches(max_chunksize=10_000)))), schema=out)
            assert dict(zip(got.column(0).to_pylist(), got.column(1).to_pylist())) == latest
            assert got.num_rows == len(latest)  # one row per key
            assert staged[-1] == [70_000, n - 70_000]  # 7 of Spark's batches, then the other 7
    finally:
        client.cancel()


@pytest.mark.parametrize("key_type", [pa.int64(), pa.int8(), pa.string(), pa.float64(), pa.timestamp("ms")])
def test_latest_per_key_keeps_each_keys_last_result_in_emission_order(key_type):
    from stretch.spark.stage_results import latest_per_key as _latest_per_key

    rng = np.random.default_rng(3)
    for n in (1, 2, 50, 1000):
        raw = rng.integers(0, 20, n)
        keys = pa.array([str(k) for k in raw]) if key_type == pa.string() else pa.array(raw).cast(key_type)
        table = pa.table({"k": keys, "position": np.arange(n)})
        last = {k: i for i, k in enumerate(keys.to_pylist())}
        assert _latest_per_key(table, ["k"]).column("position").to_pylist() == sorted(last.values())


@pytest.mark.parametrize(
    "columns",
    [
        {"k": pa.int64(), "nulls": True},  # null is a key of its own
        {"k": pa.bool_()},
        {"k": pa.int64(), "j": pa.string()},
    ],
    ids=["nullable", "bool", "two keys"],
)
def test_latest_per_key_against_a_plain_python_model(columns):
    from stretch.spark.stage_results import latest_per_key as _latest_per_key

    nulls = columns.pop("nulls", False)
    rng = np.random.default_rng(5)
    for n in (1, 3, 200, 5000):
        data = {}
        for name, t in columns.items():
            raw = [int(v) for v in rng.integers(0, 7, n)]
            values = [v % 2 == 0 if t == pa.bool_() else str(v) if t == pa.string() else v for v in raw]
            if nulls:
                values = [None if v == 3 else v for v in values]
            data[name] = pa.array(values, t)
        table = pa.table({**data, "position": np.arange(n)})
        rows = zip(*(table.column(c).to_pylist() for c in columns))
        last = {tuple(map(repr, key)): i for i, key in enumerate(rows)}
        kept = _latest_per_key(table, list(columns)).column("position").to_pylist()
        assert kept == sorted(last.values())


STAGE_JOB_SCRIPT = """
import sys, time
from tests.runtime.test_transactions import checkpointed_sums, start_job_script
from tests.spark.steps import fail_first_attempt

checkpointed_sums(sys.argv[1], restore=False)
print("ready", flush=True)
time.sleep(300)
"""


def test_a_job_killed_mid_query_and_restored_loses_and_duplicates_nothing(spark, tmp_path):
    """The job's process is killed while the query runs: the query fails with a clear error; the
    job is restored and the query restarted from its checkpoint; every row counts exactly once."""
    name = f"stage restore {uuid.uuid4().hex[:8]}"
    proc = start_job_script(tmp_path, STAGE_JOB_SCRIPT, name)
    parts = _files(tmp_path / "in", parts=6, rows=300)
    got: dict[int, list] = {}  # an idempotent sink: a replayed micro-batch replaces its rows

    def collect(df, batch_id):
        got[batch_id] = [tuple(r) for r in df.collect()]

    def start():
        clicks = spark.readStream.schema("user long, amount long").option("maxFilesPerTrigger", 1)
        results = stage(clicks.parquet(str(tmp_path / "in")), name, into="in", out="out")
        return (
            results.writeStream.foreachBatch(collect)
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )

    try:
        assert proc.stdout.readline().strip() == "ready"
        query = start()
        job = jobs.find(name)
        deadline = time.monotonic() + 120
        while job.status()["operators"][0]["records_in"] < 3 * 300:  # a third micro-batch is in
            assert time.monotonic() < deadline and query.isActive
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.wait(30)
    with pytest.raises(Exception, match=f"stretch job '{name}' .* is not running any more"):
        query.awaitTermination(120)
    client = checkpointed_sums(name, restore=True)
    try:
        query = start()
        query.awaitTermination(300)
        assert query.exception() is None
    finally:
        client.cancel()
    records = [r for p in parts for r in p]
    totals: dict = {}
    for k, v in records:
        totals[k] = totals.get(k, 0) + v
    results = [r for rows in got.values() for r in rows]
    assert sorted(k for k, _ in results) == sorted(k for k, _ in records)  # one result per row
    by_key: dict = {}
    for k, v in results:
        by_key.setdefault(k, []).append(v)
    for k, sums in by_key.items():  # running sums: distinct, ending at the key's total
        assert len(set(sums)) == len(sums) and max(sums) == totals[k]
