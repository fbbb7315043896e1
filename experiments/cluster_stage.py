"""The one-query stage with its job on a 2-node local cluster, beside the same stage on one node
engine, in one run (``cluster_scale.py --json`` reports these; this runs them alone too):

    python experiments/cluster_stage.py --json [--stage-events 5000000 --stage-repeats 3]

W1 (as in spark_roundtrip.py: int64 key uniform over 100k keys, a count column of ones, a float64
value) as Parquet files, ``--stage-per-trigger`` files a micro-batch, read by one local[2] Spark query
whose stateful stage is a stretch job keeping a running count and sum per key (update mode: each
micro-batch's latest per key), into ``noop``:

- ``single_stage_meps``: the job on a node engine of this machine (parallelism
  ``--stage-parallelism``);
- ``cluster_stage_meps``: the job on ``StretchCluster.local(nodes=2)`` (each node running it at
  ``--stage-node-parallelism``): each task splits its rows by key group and hands each node its part
  through shared memory; each node answers with the results its rows caused.

The two run alternately after an untimed warm-up of each; medians over ``--stage-repeats``. The nodes,
the job's workers and Spark share the machine's cores.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import emit, log, median, w1
from spark_roundtrip import SCHEMA, W1_TYPE, phases_ms, spark_session, write_files

from stretch.cluster import StretchCluster
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.spark import stage


def count_sum(parallelism: int) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    (
        env.from_source(ChannelSource("w1", W1_TYPE), None, "w1")
        .key_by("f0")
        .sum(["f1", "f2"])
        .name("count+sum")
        .sink_to(ChannelSink("totals"))
    )
    return env


def timed_stage(spark, files: Path, client, checkpoint: Path, per_trigger: int, events: int):
    """One query through the stage to its end; (seconds, median phases of its micro-batches)."""
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", per_trigger).parquet(str(files))
    results = stage(stream, client, into="w1", out="totals", mode="update", key="f0")
    writer = (
        results.writeStream.format("noop").outputMode("update").option("checkpointLocation", str(checkpoint))
    )
    t0 = time.monotonic()
    query = writer.trigger(availableNow=True).start()
    query.awaitTermination()
    elapsed = time.monotonic() - t0
    rows = sum(p["numInputRows"] for p in query.recentProgress)
    if rows != events:
        raise SystemExit(f"the stage query read {rows} rows for {events} events")
    return elapsed, phases_ms(query)


def stage_meps(
    events: int,
    keys: int,
    files: int,
    per_trigger: int,
    parallelism: int,
    node_parallelism: int,
    repeats: int,
) -> dict:
    """``single_stage_meps`` and ``cluster_stage_meps``, side by side in one Spark session."""
    with tempfile.TemporaryDirectory(prefix="stretch-cluster-stage-") as tmp:
        work = Path(tmp)
        data = w1(events, keys)
        write_files(work / "w1", data, files)
        write_files(work / "warm-up", data.slice(0, 10_000), 1)
        spark = spark_session()
        times: dict[str, list[float]] = {"single": [], "cluster": []}
        phases: dict[str, list] = {"single": [], "cluster": []}
        try:
            with StretchCluster.local(nodes=2) as cluster:
                run = 0

                def once(peer: str, source: Path, n: int, per: int):
                    nonlocal run
                    run += 1
                    name = f"cluster stage bench {peer} {run}"
                    if peer == "single":
                        client = count_sum(parallelism).execute_async(name)
                    else:
                        client = count_sum(node_parallelism).execute_async(name, cluster=cluster)
                    try:
                        return timed_stage(spark, source, client, work / f"ckpt-{name}", per, n)
                    finally:
                        client.cancel()

                peers = list(times)
                for peer in peers:  # JVM code generation and Python workers start outside the timing
                    once(peer, work / "warm-up", 10_000, 1)
                for r in range(repeats):
                    log(f"repeat {r + 1}/{repeats}")
                    for peer in peers:
                        elapsed, ph = once(peer, work / "w1", events, per_trigger)
                        log(
                            f"  {peer} stage: {elapsed:.1f} s, {events / elapsed / 1e6:.3f} M events/s, phases {ph}"
                        )
                        times[peer].append(elapsed)
                        phases[peer].append(ph)
        finally:
            spark.stop()
    single, on_cluster = events / median(times["single"]) / 1e6, events / median(times["cluster"]) / 1e6
    return {
        "single_stage_meps": round(single, 3),
        "cluster_stage_meps": round(on_cluster, 3),
        "cluster_stage_ratio": round(on_cluster / single, 3),
        "stage_events": events,
        "stage_files_per_trigger": per_trigger,
        "stage_repeats": repeats,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options (``--stage-...``), for its own command line and cluster_scale.py's."""
    parser.add_argument("--stage-events", type=int, default=5_000_000)
    parser.add_argument("--stage-keys", type=int, default=100_000)
    parser.add_argument("--stage-files", type=int, default=20)
    parser.add_argument("--stage-per-trigger", type=int, default=2, help="maxFilesPerTrigger")
    parser.add_argument("--stage-parallelism", type=int, default=2, help="of the job on one node engine")
    parser.add_argument(
        "--stage-node-parallelism", type=int, default=1, help="of the job on each of the 2 nodes"
    )
    parser.add_argument("--stage-repeats", type=int, default=3)


def from_arguments(args) -> dict:
    return stage_meps(
        args.stage_events,
        args.stage_keys,
        args.stage_files,
        args.stage_per_trigger,
        args.stage_parallelism,
        args.stage_node_parallelism,
        args.stage_repeats,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    add_arguments(parser)
    args = parser.parse_args()
    emit(from_arguments(args), args.json)


if __name__ == "__main__":
    main()
