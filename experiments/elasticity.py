"""The elasticity controller's reaction to a load step, beside a restart-based peer.

    python experiments/elasticity.py --json

A per-record KeyedProcessFunction (``throughput.py``'s count and sum per key) runs at parallelism 1
under the default ``ThresholdPolicy`` (``--interval-ms`` between its decisions, at most
``--max-parallelism`` instances). Its input steps from ``--before`` to ``--after`` of what one
instance takes (measured first, in the same run). ``reaction_ms`` runs from the step until the
operator's throughput (over 200 ms) reaches ``--reach`` times one instance's capacity;
``rescales`` counts the controller's rescales after the step (more than one or two would be
flapping); ``settled_ratio`` is the rate the operator settled at from 2 s after the step, over one
instance's capacity (what the cores allowed beside the writer). The peer reacts the way an autoscaler that restarts the job does (Flink's adaptive
scheduler, Spark's dynamic allocation): the same decision, then a checkpoint, a stop and a
restore at the new parallelism, measured in the same run under the same backlog
(``restart_peer_reaction_ms``: the controller's decision time plus that). The plot shows
throughput, parallelism and backlog over time.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
from _common import OUT, emit, log
from backlog import KEYS, OPERATOR, W1_TYPE, Progress, flat_out_job, w1_rows
from throughput import CountSum

from stretch import channels
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.elasticity import ThresholdPolicy


class SteppedLoad(threading.Thread):
    """Writes W1 batches into the job's channel at ``rate`` events/s (which may change)."""

    def __init__(self, writer, rate: float, batch_rows: int = 2048):
        super().__init__(daemon=True)
        self.writer, self.rate, self.rows = writer, rate, batch_rows
        self.stop = threading.Event()

    def run(self) -> None:
        sent, credit_at, credit = 0, time.monotonic(), 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            credit = min(credit + (now - credit_at) * self.rate, 4 * self.rows)
            credit_at = now
            if credit < self.rows:
                time.sleep((self.rows - credit) / self.rate)
                continue
            self.writer.write(w1_rows(sent, self.rows))
            sent += self.rows
            credit -= self.rows


def capacity() -> float:
    """Events per second one instance takes, flat out (W1, the same operator)."""
    client = flat_out_job("elasticity capacity", 1, 50_000_000)
    progress = Progress(client)
    progress.start()
    time.sleep(3.0)
    now = time.monotonic()
    rate = progress.rate(now - 2.0, now)
    progress.stop.set()
    client.cancel()
    return rate


def stepped_case(cap: float, args) -> dict:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    env.enable_elasticity(
        ThresholdPolicy(),
        min_parallelism=1,
        max_parallelism=args.max_parallelism,
        interval_ms=args.interval_ms,
    )
    env.from_source(ChannelSource("w1", W1_TYPE, durable=False), None, "w1").key_by(0).process(
        CountSum(), W1_TYPE
    ).name(OPERATOR).sink_to(DiscardingSink())
    client = env.execute_async("elasticity step")
    load = SteppedLoad(channels.open_writer(client, "w1"), args.before * cap)
    progress = Progress(client)
    progress.start()
    load.start()
    time.sleep(args.settle)
    step = time.monotonic()
    load.rate = args.after * cap
    time.sleep(args.run)
    load.stop.set()
    load.join()
    progress.stop.set()
    progress.join()
    decisions = client._coordinator.controller.decisions
    client.cancel()
    samples = progress.samples
    reached = next(
        (t for t, *_ in samples if t > step + 0.2 and progress.rate(t - 0.2, t) >= args.reach * cap), None
    )
    after = [d for d in decisions if d["at"] >= step]
    return {
        "reaction_ms": (reached - step) * 1000 if reached is not None else None,
        "decided_ms": (after[0]["at"] - step) * 1000 if after else None,
        "rescales": len(after),
        "parallelism": [d["report"]["new_parallelism"] for d in after],
        # the rate the operator settled at, from 2 s after the step on, over one instance's
        "settled_ratio": progress.rate(step + 2.0, step + args.run) / cap,
        "samples": samples,
        "step": step,
    }


