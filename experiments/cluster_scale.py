"""Nodes added and removed under a steady W1 load on a local cluster, beside the engine on one node.

    python experiments/cluster_scale.py --json [--keys 500000 --events 3000000]

A rolling count+sum over W1 events (vectorized ``sum``, keyed by the int64 key) runs on
``StretchCluster.local(nodes=2)``; a writer streams W1 batches into it (each a micro-batch of one
query, so replays would be dropped per key group) while the nodes go 2 -> 3 -> 2. Reported:

- ``handoff_p50_ms``/``handoff_p99_ms``: one step's move between two nodes (release at the
  frontier, snapshot, ship, load, adopt: after its pre-copy, only what the key groups took during
  it), ``max_stall_ms``: the longest any key group refused rows; ``precopy_p99_ms``: a move's
  pre-copy (its key groups' rows were taken meanwhile, and waited);
- ``moved_fraction`` on 2 -> 3 (ideal 1/3), ``bytes_moved`` per node change, ``state_mb``;
- ``lost``/``duplicated``: per key, the count the cluster holds against the events written;
- ``bytes_moved_ratio``: the bytes a node change shipped over the logical bytes (as Arrow: key
  and state columns) of the keys in the key groups it moved (ideal 1.0);
- ``restart_baseline_ms``: the same job and state on one node engine, checkpointed, stopped and
  restored (what a savepoint and restart, or Flink's reactive mode, amounts to; without moving
  files between hosts, so a lower bound for a cluster);
- ``cluster_meps`` (2 nodes, through the cluster writer) against ``single_node_meps`` (the same
  job and writer path on one node engine, ``channels.open_writer``);
- ``cluster_stage_meps`` against ``single_stage_meps``: one Spark query, W1 in update mode, its
  stage's job on 2 nodes or on one node engine, side by side (see cluster_stage.py;
  ``--skip-stage`` leaves them out).

About 70 MB of state: ``--keys 2500000 --events 5000000``; about 0.5 GB: ``--keys 25000000
--events 30000000``; about 1 GB: ``--keys 50000000 --events 55000000``. ``--plot`` saves each
step's move time (experiments/out/cluster_scale.png).

Scale-out (``scaleout_efficiency``, ``one_node_cluster_vs_engine``): see cluster_scaleout.py
(``--scaleout-events 0`` leaves them out, ``--scaleout-only`` leaves out all else).

A node change under a backlog (``max_stall_backlog_ms`` with at least 2 s queued on each source
node, against the handoff that works off the backlog first): see cluster_backlog.py
(``--backlog`` adds its figures, ``--backlog-only`` leaves out all else).
"""

from __future__ import annotations

import argparse
import threading
import time

import cluster_backlog
import cluster_scaleout
import cluster_stage
import numpy as np
import pyarrow as pa
from _common import emit, log, w1
from pyarrow import flight

from stretch import channels
from stretch.cluster import StretchCluster
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.state.key_groups import key_groups_of

W1 = Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])
BATCH = 20_000


def job(parallelism: int = 2, durable: bool = False) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.from_source(ChannelSource("w1", W1, durable=durable), None, "w1").key_by(0).sum([1, 2]).name(
        "sum"
    ).sink_to(DiscardingSink())
    return env


def batches(table: pa.Table) -> list[pa.RecordBatch]:
    return table.to_batches(max_chunksize=BATCH)


def single_node_meps(data: list[pa.RecordBatch], rows: int) -> float:
    client = job().execute_async("cluster_scale single")
    writer = channels.open_writer(client, "w1")
    t0 = time.perf_counter()
    for b in data:
        writer.write(b)
    writer.end()
    client.wait()
    return rows / (time.perf_counter() - t0) / 1e6


def restart_baseline_ms(data: list[pa.RecordBatch]) -> float:
    """One node engine holding the same state: checkpoint, stop, restore at another parallelism,
    until the restored job runs with all of its state loaded."""
    env = job(durable=True)
    env.enable_checkpointing()  # on demand
    name = f"cluster_scale restart {time.time_ns()}"
    client = env.execute_async(name)
    writer = channels.open_writer(client, "w1")
    for b in data:
        writer.write(b)
    while client.describe()["operators"][0]["records_in"] < sum(b.num_rows for b in data):
        time.sleep(0.05)
    t0 = time.perf_counter()
    client.trigger_checkpoint()
    client.cancel()
    env = job(parallelism=3, durable=True)
    env.enable_checkpointing()
    restored = env.execute_async(name, restore=True)
    elapsed = (time.perf_counter() - t0) * 1000
    restored.cancel()
    return elapsed


def moved_key_groups(before: list[str], after: list[str]) -> list[int]:
    return [kg for kg, (a, b) in enumerate(zip(before, after)) if a != b]


def logical_bytes(state: pa.Table, kgs: list[int], max_parallelism: int) -> int:
    """The Arrow bytes of the state rows (key and state columns) of the keys in ``kgs``."""
    owned = np.isin(key_groups_of(state.column("key"), max_parallelism), kgs)
    rows = state.filter(pa.array(owned))
    return int(rows.drop_columns(["key_group"]).nbytes if "key_group" in rows.column_names else rows.nbytes)


