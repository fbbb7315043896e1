"""Live rescale under steady W1 load and under a backlog, beside stop-and-restart baselines.

    python experiments/rescale.py --json              # both scenarios
    python experiments/rescale.py --json --only backlog

Steady: a rolling count+sum over W1 events (vectorized ``sum``) runs under a steady input rate
while the schedule 1->2->4->8->4->2->1 repeats ``--rounds`` times, once with about 1 MB of keyed
state and once with about 1 GB. Backlog: a per-record KeyedProcessFunction falls behind a source
that writes as fast as its gate takes it (``backlog.py``; seconds of work are left at every
rescale), and ``--backlog-rescales`` rescales 1->2->4->2->1... are made, 400 ms apart; the rate
200 ms after each 1->2 step is compared with the rate 200 ms before. The rescales are timed again
with the source's batches 16x as large (65 k rows). Two ceilings of the scale-up ratio are
measured in the same run: a plain Python loop of the operator in two processes over one, and two
separate parallelism-1 jobs of the operator run together over one alone. Each rescale is timed by
``JobClient.rescale`` (the call until every instance processes under the new epoch). A sampler
records throughput and the queueing latency of the input for the PNG timeline. In the same run,
the baselines rescale the way Flink and Spark do: snapshot the state, stop the job, start it at
the new parallelism and load the state back (under the backlog: a checkpoint, whose barrier
waits behind what is queued, then a restore), timed end to end.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from _common import OUT, emit, log, plain_loop_scaling
from backlog import OPERATOR, Progress, flat_out_job

from stretch import channels
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.runtime import control_block as cbk
from stretch.state import _table_kernels as K
from stretch.state.key_groups import key_groups_of
from stretch.state.keyed_table import KeyedTable, KeyMode

W1 = Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])
SCHEDULE = [2, 4, 8, 4, 2, 1]
LARGE_BATCH = 65536  # the backlog again in batches as large as Arrow readers hand out
RECORD_ENTRY = {
    "name": "rolling sum",
    "kind": "record",
    "storage": "words",
    "type": None,
    "fields": [{"name": "f1", "float": False, "acc": True}, {"name": "f2", "float": True, "acc": True}],
}


def start_job(parallelism: int):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.engine_config.spare_workers = 8  # the warm pool covers the largest step of the schedule
    env.from_source(ChannelSource("w1", W1, durable=False), None, "w1").key_by(0).sum([1, 2]).name(
        "sum"
    ).sink_to(DiscardingSink())
    client = env.execute_async(f"rescale p{parallelism}")
    return client, channels.open_writer(client, "w1")


def w1_batch(keys: np.ndarray) -> pa.RecordBatch:
    n = len(keys)
    return pa.record_batch({"f0": keys, "f1": np.ones(n, np.int64), "f2": np.full(n, 0.5)})


def populate(client, writer, distinct: int) -> None:
    """Give every key its state once, as fast as the job takes it."""
    for start in range(0, distinct, 1 << 16):
        writer.write(w1_batch(np.arange(start, min(start + (1 << 16), distinct), dtype=np.int64)))
    wait_processed(client, distinct)


def processed(client) -> int:
    return client.describe()["operators"][0]["records_in"]


def wait_processed(client, n: int) -> None:
    while processed(client) < n:
        time.sleep(0.01)


class Load(threading.Thread):
    """Writes W1 batches at a steady rate; remembers when each gate position was written."""

    def __init__(self, writer, distinct: int, rate: float, batch_rows: int = 8192):
        super().__init__(daemon=True)
        self.writer, self.distinct, self.rate, self.rows = writer, distinct, rate, batch_rows
        self.stop = threading.Event()
        self.written: list[tuple[float, int]] = []  # (time, gate tail after the write)
        self.rng = np.random.default_rng(3)

    def run(self) -> None:
        t0 = time.monotonic()
        sent = 0
        gate = self.writer._gate
        while not self.stop.is_set():
            self.writer.write(w1_batch(self.rng.integers(0, self.distinct, self.rows)))
            sent += self.rows
            self.written.append((time.monotonic(), gate.tail))
            ahead = sent / self.rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)


class Sampler(threading.Thread):
    """Samples the operator's progress every millisecond (throughput and queueing latency)."""

    def __init__(self, client, operator: str = "sum"):
        super().__init__(daemon=True)
        c = client._coordinator
        self.stage = c.plan.stage(operator)
        self.c = c
        self.op = c.resources.keyed_index[self.stage.id]
        self.stop = threading.Event()
        self.samples: list[tuple[float, int, int]] = []  # (time, records processed, min gate position)

    def run(self) -> None:
        while not self.stop.is_set():
            p = self.c._parallelism[self.stage.id]
            inst = self.c.control.instances(self.op)  # every instance slot ever used keeps its count
            done = int(inst[:, cbk.I_RECORDS_IN].sum())
            self.samples.append((time.monotonic(), done, int(inst[:p, cbk.I_GATE_SEQ].min())))
            time.sleep(0.001)


