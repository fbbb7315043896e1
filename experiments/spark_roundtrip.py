"""Spark -> stretch -> Spark on W1, beside what a PySpark team would otherwise run in Spark alone.

    python experiments/spark_roundtrip.py --json

W1 (int64 key uniform over 100k keys, a count column of ones, a float64 value) is written as
Parquet files; every peer reads them with ``maxFilesPerTrigger`` files per micro-batch until all
are read (``availableNow``), in one local[2] Spark session, after a small warm-up run of each.
Every query runs in update mode, the mode in which a running aggregate is current after each
micro-batch; all of them keep a running count and sum per key.

  stretch_roundtrip  Spark reads the files and writes them into a stretch job with
                     ``format("stretch")``; the job keeps a running count and sum per key
                     (vectorized ``sum`` on the two columns, one result per event, as Flink's
                     rolling aggregation: at least as many rows as Spark's update mode emits); a
                     second Spark query reads every result back with ``format("stretch")`` into
                     the ``noop`` sink. Timed from the start of the writing query until the
                     reading query has read the last result.
  stretch_stage      the same job as a stage inside one Spark query (``stretch.spark.stage``,
                     update mode: each key's latest count and sum per micro-batch, as Spark's
                     update mode gives), into ``noop``.
  spark_ss           ``groupBy(f0).agg(count, sum(f1), sum(f2))`` into ``noop``: Spark's state
                     store (its default, HDFS-backed in memory) keeps the per-key aggregates.
  spark_tws          ``groupBy(f0).transformWithStateInPandas`` with a ValueState holding the
                     count and the sums, one row per key and micro-batch (what a PySpark user
                     writes for per-key logic of their own); it needs the RocksDB state store
                     provider. It runs about a thousand times slower than the others, so it runs
                     on a subset: the W1 events of the first ``--tws-key-share`` of the keys, in
                     as many files, so that each micro-batch has as many events per key as W1's.
  spark_scan         the file scan alone into ``noop``; ``spark_mapinarrow`` the same through a
                     no-op ``mapInArrow`` (what a one-query stage would run through);
                     ``spark_mapinarrow_keyed`` through the same no-op ``mapInArrow`` after
                     ``repartition(2, f0)``, the shuffle by key that the stage's update mode runs
                     (so that each key's rows of a micro-batch are in one task): the least an
                     update-mode stage can cost.

Latency (``*_latency_ms``): after one untimed file (start-up), files of ``--latency-rows`` W1
events land one every ``--latency-interval`` s (an atomic rename into the source directory) while
the queries run with the default trigger (a micro-batch as soon as the previous one ends); a
file's latency is from its landing until the micro-batch that put its last result into the sink
ended (Spark SS: the aggregation query's; the round trip: the reading query's, counting results
read back).

Medians over ``--repeats``; median micro-batch durations (``durationMs``) from each query's
progress reports.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from _common import OUT, emit, log, median, w1

from stretch import channels
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.spark import stage

W1_TYPE = Types.ROW_NAMED(["f0", "f1", "f2"], [Types.LONG(), Types.LONG(), Types.DOUBLE()])
SCHEMA = "f0 BIGINT, f1 BIGINT, f2 DOUBLE"
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
PEERS = [
    "stretch_stage",
    "stretch_roundtrip",
    "spark_ss",
    "spark_tws",
    "spark_scan",
    "spark_mapinarrow",
    "spark_mapinarrow_keyed",
]


def spark_session():
    from pyspark.sql import SparkSession

    from stretch.spark import StretchDataSource

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("stretch spark round trip benchmark")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.numRecentProgressUpdates", "1000")
        # a busy machine: the Python side's socket to the JVM times out after 15 s by default
        # (CANNOT_OPEN_SOCKET); the JVM's own 10 s wait for a worker to connect back is fixed
        .config("spark.python.authenticate.socketTimeout", "120s")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(StretchDataSource)
    return spark


def batch_ms(query) -> float:
    durations = [p["durationMs"]["triggerExecution"] for p in query.recentProgress if p["numInputRows"]]
    return median(durations) if durations else float("nan")


def phases_ms(query) -> dict[str, float]:
    """Median of each ``durationMs`` phase over the micro-batches that read rows."""
    reports = [p["durationMs"] for p in query.recentProgress if p["numInputRows"]]
    keys = sorted({k for r in reports for k in r})
    return {k: round(median([r.get(k, 0) for r in reports]), 1) for k in keys}


def start_job(name: str, parallelism: int):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    (
        env.from_source(ChannelSource("w1", W1_TYPE), None, "w1")
        .key_by("f0")
        .sum(["f1", "f2"])
        .name("count+sum")
        .sink_to(ChannelSink("totals"))
    )
    return env.execute_async(name)


def roundtrip_queries(spark, files: Path, work: Path, name: str, tag: str, per_trigger: int | None):
    """The writing query (files -> the job's input channel) and the reading query (its output
    channel -> noop); ``per_trigger`` None: the default trigger, every file there at each batch."""
    stream = spark.readStream.schema(SCHEMA)
    if per_trigger is not None:
        stream = stream.option("maxFilesPerTrigger", per_trigger)
    into = (
        stream.parquet(str(files))
        .writeStream.format("stretch")
        .option("job", name)
        .option("channel", "w1")
        .option("checkpointLocation", str(work / f"into-{tag}"))
    )
    if per_trigger is not None:
        into = into.trigger(availableNow=True)
    into = into.start()
    back = (
        spark.readStream.format("stretch")
        .option("job", name)
        .option("channel", "totals")
        .load()
        .writeStream.format("noop")
        .outputMode("update")
        .option("checkpointLocation", str(work / f"back-{tag}"))
        .start()
    )
    return into, back


def stretch_run(spark, files: Path, work: Path, per_trigger: int, parallelism: int, events: int, run):
    name = f"spark round trip {run}"
    client = start_job(name, parallelism)
    t0 = time.monotonic()
    into, back = roundtrip_queries(spark, files, work, name, str(run), per_trigger)
    try:
        into.awaitTermination()
        channels.open_writer(client, "w1").end()
        client.wait()
        reader = channels.open_reader(client, "totals")
        end = reader.log.end_offset
        reader.close()
        while _offset_read(back) < end:
            if back.exception() is not None:
                raise back.exception()
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
    except BaseException:
        # a failed query (e.g. a Python worker that did not start in time) must not leave the
        # job running, which would keep this process alive
        into.stop()
        client.cancel()
        raise
    finally:
        back.stop()
    rows_back = sum(p["numInputRows"] for p in back.recentProgress)
    if rows_back != events:
        raise SystemExit(f"stretch round trip read {rows_back} results for {events} events")
    return elapsed, {"into": phases_ms(into), "back": phases_ms(back)}, batch_ms(into)


def _offset_read(query) -> int:
    progress = query.lastProgress
    if not progress or not progress["sources"]:
        return -1
    end = progress["sources"][0].get("endOffset")
    end = json.loads(end) if isinstance(end, str) else end
    return (end or {}).get("offset", -1)


def _timed_query(writer, events: int | None = None):
    t0 = time.monotonic()
    query = writer.trigger(availableNow=True).start()
    query.awaitTermination()
    elapsed = time.monotonic() - t0
    rows = sum(p["numInputRows"] for p in query.recentProgress)
    if events is not None and rows != events:
        raise SystemExit(f"{query.name or 'a query'} read {rows} rows for {events} events")
    return elapsed, phases_ms(query), batch_ms(query)


def w1_stream(spark, files: Path, per_trigger: int | None):
    stream = spark.readStream.schema(SCHEMA)
    if per_trigger is not None:
        stream = stream.option("maxFilesPerTrigger", per_trigger)
    return stream.parquet(str(files))


def spark_ss_query(spark, files: Path, per_trigger: int | None):
    from pyspark.sql import functions as F

    agg = w1_stream(spark, files, per_trigger).groupBy("f0").agg(F.count("*"), F.sum("f1"), F.sum("f2"))
    return agg.writeStream.format("noop").outputMode("update")


def stage_query(spark, files: Path, name: str, per_trigger: int | None):
    results = stage(
        w1_stream(spark, files, per_trigger), name, into="w1", out="totals", mode="update", key="f0"
    )
    return results.writeStream.format("noop").outputMode("update")


def stretch_stage_run(spark, files: Path, work: Path, per_trigger: int, parallelism: int, events: int, run):
    name = f"spark stage {run}"
    client = start_job(name, parallelism)
    try:
        writer = stage_query(spark, files, name, per_trigger).option(
            "checkpointLocation", str(work / f"stage-{run}")
        )
        return _timed_query(writer, events)
    finally:
        client.cancel()


def spark_ss_run(spark, files: Path, work: Path, per_trigger: int, run, events: int):
    writer = spark_ss_query(spark, files, per_trigger).option("checkpointLocation", str(work / f"ss-{run}"))
    return _timed_query(writer, events)


def tws_processor():
    import pandas as pd
    from pyspark.sql.streaming import StatefulProcessor

    class CountSum(StatefulProcessor):
        """The running count and sums of one key in a ValueState; one output row per key and
        micro-batch (update mode)."""

        def init(self, handle) -> None:
            self.totals = handle.getValueState("totals", "count BIGINT, f1 BIGINT, f2 DOUBLE")

        def handleInputRows(self, key, rows, timerValues):
            count, f1, f2 = self.totals.get() if self.totals.exists() else (0, 0, 0.0)
            for frame in rows:
                count += len(frame)
                f1 += int(frame["f1"].sum())
                f2 += float(frame["f2"].sum())
            self.totals.update((count, f1, f2))
            yield pd.DataFrame({"f0": [key[0]], "count": [count], "f1": [f1], "f2": [f2]})

        def close(self) -> None:
            pass

    return CountSum()


def spark_tws_run(spark, files: Path, work: Path, per_trigger: int, run, events: int):
    previous = spark.conf.get("spark.sql.streaming.stateStore.providerClass")
    # transformWithState refuses the default HDFS-backed store (STORE_BACKEND_NOT_SUPPORTED_FOR_TWS)
    spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB)
    try:
        writer = (
            w1_stream(spark, files, per_trigger)
            .groupBy("f0")
            .transformWithStateInPandas(
                tws_processor(), "f0 BIGINT, count BIGINT, f1 BIGINT, f2 DOUBLE", "Update", "None"
            )
            .writeStream.format("noop")
            .outputMode("update")
            .option("checkpointLocation", str(work / f"tws-{run}"))
        )
        return _timed_query(writer, events)
    finally:
        spark.conf.set("spark.sql.streaming.stateStore.providerClass", previous)


def _identity(batches):
    yield from batches


def spark_scan_run(spark, files: Path, work: Path, per_trigger: int, run, events: int, peer: str):
    df = w1_stream(spark, files, per_trigger)
    if peer == "spark_mapinarrow_keyed":
        df = df.repartition(int(spark.conf.get("spark.sql.shuffle.partitions")), "f0")  # as the stage's
    if peer != "spark_scan":
        df = df.mapInArrow(_identity, SCHEMA)
    writer = df.writeStream.format("noop").outputMode("update")
    return _timed_query(writer.option("checkpointLocation", str(work / f"{peer}-{run}")), events)


# ---- latency -----------------------------------------------------------------------------------
def land_files(directory: Path, data: pa.Table, rows: int, count: int, interval: float) -> list[float]:
    """Land ``count`` files of ``rows`` events each, one every ``interval`` s; their landing times
    (epoch s). Each file is written under a hidden name, then renamed into view at once."""
    landed = []
    next_at = time.time()
    for i in range(count):
        hidden = directory / f".part-{i:04d}.parquet"
        pq.write_table(data.slice((i * rows) % max(1, data.num_rows - rows), rows), hidden)
        delay = next_at - time.time()
        if delay > 0:
            time.sleep(delay)
        os.rename(hidden, directory / f"part-{i:04d}.parquet")
        landed.append(time.time())
        next_at += interval
    return landed


def batch_ends(query) -> list[tuple[float, int]]:
    """(end time in epoch s, rows read so far) of each micro-batch that read rows."""
    ends, total = [], 0
    for p in query.recentProgress:
        if p["numInputRows"]:
            total += p["numInputRows"]
            start = datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp()
            ends.append((start + p["durationMs"]["triggerExecution"] / 1000, total))
    return ends


def file_latencies(landed: list[float], rows: int, ends: list[tuple[float, int]]) -> list[float]:
    """Per file: from its landing until the first micro-batch end by which all of its rows (the
    files are read in landing order, after the warm-up file) were through."""
    out = []
    for i, t in enumerate(landed):
        need = (i + 2) * rows  # the warm-up file came first
        done = next((end for end, total in ends if total >= need), None)
        if done is None:
            raise SystemExit(f"file {i} never made it through ({ends[-1:]})")
        out.append((done - t) * 1000)
    return out


def wait_rows(query, rows: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while sum(p["numInputRows"] for p in query.recentProgress) < rows:
        if query.exception() is not None:
            raise query.exception()
        if time.monotonic() > deadline:
            raise SystemExit(f"query read {sum(p['numInputRows'] for p in query.recentProgress)} of {rows}")
        time.sleep(0.05)


def warm_up_landing(query, directory: Path, data: pa.Table, rows: int) -> None:
    """Land one untimed file and wait for its results: the first micro-batch with data starts the
    Python workers and plans the job, which is start-up, not latency."""
    pq.write_table(data.slice(0, rows), directory / ".warm-up.parquet")
    os.rename(directory / ".warm-up.parquet", directory / "warm-up.parquet")
    wait_rows(query, rows, 120)


def latency_run(spark, data: pa.Table, work: Path, peer: str, args) -> list[float]:
    directory = work / f"landing-{peer}"
    directory.mkdir()
    total = args.latency_rows * (args.latency_files + 1)  # the warm-up file's too
    if peer in ("spark_ss", "stretch_stage"):
        client = start_job("spark stage latency", args.parallelism) if peer == "stretch_stage" else None
        try:
            writer = (
                spark_ss_query(spark, directory, None)
                if client is None
                else stage_query(spark, directory, "spark stage latency", None)
            )
            query = writer.option("checkpointLocation", str(work / f"{peer}-latency")).start()
            warm_up_landing(query, directory, data, args.latency_rows)
            landed = land_files(directory, data, args.latency_rows, args.latency_files, args.latency_interval)
            wait_rows(query, total, 120)
            query.stop()
        finally:
            if client is not None:
                client.cancel()
        return file_latencies(landed, args.latency_rows, batch_ends(query))
    name = "spark round trip latency"
    client = start_job(name, args.parallelism)
    into, back = roundtrip_queries(spark, directory, work, name, "latency", None)
    try:
        warm_up_landing(back, directory, data, args.latency_rows)
        landed = land_files(directory, data, args.latency_rows, args.latency_files, args.latency_interval)
        wait_rows(back, total, 120)
    finally:
        into.stop()
        back.stop()
        channels.open_writer(client, "w1").end()
        client.wait()
    return file_latencies(landed, args.latency_rows, batch_ends(back))


def write_files(directory: Path, data: pa.Table, files: int) -> None:
    directory.mkdir()
    per_file = -(-data.num_rows // files)
    for i in range(files):
        pq.write_table(data.slice(i * per_file, per_file), directory / f"part-{i:04d}.parquet")


def percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--per-trigger", type=int, default=2, help="maxFilesPerTrigger for every peer")
    ap.add_argument("--parallelism", type=int, default=2, help="of the stretch operator")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tws-key-share", type=float, default=0.01, help="share of W1's keys for spark_tws")
    ap.add_argument("--latency-files", type=int, default=30)
    ap.add_argument("--latency-rows", type=int, default=50_000, help="W1 events per landed file")
    ap.add_argument("--latency-interval", type=float, default=1.0, help="seconds between landings")
    ap.add_argument(
        "--skip", default="", help="comma-separated peers to leave out (of: " + ", ".join(PEERS) + ")"
    )
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    peers = [p for p in PEERS if p not in skip]
    times: dict[str, list[float]] = {p: [] for p in peers}
    batches: dict[str, list[float]] = {p: [] for p in peers}
    phases: dict[str, list] = {p: [] for p in peers}
    with tempfile.TemporaryDirectory(prefix="stretch-bench-") as tmp:
        work = Path(tmp)
        data = w1(args.events, args.keys)
        write_files(work / "w1", data, args.files)
        tws_data = data.filter(pc.less(data["f0"], max(1, int(args.keys * args.tws_key_share))))
        write_files(work / "w1-tws", tws_data, args.files)
        write_files(work / "warm-up", data.slice(0, 10_000), 1)
        write_files(work / "warm-up-tws", tws_data.slice(0, 500), 1)
        sizes = {p: args.events for p in peers} | {"spark_tws": tws_data.num_rows}
        spark = spark_session()

        def run(peer: str, files: Path, per_trigger: int, tag, events: int):
            if peer == "stretch_roundtrip":
                return stretch_run(spark, files, work, per_trigger, args.parallelism, events, tag)
            if peer == "stretch_stage":
                return stretch_stage_run(spark, files, work, per_trigger, args.parallelism, events, tag)
            if peer == "spark_ss":
                return spark_ss_run(spark, files, work, per_trigger, tag, events)
            if peer == "spark_tws":
                return spark_tws_run(spark, files, work, per_trigger, tag, events)
            return spark_scan_run(spark, files, work, per_trigger, tag, events, peer)

        try:
            # one small run of each first: JVM code generation and Python workers start outside the timing
            for peer in peers:
                if peer == "spark_tws":
                    run(peer, work / "warm-up-tws", 1, "warm-tws", min(500, tws_data.num_rows))
                else:
                    run(peer, work / "warm-up", 1, f"warm-{peer}", 10_000)
            for r in range(args.repeats):
                log(f"repeat {r + 1}/{args.repeats}")
                for peer in peers:
                    files = work / ("w1-tws" if peer == "spark_tws" else "w1")
                    elapsed, ph, ms = run(peer, files, args.per_trigger, r, sizes[peer])
                    log(f"  {peer}: {elapsed:.1f} s, median micro-batch {ms:.0f} ms")
                    times[peer].append(elapsed)
                    batches[peer].append(ms)
                    phases[peer].append(ph)
            latency = {}
            for peer in ("spark_ss", "stretch_stage", "stretch_roundtrip"):
                if peer in peers and args.latency_files:
                    log(f"latency: {peer}")
                    latency[peer] = latency_run(spark, data, work, peer, args)
        finally:
            spark.stop()
    result: dict = {f"{p}_meps": round(sizes[p] / median(times[p]) / 1e6, 4) for p in peers}
    if "spark_tws" in peers:
        result["spark_tws_eps"] = round(sizes["spark_tws"] / median(times["spark_tws"]))
        result["spark_tws_events"] = sizes["spark_tws"]
        result["spark_tws_keys"] = max(1, int(args.keys * args.tws_key_share))
    for p in peers:
        result[f"{p}_batch_ms"] = round(median(batches[p]), 1)
    for ours in ("stretch_stage", "stretch_roundtrip"):
        hops = ("spark_mapinarrow", "spark_mapinarrow_keyed") if ours == "stretch_stage" else ()
        for peer in ("spark_ss", "spark_tws", *hops):
            if ours in peers and peer in peers:
                result[f"ratio_{ours.removeprefix('stretch_')}_vs_{peer}"] = round(
                    result[f"{ours}_meps"] / result[f"{peer}_meps"], 2
                )
    short = {"spark_ss": "spark_ss", "stretch_roundtrip": "roundtrip", "stretch_stage": "stage"}
    for peer, values in latency.items():
        result[f"{short[peer]}_p50_latency_ms"] = percentile(values, 50)
        result[f"{short[peer]}_p99_latency_ms"] = percentile(values, 99)
    result.update(
        events=args.events,
        keys=args.keys,
        files=args.files,
        files_per_trigger=args.per_trigger,
        parallelism=args.parallelism,
        repeats=args.repeats,
        latency_files=args.latency_files if latency else 0,
        latency_offered_eps=round(args.latency_rows / args.latency_interval),
        phases_ms={p: _median_phases(v) for p, v in phases.items()},
    )
    OUT.mkdir(exist_ok=True)
    emit(result, args.json)


def _median_phases(runs: list) -> dict:
    """Median over repeats of each query's median phase durations."""
    if not runs:
        return {}
    if "into" in runs[0]:
        return {q: _median_phases([r[q] for r in runs]) for q in runs[0]}
    keys = sorted({k for r in runs for k in r})
    return {k: round(median([r.get(k, 0) for r in runs]), 1) for k in keys}


if __name__ == "__main__":
    main()
