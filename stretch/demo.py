"""The demo pipeline (``stretch demo``): one Spark query with a stretch job as its stateful stage.

Spark reads click files (written by the demo itself), a few per micro-batch; the stage
(``stretch.spark.stage``) hands each task's rows to the job, which computes per-user event-time
windows (count and sum of the amount, vectorized) and is rescaled live in the middle of the run;
the windows the rows closed come back into the same query, which writes them as Parquet. When the
input ends the job closes the windows still open, which Spark reads from the job's output channel.
The demo prints a summary, checks the results against a plain-Python computation of the same
windows, and saves a plot of throughput, parallelism, backlog and latency over time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stretch import channels
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import StreamExecutionEnvironment, aggregates
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.window import TumblingEventTimeWindows

USERS = 10_000
WINDOW_MS = 60_000
LATE_MS = 2_000  # events arrive up to this much out of order
CLICK = Types.ROW_NAMED(["user", "ts", "amount"], [Types.LONG(), Types.LONG(), Types.DOUBLE()])
JOB = "stretch demo"


def click_files(directory: Path, events: int, files: int) -> None:
    """Clicks in event-time order (1 000 per second of event time), a little out of order."""
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-events // files)
    for f in range(files):
        idx = np.arange(f * per_file, min(events, (f + 1) * per_file), dtype=np.int64)
        jitter = (idx * 7919) % LATE_MS
        table = pa.table(
            {
                "user": (idx * 2654435761) % USERS,
                "ts": idx - jitter,
                "amount": ((idx * 40503) % 1000) / 100.0,
            }
        )
        pq.write_table(table, directory / f"clicks-{f:04d}.parquet")


def expected_windows(directory: Path) -> dict:
    """(user, window start) -> (count, sum): the same windows in plain Python (nothing is late)."""
    table = pq.read_table(directory)
    out: dict = {}
    for user, ts, amount in zip(*(table.column(c).to_pylist() for c in ("user", "ts", "amount"))):
        key = (user, ts - ts % WINDOW_MS)
        n, s = out.get(key, (0, 0.0))
        out[key] = (n + 1, s + amount)
    return out


def result_windows(rows) -> dict:
    """(user, window start) -> (count, sum) of the job's result rows; None for a window that came
    twice, so that a duplicate fails the comparison instead of hiding behind its last copy."""
    out: dict = {}
    for r in rows:
        key = (r["key"], r["window_start"])
        out[key] = (r["count"], r["sum_amount"]) if key not in out else None
    return out


def matches(got: dict, want: dict) -> bool:
    """Every reference window once, with its count and, to rounding, its sum: one check for both
    demos, so that a cluster is held to the same standard as one machine."""
    return got.keys() == want.keys() and all(
        got[k] is not None
        and got[k][0] == want[k][0]
        and abs(got[k][1] - want[k][1]) < 1e-6 * max(1.0, abs(want[k][1]))
        for k in want
    )


def summarize(out, events, got, seconds, correct, status, where, note="", **details) -> dict:
    """Print the closing line and return the summary (``stretch demo``'s exit code reads it): one
    for both demos, so that their runs read and compare alike; ``details`` are a demo's own."""
    out(
        f"done: {events:,} clicks -> {len(got):,} per-user windows in {seconds:.1f}s "
        f"({events / seconds:,.0f} clicks/s end to end){where}; results "
        f"{'match' if correct else 'DO NOT match'} a plain-Python computation of the same windows{note}"
    )
    return {
        "events": events,
        "windows": len(got),
        "seconds": round(seconds, 2),
        "events_per_second": round(events / seconds),
        **details,
        "results_match_reference": correct,
        "status": status,
    }


def spark_session(log: Path | None = None):
    """Local Spark; its JVM's own output (and its Python workers') goes to ``log`` if given."""
    from pyspark.sql import SparkSession

    from stretch.spark import StretchDataSource

    builder = (
        SparkSession.builder.master("local[2]")
        .appName("stretch demo")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        # on a busy machine the Python side's socket to the JVM would time out after 15 s
        .config("spark.python.authenticate.socketTimeout", "120s")
    )
    if log is None:
        spark = builder.getOrCreate()
    else:  # the JVM starts now and keeps the standard error it is given: the log file
        sys.stderr.flush()
        saved = os.dup(2)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.dup2(fd, 2)
            spark = builder.getOrCreate()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(fd)
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(StretchDataSource)
    return spark


def define_job(parallelism: int) -> StreamExecutionEnvironment:
    """Per-user event-time windows (count and sum of the amount) over the clicks channel."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    watermarks = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(LATE_MS))
    clicks = env.from_source(
        ChannelSource("clicks", CLICK), watermarks.with_timestamp_assigner("ts"), "clicks"
    )
    (
        clicks.key_by("user")
        .window(TumblingEventTimeWindows.of(Time.milliseconds(WINDOW_MS)))
        .aggregate([aggregates.count(), aggregates.sum("amount")])
        .name("per-user windows")
        .sink_to(ChannelSink("per_user"))
    )
    return env


def run(
    events: int = 2_000_000,
    files: int = 20,
    parallelism: int = 1,
    schedule: tuple[int, ...] = (2, 1),
    work_dir: str | None = None,
    plot: bool = True,
    verbose: bool = False,
    files_per_trigger: int = 4,
    out=print,
) -> dict:
    """Run the pipeline; returns a summary (also printed). Spark's log goes to ``spark.log`` in
    the work directory unless ``verbose``."""
    start = lambda: define_job(parallelism).execute_async(JOB)  # noqa: E731
    with prepared(events, files, work_dir, verbose, out, start) as (spark, work, client):
        return _pipeline(spark, client, work, events, schedule, files_per_trigger, plot, out)


@contextlib.contextmanager
def prepared(events: int, files: int, work_dir: str | None, verbose: bool, out, start_job=None):
    """The clicks in a work directory and local Spark with its Python workers warm; yields
    (spark, work directory, the job ``start_job`` started meanwhile, if given). Everything ends
    with the block: the job is cancelled if it has not finished, Spark stops."""
    with tempfile.TemporaryDirectory(prefix="stretch-demo-") as tmp:
        work = Path(work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        click_files(work / "clicks", events, files)
        out(f"stretch demo: {events:,} clicks of {USERS:,} users in {files} Parquet files under {work}")
        log = None if verbose else work / "spark.log"
        out(
            "  starting local Spark and the stretch job"
            + ("" if log is None else f" (Spark's log: {log})")
            + " ..."
        )
        t0 = time.monotonic()
        job: list = []
        starting = (
            threading.Thread(target=lambda: job.append(start_job()), daemon=True) if start_job else None
        )
        if starting is not None:
            starting.start()  # the job starts while Spark does
        spark = spark_session(log)
        t1 = time.monotonic()
        try:
            _warm_python_workers(spark)
            if starting is not None:
                starting.join()
                if not job:
                    raise RuntimeError("the stretch job did not start (see the error above)")
            out(
                f"  Spark started in {t1 - t0:.1f}s, its Python workers and the job {time.monotonic() - t1:.1f}s later"
            )
            yield spark, work, (job[0] if job else None)
        finally:
            if job:
                job[0].cancel()  # ends it if the pipeline failed; a finished job stays finished
            spark.stop()


def _pipeline(spark, client, work: Path, events, schedule, files_per_trigger, plot, out) -> dict:
    started = time.monotonic()
    parallelism = client.describe()["operators"][0]["parallelism"]
    query = stage_query(spark, client, work, files_per_trigger)
    out(
        f"  one Spark query: clicks -> stretch job {JOB!r} (parallelism {parallelism}) -> Parquet, rescaling live to {schedule}"
    )
    samples = _monitor(client, query, events, schedule, started, out)
    failure = query.exception()
    if failure is not None:
        raise RuntimeError(f"Spark's query failed: {failure}")
    input_ended = time.monotonic()
    closed_by_stream = channels.open_reader(client, "per_user").log.end_offset
    channels.open_writer(client, "clicks").end()  # the end of the input closes the windows still open
    status = client.wait()
    (
        spark.read.format("stretch")
        .option("job", JOB)
        .option("channel", "per_user")
        .option("startingOffsets", str(closed_by_stream))
        .load()
        .write.parquet(str(work / "results" / "closed_at_end"))
    )
    job_seconds = time.monotonic() - started  # the last result is written
    got = result_windows(
        r
        for part in ("streamed", "closed_at_end")
        for r in spark.read.parquet(str(work / "results" / part)).collect()
    )
    correct = matches(got, expected_windows(work / "clicks"))
    summary = summarize(
        out,
        events,
        got,
        job_seconds,
        correct,
        status=status.name,
        where=f", job {status.name}",
        rescales=[
            {k: r[k] for k in ("old_parallelism", "new_parallelism", "elapsed_ms", "state_bytes_copied")}
            for r in client.describe()["rescales"]
        ],
    )
    out(f"  results: {work / 'results'} (Parquet, written by Spark)")
    latencies = _latencies(client, started, input_ended)
    if latencies:
        ms = sorted(v for _, v in latencies)
        out(f"  publish -> result latency: median {ms[len(ms) // 2]:.1f} ms, max {ms[-1]:.1f} ms")
    if plot:
        path = Path.cwd() / "stretch-demo.png"
        _plot(samples, latencies, path)
        out(f"  plot: {path}")
    return summary


def stage_query(spark, client, work: Path, files_per_trigger: int):
    """Start Spark's query with the job as its stage: clicks in, the windows the stream closes out as
    Parquet (``results/streamed``). One for both demos, so that they differ only in where the job runs."""
    from stretch.spark import stage  # Spark is started by now

    clicks = (
        spark.readStream.schema("user BIGINT, ts BIGINT, amount DOUBLE")
        .option("maxFilesPerTrigger", files_per_trigger)  # watermarks order the files of a micro-batch
        .parquet(str(work / "clicks"))
    )
    return (
        stage(clicks, client, into="clicks", out="per_user")  # one query: the job is a stage of it
        .writeStream.format("parquet")
        .option("path", str(work / "results" / "streamed"))
        .option("checkpointLocation", str(work / "checkpoints"))
        .trigger(availableNow=True)
        .start()
    )


def _warm_python_workers(spark) -> None:
    """Start Spark's Python workers, with stretch imported, before the first micro-batch needs
    them (Spark reuses its workers): a long-running pipeline pays this once, not per query."""
    spark.range(2, numPartitions=2).mapInArrow(_import_stage, "id BIGINT").collect()


def _import_stage(batches):
    import stretch.spark.stage  # noqa: F401

    yield from batches


def _latencies(client, started: float, input_ended: float) -> list[tuple[float, float]]:
    """(seconds into the run, ms): for each result batch the job appended, the time since Spark's
    micro-batch whose watermark fired it began publishing into the job (the final results, which
    the end of the input fires, have no such micro-batch)."""
    timeline = client.control({"op": "timeline"})
    published = timeline["published"]
    out = []
    for at in timeline["appended"]["per_user"]:
        if at >= input_ended:
            break
        before = [p for p in published if p <= at]
        if before:
            out.append((at - started, (at - before[-1]) * 1000))
    return out


def _monitor(client, query, events, schedule, started, out) -> list[tuple]:
    """Sample the job twice a second while Spark feeds it; rescale live as the input passes
    evenly spaced marks. Rescales the input outran (a small run on a busy machine) are made once
    Spark has delivered everything, while the job still holds its open windows."""
    samples = []  # (t, events/s, parallelism, backlog batches)
    last_in, last_t = 0, time.monotonic()
    pending = list(schedule)
    marks = [events * (i + 1) // (len(schedule) + 1) for i in range(len(schedule))]
    rescaling: threading.Thread | None = None
    seen = 0
    waiting_said = False

    def report_rescales(now: float) -> None:
        nonlocal seen
        for r in client.describe()["rescales"][seen:]:
            out(
                f"  {now - started:5.1f}s  rescaled live {r['old_parallelism']} -> {r['new_parallelism']} in "
                f"{r['elapsed_ms']:.2f} ms, {r['state_bytes_copied']} state bytes copied"
            )
            seen += 1

    while query.isActive:
        time.sleep(0.1)
        now = time.monotonic()
        op = client.describe()["operators"][0]
        records = op["records_in"]
        idle = rescaling is None or not rescaling.is_alive()
        if pending and idle and records >= marks[len(schedule) - len(pending)]:
            rescaling = threading.Thread(
                target=client.rescale, args=("per-user windows", pending.pop(0)), daemon=True
            )
            rescaling.start()
        if now - last_t >= 0.5:
            rate = (records - last_in) / (now - last_t)
            samples.append((now - started, rate, op["parallelism"], op["gate_depth"]))
            if records:
                out(
                    f"  {now - started:5.1f}s  {rate:>10,.0f} clicks/s  parallelism {op['parallelism']}  "
                    f"gate depth {op['gate_depth']}"
                )
            elif not waiting_said:  # Spark plans its first micro-batch and starts its Python workers
                out(f"  {now - started:5.1f}s  waiting for Spark's first micro-batch ...")
                waiting_said = True
            last_in, last_t = records, now
        report_rescales(now)
    try:
        query.awaitTermination()
    except Exception:  # the caller reports query.exception()
        pass
    if rescaling is not None:
        rescaling.join()
    for p in pending:
        client.rescale("per-user windows", p)
    report_rescales(time.monotonic())
    return samples


def _plot(samples, latencies, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s[0] for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(t, [s[1] for s in samples])
    axes[0].set_ylabel("clicks/s into the job")
    axes[1].step(t, [s[2] for s in samples], where="post")
    axes[1].set_ylabel("parallelism")
    axes[2].plot(t, [s[3] for s in samples])
    axes[2].set_ylabel("gate depth (batches)")
    axes[3].plot([x for x, _ in latencies], [y for _, y in latencies], ".", markersize=3)
    axes[3].set_ylabel("publish -> result (ms)")
    axes[3].set_xlabel("seconds")
    fig.suptitle("stretch demo: Spark -> stretch (live rescale) -> Spark")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
