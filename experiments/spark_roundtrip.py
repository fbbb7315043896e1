"""Spark -> stretch -> Spark on W1, beside Spark Structured Streaming's own stateful aggregation.

    python experiments/spark_roundtrip.py --json

W1 (int64 key uniform over 100k keys, a count column of ones, a float64 value) is written as
Parquet files; both peers read them with ``maxFilesPerTrigger`` files per micro-batch, until all
are read (``availableNow``), in the same local[2] Spark session.

  stretch_roundtrip  Spark reads the files and writes them into a stretch job with
                     ``format("stretch")``; the job keeps a running count and sum per key
                     (vectorized ``sum`` on the two columns, one result per event, as Flink's
                     rolling aggregation); a second Spark query reads every result back with
                     ``format("stretch")`` into the ``noop`` sink. Timed from the start of the
                     writing query until the reading query has read the last result.
  spark_ss           ``groupBy(f0).agg(count, sum(f1), sum(f2))`` in update mode into ``noop``:
                     Spark's state store keeps the per-key aggregates. Timed from query start to
                     its end.

Medians over ``--repeats``; median micro-batch durations from each query's progress reports (the
writing query's for stretch).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from _common import OUT, emit, log, median, w1

from stretch import channels
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource

W1_TYPE = Types.ROW_NAMED(["f0", "f1", "f2"], [Types.LONG(), Types.LONG(), Types.DOUBLE()])
SCHEMA = "f0 BIGINT, f1 BIGINT, f2 DOUBLE"


def spark_session():
    from pyspark.sql import SparkSession

    from stretch.spark import StretchDataSource

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("stretch spark round trip benchmark")
        .config("spark.sql.shuffle.partitions", "2")
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


def stretch_run(spark, files: Path, work: Path, per_trigger: int, parallelism: int, events: int, run: int):
    name = f"spark round trip {run}"
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    (
        env.from_source(ChannelSource("w1", W1_TYPE), None, "w1")
        .key_by("f0")
        .sum(["f1", "f2"])
        .name("count+sum")
        .sink_to(ChannelSink("totals"))
    )
    client = env.execute_async(name)
    t0 = time.monotonic()
    into = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", per_trigger)
        .parquet(str(files))
        .writeStream.format("stretch")
        .option("job", name)
        .option("channel", "w1")
        .option("checkpointLocation", str(work / f"into-{run}"))
        .trigger(availableNow=True)
        .start()
    )
    back = (
        spark.readStream.format("stretch")
        .option("job", name)
        .option("channel", "totals")
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(work / f"back-{run}"))
        .start()
    )
    into.awaitTermination()
    channels.open_writer(client, "w1").end()
    client.wait()
    reader = channels.open_reader(client, "totals")
    end = reader.log.end_offset
    reader.close()
    while _offset_read(back) < end:
        time.sleep(0.02)
    elapsed = time.monotonic() - t0
    back.stop()
    rows_back = sum(p["numInputRows"] for p in back.recentProgress)
    if rows_back and rows_back != events and len(back.recentProgress) < 100:
        raise SystemExit(f"stretch round trip read {rows_back} results for {events} events")
    return elapsed, batch_ms(into)


def _offset_read(query) -> int:
    progress = query.lastProgress
    if not progress or not progress["sources"]:
        return -1
    end = progress["sources"][0].get("endOffset")
    end = json.loads(end) if isinstance(end, str) else end
    return (end or {}).get("offset", -1)


def spark_ss_run(spark, files: Path, work: Path, per_trigger: int, run: int):
    from pyspark.sql import functions as F

    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", per_trigger).parquet(str(files))
    agg = stream.groupBy("f0").agg(F.count("*"), F.sum("f1"), F.sum("f2"))
    t0 = time.monotonic()
    query = (
        agg.writeStream.format("noop")
        .outputMode("update")
        .option("checkpointLocation", str(work / f"ss-{run}"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return time.monotonic() - t0, batch_ms(query)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--per-trigger", type=int, default=2, help="maxFilesPerTrigger for both peers")
    ap.add_argument("--parallelism", type=int, default=2, help="of the stretch operator")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"stretch_roundtrip": [], "spark_ss": []}
    batches: dict[str, list[float]] = {"stretch_roundtrip": [], "spark_ss": []}
    with tempfile.TemporaryDirectory(prefix="stretch-bench-") as tmp:
        work = Path(tmp)
        files = work / "w1"
        files.mkdir()
        data = w1(args.events, args.keys)
        per_file = -(-args.events // args.files)
        for i in range(args.files):
            pq.write_table(data.slice(i * per_file, per_file), files / f"part-{i:04d}.parquet")
        warm = work / "warm-up"
        warm.mkdir()
        pq.write_table(data.slice(0, 10_000), warm / "part-0.parquet")
        spark = spark_session()
        try:
            # one small run of each first: JVM code generation and Python workers start outside the timing
            stretch_run(spark, warm, work, 1, args.parallelism, 10_000, -1)
            spark_ss_run(spark, warm, work, 1, -1)
            for r in range(args.repeats):
                log(f"repeat {r + 1}/{args.repeats}")
                elapsed, ms = stretch_run(
                    spark, files, work, args.per_trigger, args.parallelism, args.events, r
                )
                times["stretch_roundtrip"].append(elapsed)
                batches["stretch_roundtrip"].append(ms)
                elapsed, ms = spark_ss_run(spark, files, work, args.per_trigger, r)
                times["spark_ss"].append(elapsed)
                batches["spark_ss"].append(ms)
        finally:
            spark.stop()
    result = {f"{k}_meps": round(args.events / median(v) / 1e6, 3) for k, v in times.items()}
    result.update(
        stretch_batch_ms=round(median(batches["stretch_roundtrip"]), 1),
        spark_ss_batch_ms=round(median(batches["spark_ss"]), 1),
        ratio_stretch_vs_spark_ss=round(result["stretch_roundtrip_meps"] / result["spark_ss_meps"], 2),
        events=args.events,
        keys=args.keys,
        files=args.files,
        files_per_trigger=args.per_trigger,
        parallelism=args.parallelism,
        repeats=args.repeats,
    )
    OUT.mkdir(exist_ok=True)
    emit(result, args.json)


if __name__ == "__main__":
    main()
