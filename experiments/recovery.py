"""Fault tolerance: kill -9 trials, recovery time, checkpoint time by state size, checkpoint cost.

    python experiments/recovery.py --json

- Kill trials: a checkpointed job (running sum per key, parallelism 2, checkpoints every 50 ms)
  reads a rate-limited source; at a random moment a random busy worker (source or instance) is
  killed with SIGKILL. Its output channel, read after the run, is compared with a plain-Python
  reference: ``kill_trials_exact`` counts the trials whose output equals it exactly.
  ``recovery_p50_ms``: from the kill until the job runs again (state restored from the latest
  checkpoint, gates rebuilt, and every task handed to a live worker, sources at their positions).
- Checkpoint time with ~100 MB and ~1 GB of keyed state (vectorized ``sum`` over that many distinct
  keys, fed while the checkpoints are taken): medians of ``--checkpoints`` on-demand checkpoints,
  and how long the operator's instances stood still in each (``checkpoint_pause_p50_ms``: from the
  first instance at the barrier until the operator's release; the files are written after).
- ``throughput_overhead_pct``: W1 (keyed running count+sum, vectorized, parallelism 2) generated in
  the job, with a checkpoint every second against none; medians of ``--repeats`` runs each, the
  two alternating which runs first.
- ``leaked_segments``: shared-memory segments of this process left after everything (must be 0).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from _common import OUT, emit, log, median

from stretch import channels
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSink
from stretch.datastream.connectors.datagen import DataGeneratorSource, RateLimiterStrategy

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])
W1 = Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])
KEYS = 61


def _pairs(i: int, n: int) -> pa.RecordBatch:
    idx = np.arange(i, i + n, dtype=np.int64)
    return pa.record_batch([pa.array(idx % KEYS), pa.array(idx)], names=["f0", "f1"])


def _reference(n: int) -> list:
    acc, out = {}, []
    for i in range(n):
        acc[i % KEYS] = acc.get(i % KEYS, 0) + i
        out.append((i % KEYS, acc[i % KEYS]))
    return sorted(out)


def kill_trial(seed: int, n: int, reference: list) -> dict:
    rng = random.Random(seed)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(50)
    src = DataGeneratorSource(
        batch_function=_pairs,
        count=n,
        rate_limiter_strategy=RateLimiterStrategy.per_second(100_000),
        batch_rows=1000,
        type_info=PAIR,
    )
    env.from_source(src, None, "numbers").key_by(lambda r: r[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).map(
        lambda r: r, output_type=PAIR
    ).sink_to(ChannelSink("out"))
    client = env.execute_async(f"recovery-trial-{os.getpid()}-{seed}")
    co = client._coordinator
    try:
        time.sleep(rng.uniform(0.05, 0.4))
        busy = []
        while not busy and not co.done:  # a worker with a task (on a loaded machine they may start late)
            busy = [w for w in co.workers.all() if w.task is not None and w.pid]
        victim = rng.choice(busy)
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        status = client.wait(120)
    finally:
        if not co.done:
            client.cancel()
    got = sorted(tuple(r) for r in channels.open_reader(client, "out"))
    recovered = [r["running_at"] - killed_at for r in co.recoveries if "running_at" in r]
    return {
        "exact": status.name == "FINISHED" and got == reference,
        "recovery_ms": recovered[0] * 1000 if recovered else None,
        "victim": co.plan.stages[victim.task[0]].kind,  # source or keyed
    }


def _distinct_keys(i: int, n: int, keys: int) -> pa.RecordBatch:
    idx = np.arange(i, i + n, dtype=np.int64)
    return pa.record_batch(
        [pa.array(idx % keys), pa.array(np.ones(n, np.int64)), pa.array(idx * 0.5)], names=["f0", "f1", "f2"]
    )


def checkpoint_times(keys: int, checkpoints: int) -> dict:
    """On-demand checkpoints of an operator holding ``keys`` distinct keys, while it keeps working."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing()
    src = DataGeneratorSource(
        batch_function=lambda i, n: _distinct_keys(i, n, keys),
        count=None,
        rate_limiter_strategy=RateLimiterStrategy.per_second(3_000_000),
        batch_rows=65536,
        type_info=W1,
    )
    env.from_source(src, None, "keys").key_by(0).sum([1, 2]).name("sums").sink_to(DiscardingSink())
    client = env.execute_async(f"recovery-state-{os.getpid()}-{keys}")
    try:
        while client.describe()["operators"][0]["records_in"] < keys:
            if client._coordinator.done:
                raise RuntimeError(f"the job ended early: {client._coordinator.error}")
            time.sleep(0.1)
        state = client.describe()["operators"][0]["state_bytes"]
        reports = [client.trigger_checkpoint() for _ in range(checkpoints)]
    finally:
        client.cancel()
        client.wait(60)
    return {
        "state_bytes": state,
        "checkpoint_ms": [r["duration_ms"] for r in reports],
        "pause_ms": [r["pause_ms"] for r in reports],
        "checkpoint_bytes": reports[-1]["bytes"],
    }


