"""Shared helpers for the benchmarks: W1 data, medians, one JSON object per run, PNG output."""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

OUT = Path(__file__).resolve().parent / "out"


def w1(events: int = 5_000_000, keys: int = 100_000, seed: int = 1) -> pa.Table:
    """W1: int64 key uniform over `keys`, a count column of ones, a float64 value."""
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "f0": rng.integers(0, keys, events, dtype=np.int64),
            "f1": np.ones(events, dtype=np.int64),
            "f2": rng.random(events),
        }
    )


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:32} {v}")
    sys.stdout.flush()


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def _plain_count_sum(rows: list[tuple[int, float]], results) -> None:
    """The per-record operator of the backlog benchmarks (a count and a sum per key) as a plain
    Python loop: what one core does with it, without any engine."""
    t0 = time.perf_counter()
    count: dict[int, int] = {}
    total: dict[int, float] = {}
    for key, value in rows:
        count[key] = count.get(key, 0) + 1
        total[key] = total.get(key, 0.0) + value
    results.put(len(rows) / (time.perf_counter() - t0))


def plain_loop_scaling(events: int = 1_000_000, repeats: int = 5) -> dict:
    """How much faster two processes run the same plain-Python loop than one, on this machine now:
    the ceiling of any engine's parallelism-2 over parallelism-1 figure (two vCPUs of a VM may
    share a physical core). Medians over ``repeats`` pairs (one process alone, then two at once)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    rng = np.random.default_rng(3)
    rows = list(zip(rng.integers(0, 100_000, events).tolist(), rng.random(events).tolist()))
    p1, p2 = [], []
    for _ in range(repeats):
        for n, out in ((1, p1), (2, p2)):
            results = ctx.Queue()
            procs = [ctx.Process(target=_plain_count_sum, args=(rows, results)) for _ in range(n)]
            for proc in procs:
                proc.start()
            rates = [results.get() for _ in procs]
            for proc in procs:
                proc.join()
            out.append(sum(rates))
    return {
        "plain_loop_p1_meps": round(median(p1) / 1e6, 2),
        "plain_loop_p2_meps": round(median(p2) / 1e6, 2),
        "plain_loop_p2_over_p1": round(median([b / a for a, b in zip(p1, p2)]), 2),
    }


class CpuSampler:
    """CPU seconds used from now until ``stop()`` by this process and by each process under it (a
    job's workers), read from /proc (Linux) every 5 ms by a helper process (itself not counted),
    since workers exit with their job. ``stop()`` returns {"writer": this process's seconds (the benchmark's writer
    and the job's coordinator thread), "workers": each worker's that used any, busiest first}."""

    def __init__(self):
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._proc.stdout.readline()  # it has read the first sample

    def stop(self) -> dict:
        self._proc.stdin.close()
        used = json.loads(self._proc.stdout.read())
        self._proc.wait()
        return used


def _cpu_seconds(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (s := _cpu_seconds(int(name))) is not None:
            children.setdefault(s[0], []).append(int(name))
    out, todo = [], [root]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def _sample(root: int) -> None:
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    pids: list[int] = []
    rescan = 0.0
    while True:
        if time.monotonic() >= rescan:  # the process tree every 250 ms, their CPU time every 5 ms
            pids, rescan = [p for p in _tree(root) if p != os.getpid()], time.monotonic() + 0.25
        for pid in pids:
            if (s := _cpu_seconds(pid)) is not None:
                first.setdefault(pid, s[1])
                last[pid] = s[1]
        if rescan and not first.get(-1):
            first[-1] = 1.0
            print("ready", flush=True)
        if select.select([sys.stdin], [], [], 0.005)[0] and not sys.stdin.readline():
            break
    used = {pid: round(last[pid] - first[pid], 3) for pid in last}
    workers = sorted((v for pid, v in used.items() if pid != root and v > 0.005), reverse=True)
    print(json.dumps({"writer": used.get(root, 0.0), "workers": workers}), flush=True)


if __name__ == "__main__":
    _sample(int(sys.argv[1]))
