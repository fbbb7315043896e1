"""Shared helpers for the benchmarks: W1 data, medians, one JSON object per run, PNG output."""

from __future__ import annotations

import json
import statistics
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
