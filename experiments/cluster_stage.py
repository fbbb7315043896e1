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
  through shared memory; each node answers with the results its rows caused;
- ``spark_only_stage_meps``: the same query with an identity ``mapInArrow`` in the stage's place
  (the key partitioning kept): what Spark alone costs, the ceiling of both;
- ``*_add_batch_ms``: the median micro-batch's ``addBatch`` phase of each;
- ``cluster_transactions_meps``: the cluster's side alone, without Spark: two threads (as two
  task slots) hand the nodes W1 in transactions of a task's size through ``ClusterWriter.transact``.

The three run in turn after an untimed warm-up of each; medians over ``--stage-repeats``. The nodes,
the job's workers and Spark share the machine's cores.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from _common import emit, log, median, w1
from spark_roundtrip import SCHEMA, W1_TYPE, phases_ms, spark_session, write_files

from stretch.cluster import ClusterWriter, StretchCluster
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


def timed_stage(spark, files: Path, client, checkpoint: Path, per_trigger: int, events: int, shuffle: int):
    """One query through the stage (``client`` None: Spark alone, the stage's shape with an identity
    step in its place) to its end; (seconds, median phases of its micro-batches)."""
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", per_trigger).parquet(str(files))
    if client is None:
        # a lambda: Spark's workers get it by value (this module is not on their path)
        results = stream.repartition(shuffle, "f0").mapInArrow(lambda batches: batches, SCHEMA)
    else:
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


def transact_meps(cluster, data, rows_per_task: int, node_parallelism: int, run: int) -> float:
    """The cluster's side alone: two writers (as Spark's two task slots) hand the nodes W1 in
    transactions of a task's size, as the stage's tasks do, and take the results back."""
    name = f"cluster stage bench transactions {run}"
    client = count_sum(node_parallelism).execute_async(name, cluster=cluster)
    parts = data.to_batches(max_chunksize=rows_per_task)

    def tasks(first: int) -> None:
        for i in range(first, len(parts), 2):
            with ClusterWriter(cluster.address, client.name, "w1") as writer:
                writer.transact(parts[i], "totals", "bench", i // 2, first)

    try:
        t0 = time.monotonic()
        threads = [threading.Thread(target=tasks, args=(first,)) for first in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return data.num_rows / (time.monotonic() - t0) / 1e6
    finally:
        client.cancel()


PEERS = ("single", "cluster", "spark")  # the stage on one node engine, on 2 nodes; Spark alone


def stage_meps(
    events: int,
    keys: int,
    files: int,
    per_trigger: int,
    parallelism: int,
    node_parallelism: int,
    repeats: int,
) -> dict:
    """``single_stage_meps`` and ``cluster_stage_meps`` (and Spark alone, the ceiling), side by
    side in one Spark session."""
    with tempfile.TemporaryDirectory(prefix="stretch-cluster-stage-") as tmp:
        work = Path(tmp)
        data = w1(events, keys)
        write_files(work / "w1", data, files)
        write_files(work / "warm-up", data.slice(0, 10_000), 1)
        spark = spark_session()
        shuffle = int(spark.conf.get("spark.sql.shuffle.partitions"))
        times: dict[str, list[float]] = {p: [] for p in PEERS}
        batch: dict[str, list[float]] = {p: [] for p in PEERS}
        try:
            with StretchCluster.local(nodes=2) as cluster:
                run = 0

                def once(peer: str, source: Path, n: int, per: int):
                    nonlocal run
                    run += 1
                    name = f"cluster stage bench {peer} {run}"
                    client = None
                    if peer == "single":
                        client = count_sum(parallelism).execute_async(name)
                    elif peer == "cluster":
                        client = count_sum(node_parallelism).execute_async(name, cluster=cluster)
                    try:
                        return timed_stage(spark, source, client, work / f"ckpt-{name}", per, n, shuffle)
                    finally:
                        if client is not None:
                            client.cancel()

                for peer in PEERS:  # JVM code generation and Python workers start outside the timing
                    once(peer, work / "warm-up", 10_000, 1)
                transactions = []
                for r in range(repeats):
                    log(f"repeat {r + 1}/{repeats}")
                    rows_per_task = -(-events // files) * per_trigger // shuffle
                    transactions.append(transact_meps(cluster, data, rows_per_task, node_parallelism, r))
                    log(f"  the cluster's transactions alone: {transactions[-1]:.3f} M events/s")
                    for peer in PEERS:
                        elapsed, ph = once(peer, work / "w1", events, per_trigger)
                        log(
                            f"  {peer}: {elapsed:.1f} s, {events / elapsed / 1e6:.3f} M events/s, phases {ph}"
                        )
                        times[peer].append(elapsed)
                        batch[peer].append(ph.get("addBatch", float("nan")))
        finally:
            spark.stop()
    meps = {p: events / median(times[p]) / 1e6 for p in PEERS}
    return {
        "single_stage_meps": round(meps["single"], 3),
        "cluster_stage_meps": round(meps["cluster"], 3),
        "cluster_stage_ratio": round(meps["cluster"] / meps["single"], 3),
        "spark_only_stage_meps": round(meps["spark"], 3),
        "cluster_transactions_meps": round(median(transactions), 3),
        "single_stage_add_batch_ms": round(median(batch["single"]), 1),
        "cluster_stage_add_batch_ms": round(median(batch["cluster"]), 1),
        "spark_only_add_batch_ms": round(median(batch["spark"]), 1),
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
