"""Event-time windows on a local cluster: W2 on 2 nodes beside one node, and a node handoff with
windows open.

    python experiments/cluster_windows.py --json [--events 2000000 --repeats 3]

The job is windows.py's W2 job (10 ms tumbling windows, count and sum per key, watermarks bounded
at 50 ms, vectorized ``aggregate``) on ``StretchCluster.local(nodes=--nodes)`` at ``--parallelism``
per node, fed by one ClusterWriter (this process, W2 batches as named micro-batches); its peer is
the same job on one node engine at as many instances (``nodes x parallelism``), fed through
``channels.open_writer``, in the same run. Reported, medians over ``--repeats``:

- ``cluster_window_meps`` against ``single_node_window_meps`` (``cluster_vs_single``): W2's
  ``--events``, timed from the first batch written (the job started and settled) until every
  window result is out (the channel ended: the windows the bound still held open fire too). Both
  must emit every (key, window) of the data once, or the run stops.
- ``cluster_window_p99_latency_ms`` beside ``single_node_window_p99_latency_ms`` (the ratio
  ``cluster_window_p99_vs_single``, target <= 2), p50s too: input paced at event-time speed (1 M
  events/s, a batch every 10 ms), from the moment the batch whose watermark passes a window's end
  is written to the moment that window's last result (of any node) is read from the job's output
  channel, over the windows after ``--latency-warmup`` seconds (windows.py's
  ``window_p99_latency_ms``), each job started and settled for 2 s first, on both measured alike.
- ``max_stall_ms`` of ``cluster.add_node()`` (2 -> 3 nodes) while every window is open: W2-shaped
  data of ``--handoff-events`` over ``--handoff-keys`` with event times squeezed into 40 ms, so no
  window fires before the channel ends; 90 % of it is written and processed, then the last 10 %
  is written while the node joins. Also ``handoff_elapsed_ms``, ``handoff_step_p99_ms`` (one
  step's move), ``handoff_bytes_moved``, ``handoff_moved_fraction``, and the window state on the
  2 nodes before: ``handoff_state_mb`` (the memory its arenas occupy, as cluster_scale.py's
  ``state_mb``; they grow by doubling) and ``handoff_state_logical_mb`` (its bytes as a handoff
  ships them: ``bytes_moved`` over the moved fraction). Afterwards every window must fire once
  (the run stops otherwise). Target: ``max_stall_ms`` <= 100 at 1 GB of state.

The handoff's state grows with its (key, window) pairs, about 210 bytes each as shipped: keep
``--handoff-events`` at 4x ``--handoff-keys`` (each key in about 2.5 of the 4 windows). The
defaults (500k keys, 2M events) hold about 0.25 GB logical (0.5 GB of memory); about 1 GB logical:
``--handoff-keys 2000000 --handoff-events 8000000`` (2.1 GB of memory; a minute, most of it
writing), with ``--handoff-only`` to leave out the other figures. A handoff step moves about 4 MB
or at least one key group, so ``max_stall_ms`` is about one key group's move: a larger state wants
finer key groups, ``--max-parallelism`` (default 128, the cluster's and the job's).
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time

import numpy as np
import pyarrow as pa
from _common import emit, log, median
from cluster_scaleout import SETTLE, processed
from windows import BATCH, BOUND, W2_TYPE, WINDOW, strategy, stretch_job, w2

from stretch import channels
from stretch.cluster import StretchCluster
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream import aggregates as A
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.window import TumblingEventTimeWindows
from stretch.runtime.state_dir import job_dir

SPAN = 4 * WINDOW  # the handoff's event times: 40 ms, under the 50 ms bound, so no window closes


def window_env(parallelism: int, sink=None, max_parallelism: int = 128) -> StreamExecutionEnvironment:
    """windows.py's vector W2 job, to run on a cluster (windows.stretch_job runs it on one engine)."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.set_max_parallelism(max_parallelism)
    env.from_source(ChannelSource("w2", W2_TYPE, durable=False), strategy(), "w2").key_by("f0").window(
        TumblingEventTimeWindows(WINDOW)
    ).aggregate([A.count(), A.sum("f2")]).name("windows").sink_to(sink or DiscardingSink())
    return env