def stop_run(load: Load, sampler: Sampler, writer, client) -> None:
    """End the steady load, the sampler and the job."""
    load.stop.set()
    load.join()
    sampler.stop.set()
    sampler.join()
    writer.end()
    client.wait()


def latencies(written, samples) -> list[tuple[float, float]]:
    """(write time, ms until every instance had read past that write) for each write."""
    out, j = [], 0
    for t, seq in written:
        while j < len(samples) and (samples[j][0] < t or samples[j][2] < seq):
            j += 1
        if j == len(samples):
            break
        out.append((t, (samples[j][0] - t) * 1000))
    return out


def capacity(client, writer, distinct: int, events: int = 2_000_000) -> float:
    """Events per second the job takes at its current parallelism (W1 keys over its state)."""
    rng = np.random.default_rng(5)
    before = processed(client)
    t0 = time.monotonic()
    for _ in range(0, events, 1 << 16):
        writer.write(w1_batch(rng.integers(0, distinct, 1 << 16)))
    wait_processed(client, before + events)
    return events / (time.monotonic() - t0)


def calibrate(distinct: int) -> float:
    """The parallelism-1 capacity with this much state (a fresh job, then stopped)."""
    client, writer = start_job(1)
    populate(client, writer, distinct)
    cap = capacity(client, writer, distinct)
    writer.end()
    client.wait()
    return cap


def live_case(distinct: int, rounds: int, rate: float) -> dict:
    client, writer = start_job(1)
    populate(client, writer, distinct)
    state = client.describe()["operators"][0]["state_bytes"]
    time.sleep(3.0)  # let the idle spare workers map the new state into their page tables (warm pool)
    load, sampler = Load(writer, distinct, rate), Sampler(client)
    sampler.start()
    load.start()
    time.sleep(0.5)
    reports, non_gaining_stalls, marks = [], [], []
    c = client._coordinator
    op = c.resources.keyed_index[c.plan.stage("sum").id]
    for _ in range(rounds):
        for p in SCHEDULE:
            t = time.monotonic()
            report = client.rescale("sum", p)
            time.sleep(0.005)
            inst = c.control.instances(op)[: max(report.old_parallelism, p)]
            non_gaining_stalls += [
                int(s) / 1e6
                for s, g in zip(inst[:, cbk.I_LAST_STALL_NS], inst[:, cbk.I_LAST_GAINED])
                if not g
            ]
            reports.append(report)
            marks.append((t, p))
            time.sleep(0.1)
    time.sleep(0.3)
    stop_run(load, sampler, writer, client)
    elapsed = sorted(r.elapsed_ms for r in reports)
    return {
        "state_bytes": state,
        "elapsed_ms": elapsed,
        "copied": sum(r.state_bytes_copied for r in reports),
        "max_stall_ms_non_gaining": max(non_gaining_stalls, default=0.0),
        "timeline": (sampler.samples, latencies(load.written, sampler.samples), marks),
    }


BACKLOG_SCHEDULE = [2, 4, 2, 1]


