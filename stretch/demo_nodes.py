"""The demo pipeline across nodes (``stretch demo --nodes N``): the same Spark query with the same
event-time job as its stage, the job on a local stretch cluster of N nodes; a node is added and
one removed live while Spark feeds it (their key groups move with their open windows). Each Spark
task's rows go to the nodes owning their key groups; the results are checked against the same
plain-Python windows as on one machine, and the plot shows each node's throughput."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from stretch.cluster import StretchCluster
from stretch.demo import (
    JOB,
    define_job,
    expected_windows,
    matches,
    prepared,
    result_windows,
    stage_query,
    summarize,
)


def run(
    nodes: int = 2,
    events: int = 2_000_000,
    files: int = 20,
    work_dir: str | None = None,
    plot: bool = True,
    verbose: bool = False,
    files_per_trigger: int = 4,
    out=print,
) -> dict:
    """Run the pipeline on a local cluster of ``nodes`` nodes; returns a summary (also printed)."""
    with prepared(events, files, work_dir, verbose, out) as (spark, work, _):
        return _pipeline(spark, work, events, nodes, files_per_trigger, plot, out)


def _pipeline(spark, work: Path, events: int, nodes: int, files_per_trigger: int, plot: bool, out) -> dict:
    with StretchCluster.local(nodes=nodes) as cluster:
        client = define_job(parallelism=1).execute_async(JOB, cluster=cluster)
        started = time.monotonic()
        query = stage_query(spark, client, work, files_per_trigger)
        out(
            f"  one Spark query: clicks -> stretch job {JOB!r} on {nodes} nodes -> Parquet; "
            "a node is added, then one removed, live"
        )
        samples, changes = _monitor(cluster, client, query, events, started, out)
        failure = query.exception()
        if failure is not None:
            raise RuntimeError(f"Spark's query failed: {failure}")
        client.end("clicks")  # the end of the input closes the windows still open
        status = client.wait()
        seconds = time.monotonic() - started
        got = result_windows(client.open_reader("per_user"))  # every node's results, removed ones' too
        streamed = {
            (r["key"], r["window_start"])
            for r in spark.read.parquet(str(work / "results" / "streamed")).collect()
        }
    want = expected_windows(work / "clicks")
    correct = matches(got, want) and streamed <= want.keys()
    finished = all(s == "FINISHED" for s in status.values())
    summary = summarize(
        out,
        events,
        got,
        seconds,
        correct,
        status="FINISHED" if finished else ", ".join(f"{n} {s}" for n, s in status.items()),
        where=f" on nodes {', '.join(status)}",
        note=f" ({len(streamed):,} of them came back through the query, the rest at the end of the input)",
        node_changes=changes,
    )
    if plot:
        path = Path.cwd() / "stretch-demo.png"
        _plot(samples, changes, path)
        out(f"  plot: {path}")
    return summary


def _monitor(cluster, client, query, events: int, started: float, out) -> tuple[list, list]:
    """Sample every node's records twice a second; add a node at a third of the input and remove
    the first one at two thirds (each in a thread, as an operator would from another process)."""
    samples = []  # (t, {node: events/s})
    changes: list[dict] = []
    last: dict[str, int] = {}
    last_t = time.monotonic()
    steps = [("add", events // 3), ("remove", 2 * events // 3)]
    changing: threading.Thread | None = None
    waiting_said = False

    def change(kind: str) -> None:
        report = cluster.add_node() if kind == "add" else cluster.remove_node(cluster.nodes[0])
        t = time.monotonic() - started  # done: a new node first starts its process, then takes its share
        changes.append({"t": round(t, 2), "kind": kind, **{k: getattr(report, k) for k in _REPORTED}})
        out(
            f"  {t:5.1f}s  {'added a node' if kind == 'add' else 'removed a node'}: "
            f"{report.key_groups_moved} key groups moved with {report.bytes_moved / 1e6:,.1f} MB of state "
            f"in {report.elapsed_ms:.0f} ms, longest stall {report.max_stall_ms:.0f} ms"
        )

    def records() -> dict[str, int]:
        return {
            n: d["operators"][0]["records_in"] for n, d in client.describe().items() if d.get("operators")
        }

    while query.isActive:
        time.sleep(0.1)
        now = time.monotonic()
        if now - last_t < 0.5:
            continue
        counts = records()
        done = sum(counts.values())
        rates = {n: max(c - last.get(n, 0), 0) / (now - last_t) for n, c in counts.items()}
        samples.append((now - started, rates))
        if done:
            out(
                f"  {now - started:5.1f}s  "
                + "  ".join(f"{n} {r:>9,.0f}/s" for n, r in sorted(rates.items()))
            )
        elif not waiting_said:  # Spark plans its first micro-batch
            out(f"  {now - started:5.1f}s  waiting for Spark's first micro-batch ...")
            waiting_said = True
        last, last_t = counts, now
        if steps and done >= steps[0][1] and (changing is None or not changing.is_alive()):
            changing = threading.Thread(target=change, args=(steps.pop(0)[0],), daemon=True)
            changing.start()
    if changing is not None:
        changing.join()
    for kind, _ in steps:  # the input outran them (a small run): made before the input ends
        change(kind)
    return samples, changes


_REPORTED = ("key_groups_moved", "bytes_moved", "elapsed_ms", "max_stall_ms")


def _plot(samples, changes, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rates, count) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    nodes = sorted({n for _, r in samples for n in r})
    t = [s[0] for s in samples]
    for node in nodes:
        rates.plot(t, [r.get(node) for _, r in samples], label=node)
    rates.set_ylabel("clicks/s into each node")
    rates.legend()
    count.step(t, [len(r) for _, r in samples], where="post")
    count.set_ylabel("nodes")
    count.set_ylim(0, max((len(r) for _, r in samples), default=1) + 1)
    count.yaxis.get_major_locator().set_params(integer=True)
    count.set_xlabel("seconds")
    for c in changes:
        for ax in (rates, count):
            ax.axvline(c["t"], color="grey", linestyle=":")
    fig.suptitle("stretch demo across nodes: Spark -> stretch cluster (node added, removed) -> Spark")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