def restart_case(parallelism: int) -> float:
    """The peer's reconfiguration under a backlog: checkpoint, stop, restore at ``parallelism``;
    milliseconds until the restored job processes again."""
    name = f"elasticity restart {time.monotonic_ns()}"
    client = flat_out_job(name, 1, 50_000_000, checkpointing=True)
    time.sleep(1.5)
    t0 = time.monotonic()
    client.trigger_checkpoint()
    client.cancel()
    client2 = flat_out_job(name, parallelism, 50_000_000, checkpointing=True, restore=True)
    progress = Progress(client2)
    before = progress.processed()
    while progress.processed() <= before:
        time.sleep(0.001)
    ms = (time.monotonic() - t0) * 1000
    client2.cancel()
    return ms


def plot(case: dict, cap: float, args, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, step = case["samples"], case["step"]
    ts = np.array([s[0] - step for s in samples])
    done = np.array([s[1] for s in samples], dtype=float)
    w = 100
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    axes[0].plot(ts[w:], (done[w:] - done[:-w]) / (ts[w:] - ts[:-w]) / cap, lw=0.7)
    axes[0].axhline(args.reach, color="grey", lw=0.5, ls="--")
    axes[0].set_ylabel("throughput / one instance")
    reaction = case["reaction_ms"]
    axes[0].set_title(
        f"load {args.before:.0%} -> {args.after:.0%} of one instance at t=0; policy interval "
        f"{args.interval_ms} ms; reaction {reaction:.0f} ms"
        if reaction is not None
        else "no reaction"
    )
    axes[1].step(ts, [s[2] for s in samples], where="post", lw=0.8)
    axes[1].set_ylabel("parallelism")
    axes[2].plot(ts, [s[3] for s in samples], lw=0.7)
    axes[2].set_ylabel("backlog (gate entries)")
    axes[2].set_xlabel("time since the load step (s)")
    for ax in axes:
        ax.axvline(0, color="red", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--interval-ms", type=int, default=1000, help="the controller's interval")
    ap.add_argument("--max-parallelism", type=int, default=4)
    ap.add_argument("--before", type=float, default=0.5, help="load before the step, of one instance")
    ap.add_argument("--after", type=float, default=1.8, help="load after the step, of one instance")
    ap.add_argument("--reach", type=float, default=1.7, help="throughput that counts as reacted")
    ap.add_argument("--settle", type=float, default=6.0, help="seconds at the first load")
    ap.add_argument("--run", type=float, default=12.0, help="seconds after the step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plot", default=str(OUT / "elasticity.png"))
    args = ap.parse_args()
    log("capacity of one instance")
    cap = capacity()
    cases = []
    for r in range(args.repeats):
        log(f"load step {r + 1}/{args.repeats}: {args.before * cap:,.0f} -> {args.after * cap:,.0f} events/s")
        cases.append(stepped_case(cap, args))
    log("peer: checkpoint, stop, restore at 2 under the backlog")
    restart = float(np.median([restart_case(2) for _ in range(3)]))
    reactions = [c["reaction_ms"] for c in cases if c["reaction_ms"] is not None]
    decided = [c["decided_ms"] for c in cases if c["decided_ms"] is not None]
    median_case = sorted(cases, key=lambda c: c["reaction_ms"] or float("inf"))[len(cases) // 2]
    OUT.mkdir(exist_ok=True)
    plot(median_case, cap, args, args.plot)
    result = {
        "reaction_ms": round(float(np.median(reactions)), 1) if len(reactions) == len(cases) else None,
        "reaction_ms_max": round(max(reactions), 1) if reactions else None,
        "decision_ms": round(float(np.median(decided)), 1) if decided else None,
        "policy_interval_ms": args.interval_ms,
        "target_ms": args.interval_ms + 100,
        "settled_ratio": round(float(np.median([c["settled_ratio"] for c in cases])), 2),
        "rescales": [c["rescales"] for c in cases],
        "parallelism_after_step": [c["parallelism"] for c in cases],
        "capacity_one_instance": round(cap),
        "restart_ms": round(restart, 1),
        "restart_peer_reaction_ms": round(float(np.median(decided)) + restart, 1) if decided else None,
        "keys": KEYS,
        "plot": args.plot,
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