def window_count(data: pa.Table) -> int:
    """The (key, window) pairs of the data: the results every run must emit, each once."""
    keys, ts = data["f0"].to_numpy(), data["f1"].to_numpy()
    return len(np.unique(ts // WINDOW * (int(keys.max()) + 1) + keys))


def fired(client) -> int:
    """Window results out so far, over every node of a cluster job."""
    return sum(
        o["records_out"] for d in client.describe().values() for o in d["operators"] if o["name"] == "windows"
    )


def single_run(data: list[pa.RecordBatch], parallelism: int) -> tuple[float, int]:
    """(seconds from the first batch written to the last result out, results) on one engine."""
    client, writer = stretch_job("vector", parallelism)
    time.sleep(SETTLE)  # as for the cluster: spare workers finish starting first
    t0 = time.monotonic()
    for b in data:
        writer.write(b)
    writer.end()
    client.wait()
    return client._coordinator.output_complete_at - t0, client.describe()["operators"][0]["records_out"]


def cluster_run(
    cluster, name: str, data: list[pa.RecordBatch], parallelism: int, expected: int
) -> tuple[float, int]:
    """The same on the cluster: the results counted from every node's ``describe`` every 20 ms."""
    client = window_env(parallelism, None, cluster.max_parallelism).execute_async(name, cluster=cluster)
    writer = client.writer("w2")
    time.sleep(SETTLE)
    t0 = time.monotonic()
    for i, b in enumerate(data):
        writer.write(b, query="w2", batch=i)
    writer.close()
    client.end("w2")
    deadline = t0 + 600
    while fired(client) < expected and time.monotonic() < deadline:
        time.sleep(0.02)
    elapsed = time.monotonic() - t0
    client.wait()
    return elapsed, fired(client)


def single_latency_job(parallelism: int):
    """The latency job on one engine: (write(i, batch), end(), wait(), readers of its output)."""
    client, writer = stretch_job("vector", parallelism, ChannelSink("out"))
    return lambda i, b: writer.write(b), writer.end, client.wait, [channels.open_reader(client, "out")]


def cluster_latency_job(cluster, name: str, parallelism: int):
    """The same on the cluster: a reader of each node's output."""
    env = window_env(parallelism, ChannelSink("out"), cluster.max_parallelism)
    client = env.execute_async(name, cluster=cluster)
    writer = client.writer("w2")

    def end():
        writer.close()
        client.end("w2")

    readers = [channels.open_reader(f"{name}@{node}", "out") for node in cluster.nodes]
    return lambda i, b: writer.write(b, query="w2", batch=i), end, client.wait, readers


def paced_latency(job, seconds: float, keys: int, warmup: float) -> list[float]:
    """Per-window latency (ms) as windows.window_latencies measures it, the input paced at event-time
    speed, for ``job`` (single_latency_job or cluster_latency_job), started and settled first."""
    write, end_input, wait, readers = job
    data = w2(int(seconds * 1_000_000), keys, seed=3)
    time.sleep(SETTLE)
    arrivals: list[tuple[float, np.ndarray]] = []

    def read(reader):
        while (b := reader.read_batch()) is not None:
            arrivals.append((time.monotonic(), b.column("window_end").to_numpy()))

    threads = [threading.Thread(target=read, args=(r,), daemon=True) for r in readers]
    for t in threads:
        t.start()
    marks, written = [], []  # the watermark after each batch, when the batch was written
    max_ts = -(2**62)
    start = time.monotonic()
    for i, b in enumerate(data.to_batches(max_chunksize=WINDOW)):  # 10 ms of events every 10 ms
        time.sleep(max(0.0, start + i * 0.01 - time.monotonic()))
        write(i, b)
        max_ts = max(max_ts, int(b.column("f1").to_numpy().max()))
        marks.append(max_ts - BOUND - 1)
        written.append(time.monotonic())
    time.sleep(0.5)  # results of the windows the last watermark closed
    end_input()
    for t in threads:
        t.join(60)
    wait()
    for r in readers:
        r.close()
    done: dict[int, float] = {}  # window end -> when its last result, of any instance or node, was read
    for at, ends in arrivals:
        for end in np.unique(ends).tolist():
            done[end] = max(at, done.get(end, 0.0))
    latencies = []
    for end, at in done.items():
        i = int(np.searchsorted(marks, end - 1))  # the first batch whose watermark passed the end
        if end > warmup * 1_000_000 and i < len(marks):
            latencies.append((at - written[i]) * 1000)
    return latencies


def p99(latencies: list[float], q: float = 99) -> float:
    return float(np.percentile(latencies, q))


def window_figures(args) -> dict:
    """Throughput and latency, cluster beside one engine, runs alternating, medians."""
    table = w2(args.events, args.keys)
    expected = window_count(table)
    data = table.to_batches(max_chunksize=BATCH)
    instances = args.nodes * args.parallelism
    single, multi, lat = [], [], {"cluster": [], "single": []}
    paced = (args.latency_seconds, args.keys, args.latency_warmup)
    with StretchCluster.local(nodes=args.nodes, max_parallelism=args.max_parallelism) as cluster:
        for r in range(args.repeats):
            log(f"windows, repeat {r + 1} of {args.repeats}: one node, {args.nodes} nodes, latency ...")
            s, one = single_run(data, instances)
            c, many = cluster_run(cluster, f"cluster-windows-run-{r}", data, args.parallelism, expected)
            if one != expected or many != expected:
                raise SystemExit(f"window results: {expected} expected, one node {one}, cluster {many}")
            single.append(s)
            multi.append(c)
            lat["single"].append(paced_latency(single_latency_job(instances), *paced))
            job = cluster_latency_job(cluster, f"cluster-windows-latency-{r}", args.parallelism)
            lat["cluster"].append(paced_latency(job, *paced))
        logs = job_logs(cluster)
    for path in logs:  # the output logs this run left: ours, not kept for a later one
        shutil.rmtree(path, ignore_errors=True)
    single_meps = [args.events / s / 1e6 for s in single]
    cluster_meps = [args.events / c / 1e6 for c in multi]
    c99, s99 = [p99(x) for x in lat["cluster"]], [p99(x) for x in lat["single"]]
    return {
        "nodes": args.nodes,
        "parallelism_per_node": args.parallelism,
        "events": args.events,
        "keys": args.keys,
        "window_results": expected,
        "repeats": args.repeats,
        "cluster_window_meps": round(median(cluster_meps), 3),
        "single_node_window_meps": round(median(single_meps), 3),
        "cluster_vs_single": round(median([c / s for c, s in zip(cluster_meps, single_meps)]), 3),
        "cluster_window_p50_latency_ms": round(median([p99(x, 50) for x in lat["cluster"]]), 2),
        "cluster_window_p99_latency_ms": round(median(c99), 2),
        "single_node_window_p50_latency_ms": round(median([p99(x, 50) for x in lat["single"]]), 2),
        "single_node_window_p99_latency_ms": round(median(s99), 2),
        "cluster_window_p99_vs_single": round(median([c / s for c, s in zip(c99, s99)]), 3),
        "windows_measured": min(len(x) for x in lat["cluster"] + lat["single"]),
        "runs": {
            "cluster_meps": [round(x, 3) for x in cluster_meps],
            "single_node_meps": [round(x, 3) for x in single_meps],
            "cluster_p99_ms": [round(x, 2) for x in c99],
            "single_node_p99_ms": [round(x, 2) for x in s99],
        },
    }


def job_logs(cluster) -> list:
    """The directories of the cluster's jobs on its nodes (``<job>@<node>``: their output logs)."""
    return [job_dir(f"{job}@{node}") for job, e in cluster.connection.jobs().items() for node in e["nodes"]]


def handoff(keys: int, events: int, parallelism: int, max_parallelism: int) -> dict:
    """A node added (2 -> 3) while every window of the job is open; see the module's docstring."""
    data = w2(events, keys, seed=5)
    data = data.set_column(1, "f1", pa.array(data["f1"].to_numpy() * SPAN // events))
    expected = window_count(data)
    batches = data.to_batches(max_chunksize=BATCH)
    cut = max(1, len(batches) * 9 // 10)
    log(f"handoff: {events} events over {keys} keys ...")
    with StretchCluster.local(nodes=2, max_parallelism=max_parallelism) as cluster:
        env = window_env(parallelism, max_parallelism=max_parallelism)
        client = env.execute_async("cluster-windows-handoff", cluster=cluster)
        writer = client.writer("w2")
        for i, b in enumerate(batches[:cut]):
            writer.write(b, query="w2", batch=i)
        rows = sum(b.num_rows for b in batches[:cut])
        while sum(processed(d, "windows") for d in client.describe().values()) < rows:
            time.sleep(0.05)
        state = sum(o["state_bytes"] for d in client.describe().values() for o in d["operators"])
        log(f"handoff: {state / 2**20:.0f} MB of window state, adding a node ...")
        rest = list(enumerate(batches[cut:], start=cut))
        feeding = threading.Thread(target=lambda: [writer.write(b, query="w2", batch=i) for i, b in rest])
        feeding.start()
        report = cluster.add_node()
        feeding.join()
        writer.close()
        client.end("w2")
        client.wait()
        got = fired(client)
        logs = job_logs(cluster)
    for path in logs:
        shutil.rmtree(path, ignore_errors=True)
    if got != expected:
        raise SystemExit(f"handoff: {expected} window results expected, {got} fired")
    moved = max(1, report.key_groups_moved) / max_parallelism
    return {
        "handoff_keys": keys,
        "handoff_events": events,
        "handoff_state_mb": round(state / 2**20, 1),
        "handoff_state_logical_mb": round(report.bytes_moved / moved / 2**20, 1),
        "max_stall_ms": round(report.max_stall_ms, 2),
        "handoff_elapsed_ms": round(report.elapsed_ms, 1),
        "handoff_step_p99_ms": round(p99(list(report.step_ms)), 2) if report.step_ms else None,
        "handoff_steps": report.steps,
        "handoff_bytes_moved": report.bytes_moved,
        "handoff_moved_fraction": round(moved, 4),
        "handoff_window_results": got,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--parallelism", type=int, default=1, help="per node (one node: nodes x this)")
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--latency-seconds", type=float, default=4.0)
    ap.add_argument("--latency-warmup", type=float, default=1.0)
    ap.add_argument("--handoff-keys", type=int, default=500_000)
    ap.add_argument("--handoff-events", type=int, default=2_000_000)
    ap.add_argument("--max-parallelism", type=int, default=128, help="key groups, of the cluster and job")
    ap.add_argument("--handoff-only", action="store_true", help="only the handoff's figures")
    args = ap.parse_args()
    result = {} if args.handoff_only else window_figures(args)
    result.update(handoff(args.handoff_keys, args.handoff_events, args.parallelism, args.max_parallelism))
    emit(result, args.json)


if __name__ == "__main__":
    main()