def plot(added, removed, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 3.8))
    for report, marker, label in (
        (added, "o", "2 -> 3 (add a node)"),
        (removed, "s", "3 -> 2 (remove a node)"),
    ):
        line = ax.plot(range(len(report.step_ms)), report.step_ms, marker + "-", label=f"{label}: refused")[0]
        if report.precopy_ms:
            ax.plot(
                range(len(report.precopy_ms)),
                report.precopy_ms,
                marker + ":",
                color=line.get_color(),
                alpha=0.6,
                label=f"{label}: pre-copy (rows taken)",
            )
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("move (one routing version: at most 8 key groups, about 4 MB of state)")
    ax.set_ylabel("ms (log)")
    ax.set_title("key-group handoff, steady W1 load: each move's pre-copy, then its refusal")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def state_of(client) -> pa.Table | None:
    """The job's keyed state over all nodes; None while a busy key group could not be read (at
    1 GB, a read of 200 k keys a key group can lose to the writer: it is tried again)."""
    try:
        return client.query_state("sum")
    except flight.FlightError:
        return None


def counts(table: pa.Table | None) -> dict[int, int]:
    if table is None:
        return {}
    keys = table.column("key").to_numpy()
    ones = table.column("sum(f1)").to_numpy()  # the rolling sum of the ones: events per key
    return dict(zip(keys.tolist(), ones.tolist()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keys", type=int, default=500_000)
    parser.add_argument("--events", type=int, default=3_000_000)
    parser.add_argument("--plot", default=None, help="save the handoff steps' plot here")
    cluster_scaleout.add_arguments(parser)
    parser.add_argument("--scaleout-only", action="store_true", help="no node changes, only scale-out")
    parser.add_argument("--skip-stage", action="store_true", help="leave out the one-query stage's figures")
    cluster_stage.add_arguments(parser)
    parser.add_argument("--backlog", action="store_true", help="add a node change under a backlog")
    parser.add_argument("--backlog-only", action="store_true", help="only the node change under a backlog")
    cluster_backlog.add_arguments(parser)
    args = parser.parse_args()
    if args.backlog_only:
        emit(cluster_backlog.from_arguments(args), args.json)
        return
    figures = cluster_scaleout.from_arguments(args) if args.scaleout_events else {}
    if args.scaleout_only:
        emit(figures, args.json)
        return
    if args.backlog:
        figures.update(cluster_backlog.from_arguments(args))
    table = w1(args.events, args.keys)
    data = batches(table)
    expected = np.bincount(table.column("f0").to_numpy(), minlength=args.keys)

    log("single node ...")
    single = single_node_meps(data, table.num_rows)
    log("restart baseline ...")
    restart = restart_baseline_ms(data)

    log("cluster ...")
    with StretchCluster.local(nodes=2) as cluster:
        client = job().execute_async("cluster_scale", cluster=cluster)
        writer = client.writer("w1")
        half = len(data) // 2
        t0 = time.perf_counter()
        for i, b in enumerate(data[:half]):
            writer.write(b, query="w1", batch=i)
        cluster_meps = half * BATCH / (time.perf_counter() - t0) / 1e6
        state_bytes = sum(o["state_bytes"] for d in client.describe().values() for o in d["operators"])

        feeding = threading.Thread(
            target=lambda: [writer.write(b, query="w1", batch=half + i) for i, b in enumerate(data[half:])]
        )
        feeding.start()
        before = list(cluster.table.owners)
        added = cluster.add_node()
        between = list(cluster.table.owners)
        removed = cluster.remove_node("node-0")
        after = list(cluster.table.owners)
        feeding.join()
        for i in (0, half - 1, len(data) - 1):  # replays: dropped wherever their key groups are now
            writer.write(data[i], query="w1", batch=i)

        deadline = time.monotonic() + 600
        while True:
            state = state_of(client)
            got = counts(state)
            if sum(got.values()) >= table.num_rows or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        held = np.zeros(args.keys, dtype=np.int64)
        for k, c in got.items():
            held[k] = c
        client.cancel()
    mp = cluster.max_parallelism
    logical = logical_bytes(state, moved_key_groups(before, between), mp) + logical_bytes(
        state, moved_key_groups(between, after), mp
    )
    if args.plot:
        plot(added, removed, args.plot)

    steps = np.asarray(added.step_ms + removed.step_ms)
    stage = {}
    if not args.skip_stage:
        log("the one-query stage, on one node and on 2 nodes ...")
        stage = cluster_stage.from_arguments(args)
    emit(
        {
            "nodes": "2 -> 3 -> 2",
            "keys": args.keys,
            "events": args.events,
            "state_mb": round(state_bytes / 2**20, 1),
            "handoff_p50_ms": round(float(np.percentile(steps, 50)), 2),
            "handoff_p99_ms": round(float(np.percentile(steps, 99)), 2),
            "max_stall_ms": round(max(added.max_stall_ms, removed.max_stall_ms), 2),
            "precopy_p99_ms": round(float(np.percentile(added.precopy_ms + removed.precopy_ms, 99)), 2),
            "add_node_ms": round(added.elapsed_ms, 1),
            "remove_node_ms": round(removed.elapsed_ms, 1),
            "moved_fraction": round(added.key_groups_moved / cluster.max_parallelism, 4),
            "bytes_moved_add": added.bytes_moved,
            "bytes_moved_remove": removed.bytes_moved,
            "bytes_moved_ratio": round((added.bytes_moved + removed.bytes_moved) / max(1, logical), 3),
            "restart_baseline_ms": round(restart, 1),
            "lost": int(np.clip(expected - held, 0, None).sum()),
            "duplicated": int(np.clip(held - expected, 0, None).sum()),
            "cluster_meps": round(cluster_meps, 3),
            "single_node_meps": round(single, 3),
            **figures,
            **stage,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