def backlog_case(rescales: int, min_work_s: float = 2.0, batch_rows: int = 4096) -> dict:
    """The operator far behind its input (``backlog.flat_out_job``, batches of ``batch_rows``):
    ``rescales`` live rescales 1->2->4->2->1..., 400 ms apart, each timed from the call until
    every instance runs the new epoch; the rate 200 ms before and after each 1->2 step; the work
    left at each rescale."""
    rate_p1 = 1_100_000  # a first guess of the p=1 rate, for the size of the input
    events = int(rate_p1 * (3 + rescales * 0.4 * 1.5 + 3 * min_work_s))
    client = flat_out_job(f"rescale backlog {batch_rows}", 1, events, batch_rows=batch_rows)
    progress = Progress(client)
    progress.start()
    time.sleep(1.5)  # the gate fills; spare workers settle
    reports, steps, work_left, spans = [], [], [], []
    for i in range(rescales):
        p = BACKLOG_SCHEDULE[i % len(BACKLOG_SCHEDULE)]
        now = time.monotonic()
        work_left.append((events - progress.processed()) / max(progress.rate(now - 0.4, now), 1.0))
        if spans:  # the previous parallelism, from 200 ms after its rescale to this one
            spans[-1] = (*spans[-1][:2], now)
        report = client.rescale(OPERATOR, p)
        reports.append(report)
        done = now + report.elapsed_ms / 1000
        spans.append((p, done + 0.2, None))
        if (report.old_parallelism, p) == (1, 2):
            steps.append((now, done))
        time.sleep(0.4)
    progress.stop.set()
    progress.join()
    client.cancel()
    ratios = [progress.rate(done, done + 0.2) / max(progress.rate(t - 0.2, t), 1.0) for t, done in steps]
    settled = {
        p: float(np.median([progress.rate(a, b) for q, a, b in spans if q == p and b])) for p in (1, 2)
    }
    return {
        "elapsed_ms": sorted(r.elapsed_ms for r in reports),
        "queued": [r.queued for r in reports],
        "copied": sum(r.state_bytes_copied for r in reports),
        "min_work_left_s": min(work_left),
        "scaleup_ratios": ratios,
        "settled_p2_over_p1": settled[2] / max(settled[1], 1.0),
        "timeline": (progress.samples, [(t, p) for (t, _), p in zip(steps, [2] * len(steps))]),
    }


def neighbour_bound(repeats: int = 3, seconds: float = 2.0) -> dict:
    """What a second core gives the backlog's operator here with nothing shared between its two
    instances: two separate parallelism-1 jobs, each behind its own flat-out source, run together,
    against one alone (the same operator and input). Their summed rate over the single one bounds
    ``settled_p2_over_p1`` and the scale-up ratio: it counts what the machine takes (a core's
    neighbour, the two sources, the coordinators), none of what sharing a gate and a state costs.
    Medians over ``repeats`` pairs."""

    def rate(jobs: int, run: int) -> float:
        clients = [flat_out_job(f"neighbour {run} {i} of {jobs}", 1, 50_000_000) for i in range(jobs)]
        progress = [Progress(c) for c in clients]
        for p in progress:
            p.start()
        time.sleep(1.5)  # the gates fill
        t0 = time.monotonic()
        time.sleep(seconds)
        rates = [p.rate(t0, t0 + seconds) for p in progress]
        for p, c in zip(progress, clients):
            p.stop.set()
            p.join()
            c.cancel()
        return sum(rates)

    pairs = [(rate(1, r), rate(2, r)) for r in range(repeats)]
    return {
        "one_job_p1_meps": round(float(np.median([a for a, _ in pairs])) / 1e6, 3),
        "two_jobs_p1_meps": round(float(np.median([b for _, b in pairs])) / 1e6, 3),
        "two_jobs_over_one": round(float(np.median([b / a for a, b in pairs])), 2),
    }


def backlog_baseline() -> float:
    """The same operator behind the same input, rescaled 1 -> 2 as Flink and Spark do: checkpoint
    (its barrier waits behind what is queued), stop, restore at 2; milliseconds until the restored
    job processes again."""
    name = f"rescale backlog baseline {os.getpid()} {time.monotonic_ns()}"
    client = flat_out_job(name, 1, 50_000_000, checkpointing=True)
    time.sleep(1.5)
    t0 = time.monotonic()
    client.trigger_checkpoint()
    client.cancel()
    client.wait()
    client2 = flat_out_job(name, 2, 50_000_000, checkpointing=True, restore=True)
    progress = Progress(client2)
    before = progress.processed()
    while progress.processed() <= before:
        time.sleep(0.001)
    ms = (time.monotonic() - t0) * 1000
    client2.cancel()
    return ms