def w1_seconds(events: int, checkpoint_ms: int | None) -> float:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    if checkpoint_ms:
        env.enable_checkpointing(checkpoint_ms)

    def batch(i: int, n: int) -> pa.RecordBatch:
        rng = np.random.default_rng(i)
        return pa.record_batch(
            [pa.array(rng.integers(0, 100_000, n)), pa.array(np.ones(n, np.int64)), pa.array(rng.random(n))],
            names=["f0", "f1", "f2"],
        )

    src = DataGeneratorSource(batch_function=batch, count=events, batch_rows=65536, type_info=W1)
    env.from_source(src, None, "w1").key_by(0).sum([1, 2]).name("sums").sink_to(DiscardingSink())
    client = env.execute_async(f"recovery-w1-{os.getpid()}")
    t0 = time.monotonic()
    client.wait()
    co = client._coordinator
    if checkpoint_ms and not co.checkpointer.history:
        log("warning: no checkpoint completed during the W1 run; use more --w1-events")
    return co.output_complete_at - t0


def _segments() -> list[str]:
    mine = f"stretch-{os.getuid()}-{os.getpid()}-"
    return [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(mine)]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def plot(result: dict, recoveries: list[float], sizes: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    axes[0].hist(recoveries, bins=30)
    axes[0].set_xlabel("kill -9 to running again (ms)")
    axes[0].set_ylabel("trials")
    axes[0].set_title(f"{result['kill_trials_exact']}/{result['kill_trials']} trials exact")
    labels = list(sizes)
    axes[1].boxplot([sizes[k]["checkpoint_ms"] for k in labels], tick_labels=labels)
    axes[1].set_ylabel("checkpoint duration (ms)")
    axes[1].set_title(f"W1 with 1 s checkpoints: {result['throughput_overhead_pct']:+.1f}% time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--kill-trials", type=int, default=100)
    ap.add_argument("--trial-events", type=int, default=40_000)
    ap.add_argument("--checkpoints", type=int, default=7)
    ap.add_argument("--small-keys", type=int, default=2_300_000, help="distinct keys for ~100 MB of state")
    ap.add_argument("--large-keys", type=int, default=23_000_000, help="distinct keys for ~1 GB of state")
    ap.add_argument("--w1-events", type=int, default=100_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--plot", default=str(OUT / "recovery.png"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="stretch-recovery-") as state:
        os.environ["STRETCH_STATE_DIR"] = state  # the runs' checkpoints and logs (GBs) go with it
        run(args)


def run(args) -> None:
    before = set(_segments())

    reference = _reference(args.trial_events)
    trials = []
    for seed in range(args.kill_trials):
        trials.append(kill_trial(seed, args.trial_events, reference))
        if (seed + 1) % 10 == 0:
            log(f"kill trials {seed + 1}/{args.kill_trials}: {sum(t['exact'] for t in trials)} exact")
    recoveries = [t["recovery_ms"] for t in trials if t["recovery_ms"] is not None]

    sizes = {}
    for label, keys in (("100MB", args.small_keys), ("1GB", args.large_keys)):
        log(f"checkpoints with {keys:,} keys")
        sizes[label] = checkpoint_times(keys, args.checkpoints)

    times: dict[str, list[float]] = {"none": [], "1s": []}
    for r in range(args.repeats):
        log(f"W1 repeat {r + 1}/{args.repeats}")
        order = ("none", "1s") if r % 2 == 0 else ("1s", "none")  # neither always runs first
        for case in order:
            times[case].append(w1_seconds(args.w1_events, 1000 if case == "1s" else None))
    overhead = (median(times["1s"]) / median(times["none"]) - 1) * 100

    result = {
        "kill_trials": len(trials),
        "kill_trials_exact": sum(t["exact"] for t in trials),
        "kill_trials_source_victims": sum(t["victim"] == "source" for t in trials),
        "recovery_p50_ms": round(statistics.median(recoveries), 1) if recoveries else None,
        "recovery_p99_ms": round(pct(recoveries, 99), 1),
    }
    for label, s in sizes.items():
        result[f"checkpoint_p50_ms_{label}"] = round(statistics.median(s["checkpoint_ms"]), 1)
        result[f"checkpoint_pause_p50_ms_{label}"] = round(statistics.median(s["pause_ms"]), 1)
        result[f"state_bytes_{label}"] = s["state_bytes"]
        result[f"checkpoint_bytes_{label}"] = s["checkpoint_bytes"]
    result.update(
        w1_events=args.w1_events,
        w1_meps_no_checkpoints=round(args.w1_events / median(times["none"]) / 1e6, 3),
        w1_meps_1s_checkpoints=round(args.w1_events / median(times["1s"]) / 1e6, 3),
        throughput_overhead_pct=round(overhead, 1),
        leaked_segments=len(set(_segments()) - before),
    )
    OUT.mkdir(exist_ok=True)
    plot(result, recoveries, sizes, args.plot)
    result["plot"] = args.plot
    emit(result, args.json)


if __name__ == "__main__":
    main()
