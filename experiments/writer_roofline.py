"""The vectorized path's producer, stage by stage, against the machine's measured memory bandwidth.

    python experiments/writer_roofline.py --json

What bounds ``sum_p2 / sum_p1`` on 2 cores is the CPU every event costs in all processes together
(docs/performance.md). This measures, in one process and one thread, the producer's share for W1
(int64 key, int64 count, float64 value; 65,536-row batches, 128 key groups): the stable hash of
each key, its key group, the layout in runs of key groups (a stable counting sort, then one
scatter pass per 8-byte column), and the copy into a gate (Arrow IPC, into shared memory). Each
stage is timed alone over the same batches, medians of ``--repeats``, and given with the bytes it
reads and writes per event; beside them, the copy bandwidth of this machine measured the same way,
for a working set the size of one batch (the cache) and for 512 MiB (memory), and the numba
loop's ns per event (throughput.py's peer, its best pass): ``sum_p2_meps >= 0.5x`` that loop needs
the producer, one thread, at or under twice the loop's time per event. A stage near the
copy bandwidth is bound by memory traffic; one far below it by its instructions.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import emit, log, median, w1
from throughput import NumbaLoop

from stretch import _shm as shm
from stretch.runtime.gate import Gate
from stretch.runtime.key_group_runs import in_runs
from stretch.runtime.routing import keyed_by_field
from stretch.state import _hash_kernels as _k
from stretch.state.key_groups import LayoutScratch, hashes_of, key_groups_of

MAX_PARALLELISM = 128
ROWS = 65_536
LAYOUT_BYTES = 2 * 2 + 4 + 2 + 3 * (8 + 4 + 8)
BYTES_PER_EVENT = {  # read + written, per event
    "hash": 8 + 8,  # the key in, its uint64 hash out
    "key_group": 8 + 2,  # the hash in, the uint16 key group out
    # the counting sort: key groups read twice, places (int32) and sorted key groups written;
    # then each 8-byte column read, places read, the column written at its place
    "layout": LAYOUT_BYTES,
    "layout_kernels": LAYOUT_BYTES,  # the same, the numba kernels alone (no wrapping for Arrow)
    "gate_append": 2 * (3 * 8 + 2),  # the laid-out batch and its key groups read and written
}


def copy_gbps(nbytes: int, repeats: int) -> float:
    """Bytes read plus written per second by ``np.copyto`` over ``nbytes``, best of a few passes
    (the fastest pass is what the memory can do; slower ones met another process)."""
    src = np.ones(nbytes // 8, dtype=np.int64)
    dst = np.zeros_like(src)
    passes = max(3, (256 << 20) // nbytes)
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(passes):
            np.copyto(dst, src)
        best.append(2 * nbytes * passes / (time.perf_counter() - t0) / 1e9)
    return max(best)


def layout_kernels(batch, kgs: np.ndarray, scratch: LayoutScratch) -> None:
    """The counting sort and the scatter of each column, as ``in_key_group_order`` runs them."""
    n = len(kgs)
    scratch.fit(n, batch.num_columns)
    places = scratch.places[:n]
    _k.key_group_places(kgs, np.int64(MAX_PARALLELISM), np.int64(n), places, scratch.kgs[:n])
    for i, column in enumerate(batch.columns):
        _k.scatter_words(np.frombuffer(column.buffers()[1], np.int64, n), places, scratch.words[i][:n])


def timed_ns(batches, stage, events: int) -> float:
    t0 = time.perf_counter_ns()
    for b in batches:
        stage(b)
    return (time.perf_counter_ns() - t0) / events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--events", type=int, default=5_242_880)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    data = w1(args.events, args.keys)
    batches = data.to_batches(max_chunksize=ROWS)
    events = sum(b.num_rows for b in batches)
    kgs = [key_groups_of(b.column(0), MAX_PARALLELISM) for b in batches]
    stamped = [keyed_by_field(b, 0, MAX_PARALLELISM, runs=True) for b in batches]
    prefix = shm.engine_prefix()
    gate = Gate.create(prefix, "roofline")  # a job's gate size; no reader: entries are dropped
    scratch = LayoutScratch()
    try:
        for b in stamped:  # a lap of the ring first, as a running job's gate has had
            gate.append_batch(b)
        stages = {  # the stage on one batch
            "hash": lambda b: hashes_of(b.column(0)),
            "hash_and_key_group": lambda b: key_groups_of(b.column(0), MAX_PARALLELISM),
            "layout": lambda i: in_runs(batches[i], kgs[i], MAX_PARALLELISM),
            "layout_kernels": lambda i: layout_kernels(batches[i], kgs[i], scratch),
            "keyed_by_field": lambda b: keyed_by_field(b, 0, MAX_PARALLELISM, runs=True),
            "gate_append": gate.append_batch,
        }
        inputs = {
            "layout": range(len(batches)),
            "layout_kernels": range(len(batches)),
            "gate_append": stamped,
        }
        runs: dict[str, list[float]] = {name: [] for name in stages}
        for _ in range(args.repeats):  # stages alternate, so a noisy moment hits them all alike
            for name, stage in stages.items():
                runs[name].append(timed_ns(inputs.get(name, batches), stage, events))
        ns = {name: median(v) for name, v in runs.items()}
    finally:
        gate.close()
        shm.unlink_prefix(prefix)
    ns["key_group"] = ns["hash_and_key_group"] - ns["hash"]
    keys, values = data.column("f0").to_numpy(), data.column("f2").to_numpy()  # the peer: same events
    peer = NumbaLoop(len(keys), args.keys)
    peer.run(keys[:1000], values[:1000])  # compiled outside the timing
    numba_ns = min(peer.run(keys, values) for _ in range(args.repeats)) * 1e9 / len(keys)
    batch_bytes = batches[0].nbytes
    cache_gbps = copy_gbps(batch_bytes, args.repeats)
    memory_gbps = copy_gbps(512 << 20, args.repeats)
    table = {}
    for name, bytes_per_event in BYTES_PER_EVENT.items():
        achieved = bytes_per_event / ns[name]  # bytes per ns = GB/s
        table[name] = {
            "ns_per_event": round(ns[name], 2),
            "bytes_per_event": bytes_per_event,
            "gbps": round(achieved, 2),
            "of_cache_copy": round(achieved / cache_gbps, 3),
            "of_memory_copy": round(achieved / memory_gbps, 3),
        }
        log(
            f"{name:12s} {ns[name]:6.2f} ns/event  {bytes_per_event:3d} B/event  {achieved:6.2f} GB/s "
            f"({achieved / cache_gbps:.2f}x cache copy, {achieved / memory_gbps:.2f}x memory copy)"
        )
    producer = ns["keyed_by_field"] + ns["gate_append"]
    log(f"layout outside its kernels (Arrow wrapping) {ns['layout'] - ns['layout_kernels']:.2f} ns/event")
    log(f"numba loop (best of {args.repeats} passes) {numba_ns:.2f} ns/event")
    log(f"producer total {producer:.2f} ns/event (keyed_by_field {ns['keyed_by_field']:.2f} + append)")
    log(
        f"copy bandwidth: {cache_gbps:.1f} GB/s over {batch_bytes >> 10} KiB, {memory_gbps:.1f} GB/s over 512 MiB"
    )
    emit(
        {
            "events": events,
            "batch_rows": ROWS,
            "stages": table,
            "keyed_by_field_ns_per_event": round(ns["keyed_by_field"], 2),
            "producer_ns_per_event": round(producer, 2),
            "numba_loop_ns_per_event": round(numba_ns, 2),
            "producer_over_half_numba_loop": round(producer / (2 * numba_ns), 2),
            "cache_copy_gbps": round(cache_gbps, 2),
            "memory_copy_gbps": round(memory_gbps, 2),
            "batch_bytes": batch_bytes,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