def baseline_case(distinct: int, old: int, new: int, workdir: str) -> float:
    """Snapshot to a file, stop, restart at the new parallelism, load the state: milliseconds."""
    client, writer = start_job(old)
    populate(client, writer, distinct)
    t0 = time.monotonic()
    snapshot = client.query_state("sum")  # stop-with-savepoint: the whole state ...
    path = os.path.join(workdir, "savepoint.arrow")
    with open(path, "wb") as f, ipc.new_file(f, snapshot.schema) as out:  # ... written durably
        out.write_table(snapshot)
        f.flush()
        os.fsync(f.fileno())
    writer.end()
    client.wait()  # stopped
    client2, writer2 = start_job(new)  # restarted at the new parallelism
    restored = ipc.open_file(path).read_all()
    c = client2._coordinator
    table = KeyedTable(c.arenas[c.plan.stage("sum").id])
    sid = table.arena.register_state(RECORD_ENTRY)
    keys = restored.column("key").to_numpy()
    kgs = key_groups_of(keys, table.maxp)
    rows = table.rows(kgs, keys, KeyMode.INT64)
    table.ensure_columns(sid, np.unique(kgs), 16)
    vals = np.stack(
        [restored.column("sum(f1)").to_numpy(), restored.column("sum(f2)").to_numpy().view(np.int64)]
    )
    K.rolling_records(
        table.arena.a64,
        table.arena.a8,
        table.arena.views[np.dtype(np.float64)][0],
        table.arena.state_base_w(sid),
        kgs,
        rows,
        vals,
        np.array([False, True]),
        np.array([True, True]),
        0,
        np.empty_like(vals),
    )
    ms = (time.monotonic() - t0) * 1000
    writer2.end()
    client2.wait()
    return ms


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def plot(small: dict, large: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 6), sharex="col")
    for col, (label, case) in enumerate((("~1 MB state", small), ("~1 GB state", large))):
        samples, lat, marks = case["timeline"]
        t0 = samples[0][0]
        ts = np.array([s[0] - t0 for s in samples])
        done = np.array([s[1] for s in samples], dtype=float)
        window = 50
        rate = (done[window:] - done[:-window]) / (ts[window:] - ts[:-window]) / 1e6
        axes[0, col].plot(ts[window:], rate, lw=0.8)
        axes[0, col].set_ylabel("throughput (M events/s)")
        axes[0, col].set_title(
            f"{label}: {len(case['elapsed_ms'])} live rescales, p99 {pct(case['elapsed_ms'], 99):.1f} ms"
        )
        axes[1, col].plot([t - t0 for t, _ in lat], [ms for _, ms in lat], lw=0.6)
        axes[1, col].set_ylabel("queueing latency (ms)")
        axes[1, col].set_yscale("log")
        axes[1, col].set_xlabel("time (s)")
        for t, p in marks:
            for ax in axes[:, col]:
                ax.axvline(t - t0, color="red", lw=0.4, alpha=0.5)
            axes[0, col].text(t - t0, axes[0, col].get_ylim()[1], str(p), fontsize=6, color="red", va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_backlog(case: dict, path) -> None:
    """Throughput and parallelism over time while the operator is behind its input."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, _ = case["timeline"]
    t0 = samples[0][0]
    ts = np.array([s[0] - t0 for s in samples])
    done = np.array([s[1] for s in samples], dtype=float)
    window = 50
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    ax.plot(ts[window:], (done[window:] - done[:-window]) / (ts[window:] - ts[:-window]) / 1e6, lw=0.7)
    ax.set_ylabel("throughput (M events/s)")
    ax.set_title(
        f"behind a full gate: {len(case['elapsed_ms'])} live rescales, p99 {pct(case['elapsed_ms'], 99):.1f} ms"
    )
    bx.step(ts, [s[2] for s in samples], where="post", lw=0.8)
    bx.set_ylabel("parallelism")
    bx.set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=10, help="repeats of 1->2->4->8->4->2->1")
    ap.add_argument(
        "--load",
        type=float,
        default=0.35,
        help="steady input as a fraction of the p=1 capacity with large state",
    )
    ap.add_argument("--small-keys", type=int, default=30_000, help="keys for ~1 MB of state")
    ap.add_argument("--large-keys", type=int, default=30_000_000, help="keys for ~1 GB of state")
    ap.add_argument("--backlog-rescales", type=int, default=60, help="rescales with the operator behind")
    ap.add_argument("--only", choices=("steady", "backlog"), help="run one scenario")
    ap.add_argument("--plot", default=str(OUT / "rescale.png"))
    args = ap.parse_args()
    result = {}
    if args.only != "steady":
        result.update(backlog_result(args.backlog_rescales))
    if args.only != "backlog":
        result.update(steady_result(args))
    emit(result, args.json)


def backlog_result(rescales: int) -> dict:
    log(f"live rescale under a backlog, {rescales} rescales")
    behind = backlog_case(rescales)
    log(f"the same, in batches of {LARGE_BATCH} rows")
    large = backlog_case(rescales, batch_rows=LARGE_BATCH)["elapsed_ms"]
    log("baseline under a backlog")
    base = [backlog_baseline() for _ in range(3)]
    log("the machine's own scaling: a plain Python loop of the operator in one and two processes")
    ceiling = plain_loop_scaling()
    log("the operator's own bound: two separate parallelism-1 jobs together, over one alone")
    neighbour = neighbour_bound()
    OUT.mkdir(exist_ok=True)
    path = OUT / "rescale_backlog.png"
    plot_backlog(behind, path)
    result = {
        "rescale_backlog_p50_ms": round(pct(behind["elapsed_ms"], 50), 2),
        "rescale_backlog_p99_ms": round(pct(behind["elapsed_ms"], 99), 2),
        "rescale_backlog_max_ms": round(max(behind["elapsed_ms"]), 2),
        "rescale_backlog_large_batches_p50_ms": round(pct(large, 50), 2),
        "rescale_backlog_large_batches_p99_ms": round(pct(large, 99), 2),
        "rescales_backlog": len(behind["elapsed_ms"]),
        "backlog_min_work_left_s": round(behind["min_work_left_s"], 2),
        "backlog_queued_p50": int(np.median(behind["queued"])),
        "throughput_after_scaleup_ratio": round(float(np.median(behind["scaleup_ratios"])), 2),
        "throughput_after_scaleup_ratio_min": round(min(behind["scaleup_ratios"]), 2),
        # the most that ratio can be here: parallelism 2 over 1, each settled (200 ms on) before the
        # next rescale, on the same cores in the same run
        "settled_p2_over_p1": round(behind["settled_p2_over_p1"], 2),
        # the ceiling of both on this machine now: a plain loop of the operator, in two processes
        # over one (two vCPUs may share a physical core)
        **ceiling,
        # the same operator's bound with nothing shared: two jobs of one instance each, together
        **neighbour,
        "baseline_backlog_p50_ms": round(float(np.median(base)), 1),
        "backlog_state_bytes_copied": behind["copied"],
        "backlog_plot": str(path),
    }
    result["scaleup_ratio_of_plain_loop_ratio"] = round(
        result["throughput_after_scaleup_ratio"] / ceiling["plain_loop_p2_over_p1"], 2
    )
    result["scaleup_ratio_of_two_jobs_ratio"] = round(
        result["throughput_after_scaleup_ratio"] / neighbour["two_jobs_over_one"], 2
    )
    result["baseline_vs_live_backlog"] = round(
        result["baseline_backlog_p50_ms"] / result["rescale_backlog_p50_ms"], 1
    )
    return result


def steady_result(args) -> dict:
    # One steady rate for both cases, one the job sustains at parallelism 1 even with the large
    # state: otherwise a backlog builds at p=1 and every marker waits behind it.
    log("capacity at parallelism 1, large state")
    cap_large = calibrate(args.large_keys)
    rate = args.load * cap_large
    log(f"live rescale, small state, {rate:,.0f} events/s")
    small = live_case(args.small_keys, args.rounds, rate)
    log("live rescale, large state")
    large = live_case(args.large_keys, args.rounds, rate)
    with tempfile.TemporaryDirectory() as workdir:
        log("baseline, small state")
        base_small = [baseline_case(args.small_keys, 1, 2, workdir) for _ in range(3)]
        log("baseline, large state")
        base_large = [baseline_case(args.large_keys, 1, 2, workdir)]
    result = {
        "rescale_p50_ms": round(pct(small["elapsed_ms"], 50), 2),
        "rescale_p99_ms": round(pct(small["elapsed_ms"], 99), 2),
        "rescale_p50_ms_large_state": round(pct(large["elapsed_ms"], 50), 2),
        "rescale_p99_ms_large_state": round(pct(large["elapsed_ms"], 99), 2),
        "rescales": len(small["elapsed_ms"]) + len(large["elapsed_ms"]),
        "state_bytes_copied_total": small["copied"] + large["copied"],
        "max_stall_ms_non_gaining": round(
            max(small["max_stall_ms_non_gaining"], large["max_stall_ms_non_gaining"]), 3
        ),
        "baseline_p50_ms": round(float(np.median(base_small)), 1),
        "baseline_p50_ms_large_state": round(float(np.median(base_large)), 1),
        "state_bytes_small": small["state_bytes"],
        "state_bytes_large": large["state_bytes"],
        "input_rate": round(rate),
        "capacity_p1_large_state": round(cap_large),
    }
    result["baseline_vs_live_large_state"] = round(
        result["baseline_p50_ms_large_state"] / result["rescale_p50_ms_large_state"], 1
    )
    OUT.mkdir(exist_ok=True)
    plot(small, large, args.plot)
    result["plot"] = args.plot
    return result


if __name__ == "__main__":
    main()
