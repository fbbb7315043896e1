"""Live code update under steady W1 load, beside a stop-checkpoint-restore baseline.

    python experiments/update.py --json

A KeyedProcessFunction keeps a count and a payload per key (about 1 MB of state, then about
1 GB). Under a steady input rate, its code is swapped ``--updates`` times between two versions
with ``JobClient.update``, each timed from the request until every instance runs the new code;
then, with a per-record operator behind a source that writes as fast as its gate takes it
(``backlog.py``), ``--backlog-updates`` more (``update_backlog_p99_ms``): each applies at the
readers' frontier, ahead of what is queued.
A sampler records how long input waits in the gate meanwhile (``max_stall_ms``: the longest any
write waited while an update was under way). In the same run, the baseline updates code the way
Flink and Spark do: take a checkpoint, stop the job, start it again from the checkpoint with the
new code, timed until the restarted job has processed its first new record.
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import numpy as np
from _common import emit, log
from backlog import OPERATOR, flat_out_job
from rescale import Load, Sampler, latencies, pct, stop_run, w1_batch
from throughput import CountSum
from versions import CountSumB, Profile, ProfileB

from stretch import channels
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource

W1 = Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])


def start_job(payload: int, name: str, checkpointing: bool = False, restore: bool = False, version=Profile):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    if checkpointing:
        env.enable_checkpointing(None)
    source = ChannelSource("w1", W1, durable=checkpointing)
    env.from_source(source, None, "w1").key_by(0).process(version(payload)).name("profile").sink_to(
        DiscardingSink()
    )
    client = env.execute_async(name, restore=restore)
    return client, channels.open_writer(client, "w1")


def processed(client) -> int:
    return client.describe()["operators"][0]["records_in"]


def populate(client, writer, keys: int) -> None:
    for start in range(0, keys, 1 << 14):
        writer.write(w1_batch(np.arange(start, min(start + (1 << 14), keys), dtype=np.int64)))
    while processed(client) < keys:
        time.sleep(0.01)


def live_case(keys: int, payload: int, updates: int, rate: float) -> dict:
    client, writer = start_job(payload, f"update live {keys}")
    populate(client, writer, keys)
    state = client.describe()["operators"][0]["state_bytes"]
    time.sleep(2.0)  # spare workers map the state into their page tables
    load, sampler = Load(writer, keys, rate, batch_rows=1024), Sampler(client, "profile")
    sampler.start()
    load.start()
    time.sleep(0.5)
    reports, windows = [], []
    for i in range(updates):
        t = time.monotonic()
        reports.append(client.update("profile", (ProfileB if i % 2 == 0 else Profile)(payload)))
        windows.append((t, time.monotonic()))
        time.sleep(random.uniform(0.05, 0.15))
    time.sleep(0.3)
    stop_run(load, sampler, writer, client)
    waits = latencies(load.written, sampler.samples)
    during = [ms for t, ms in waits if any(a - 0.01 <= t <= b for a, b in windows)]
    return {
        "state_bytes": state,
        "elapsed_ms": sorted(r.elapsed_ms for r in reports),
        "max_stall_ms": max(during, default=0.0),
        "queue_p50_ms": pct([ms for _, ms in waits], 50),
    }


def baseline_case(keys: int, payload: int) -> float:
    """Checkpoint, stop, restore with the new code: milliseconds until it processes a new record."""
    name = f"update baseline {keys} {random.randrange(1 << 30):x}"
    client, writer = start_job(payload, name, checkpointing=True)
    populate(client, writer, keys)
    t0 = time.monotonic()
    client.trigger_checkpoint()
    client.cancel()
    client.wait()
    client2, writer2 = start_job(payload, name, checkpointing=True, restore=True, version=ProfileB)
    before = processed(client2)
    writer2.write(w1_batch(np.zeros(1, dtype=np.int64)))
    while processed(client2) <= before:
        time.sleep(0.001)
    ms = (time.monotonic() - t0) * 1000
    client2.cancel()
    client2.wait()
    return ms


def backlog_case(updates: int) -> dict:
    """``updates`` live updates 100-200 ms apart while the operator (at parallelism 2) is behind a
    source that writes as fast as its gate takes it; each timed until every instance runs it."""
    client = flat_out_job("update backlog", 2, 200_000_000)
    time.sleep(1.5)  # the gate fills
    reports = []
    for i in range(updates):
        reports.append(client.update(OPERATOR, (CountSumB if i % 2 == 0 else CountSum)()))
        time.sleep(random.uniform(0.1, 0.2))
    client.cancel()
    return {"elapsed_ms": sorted(r.elapsed_ms for r in reports), "queued": [r.queued for r in reports]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--updates", type=int, default=30, help="updates per state size")
    ap.add_argument("--rate", type=float, default=50_000, help="steady input, events/s")
    ap.add_argument("--small-keys", type=int, default=1_000, help="keys for ~1 MB of state")
    ap.add_argument("--large-keys", type=int, default=1_000_000, help="keys for ~1 GB of state")
    ap.add_argument("--payload", type=int, default=1000, help="payload bytes per key")
    ap.add_argument("--backlog-updates", type=int, default=30, help="updates with the operator behind")
    args = ap.parse_args()
    log(f"live update under a backlog, {args.backlog_updates} updates")
    behind = backlog_case(args.backlog_updates)
    log(f"live update, small state, {args.rate:,.0f} events/s")
    small = live_case(args.small_keys, args.payload, args.updates, args.rate)
    log("live update, large state")
    large = live_case(args.large_keys, args.payload, args.updates, args.rate)
    log("baseline: checkpoint, stop, restore with the new code (large state)")
    base = baseline_case(args.large_keys, args.payload)
    result = {
        "update_p50_ms": round(pct(small["elapsed_ms"], 50), 2),
        "update_p99_ms": round(pct(small["elapsed_ms"], 99), 2),
        "update_p50_ms_large_state": round(pct(large["elapsed_ms"], 50), 2),
        "update_p99_ms_large_state": round(pct(large["elapsed_ms"], 99), 2),
        "update_backlog_p50_ms": round(pct(behind["elapsed_ms"], 50), 2),
        "update_backlog_p99_ms": round(pct(behind["elapsed_ms"], 99), 2),
        "update_backlog_queued_p50": int(np.median(behind["queued"])),
        "max_stall_ms": round(max(small["max_stall_ms"], large["max_stall_ms"]), 2),
        "queue_p50_ms": round(large["queue_p50_ms"], 2),
        "restart_baseline_ms": round(base, 1),
        "state_bytes_small": small["state_bytes"],
        "state_bytes_large": large["state_bytes"],
        "updates": len(small["elapsed_ms"]) + len(large["elapsed_ms"]),
    }
    result["restart_baseline_vs_update_p50"] = round(
        result["restart_baseline_ms"] / result["update_p50_ms_large_state"], 1
    )
    emit(result, args.json)


if __name__ == "__main__":
    threading.excepthook = lambda a: None if a.exc_type is SystemExit else threading.__excepthook__(a)
    main()
