"""Gate batches laid out in runs of key groups, so that each instance reads only its own rows.

Every instance of a keyed operator reads every entry of its gate (one gate, the same order for all
readers, ownership a table that changes at epochs' positions). When several instances read a gate,
the producer sorts each batch by key group before appending it (a stable counting sort: each key's
records keep their order) and marks its ``__kg`` field. An instance then finds the rows of the key
groups it owns with a binary search at each end of its ranges of key groups (ranges of adjacent
key groups: one per instance under Flink's contiguous assignment) and reads them as zero-copy
slices, instead of testing every row and copying its own out. A key group's rows are also folded
together, so its table stays in cache meanwhile.

For per-record functions, a large batch is laid out in *blocks*, each in runs of its own: the rows
of about ``BLOCK_NS`` of the readers' work (``block_rows``, from the rate they publish in the
gate). Instances that read a batch in step are then apart in gate positions by at most a block's
runs, not by the batch's: an epoch placed at the furthest claim (``runtime.frontier``) waits for a
slower instance to finish its run of one block, milliseconds, rather than its run of a whole
batch, which is a third of a second of per-record work for a batch of 65 k rows. Vectorized
operators, through a whole batch in a few milliseconds, publish no rate and get no blocks: more
runs would cost them more pieces than the frontier gains.

When one instance reads the gate, producers append batches as they are: an operator at parallelism
1 sees, and emits, its input in order. At parallelism > 1 an instance's output keeps each key's
order but not the order between keys of one batch (Flink promises no order between keys either).
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa

from stretch.runtime.batch import KG_COLUMN
from stretch.state.key_groups import LayoutScratch, in_key_group_order

_RUNS, _BLOCK = b"stretch.kg_runs", b"stretch.kg_block"
KG_FIELD = pa.field(KG_COLUMN, pa.uint16())
RUNS_FIELD = pa.field(KG_COLUMN, pa.uint16(), metadata={_RUNS: b"1"})
MIN_ROWS = 256  # smaller batches cost more to sort than their readers save
BLOCK_NS = 4_000_000
"""About how long the readers take over one block of a batch laid out in blocks."""
MAX_BLOCKS = 16
"""A batch's blocks at most: each is a run to find and pace through for every reader, in Python,
and a slow start (the readers' rate inflated while their state grows) must not cut a batch into
hundreds of them, which would keep the rate slow."""
_scratch = threading.local()  # each producing thread lays its batches out into memory of its own


def block_rows(ns_per_row: float, max_parallelism: int) -> int:
    """The rows of a block the readers work through in about ``BLOCK_NS`` (0: no blocks, while
    their rate is not known); no fewer than ``MIN_ROWS``, nor than key groups (the sort's cost per
    block)."""
    if ns_per_row <= 0:
        return 0
    return max(MIN_ROWS, max_parallelism, int(BLOCK_NS / ns_per_row))


def in_runs(batch: pa.RecordBatch, kgs: np.ndarray, max_parallelism: int, block: int = 0):
    """(batch, kgs, ``__kg`` field): the batch and its rows' key groups in key-group order, within
    each block of ``block`` rows (0: the batch is one block), and the field that says so; a small
    batch as it is. A laid-out batch lives in memory this thread reuses for its next one: the
    producer appends it to the gate (a copy) before it lays out another."""
    n = batch.num_rows
    if n < MIN_ROWS:
        return batch, kgs, KG_FIELD
    scratch = getattr(_scratch, "memory", None)
    if scratch is None:
        scratch = _scratch.memory = LayoutScratch()
    block = max(block, -(-n // MAX_BLOCKS)) if 0 < block < n else 0
    ordered = in_key_group_order(batch, kgs, max_parallelism, scratch, block)
    if ordered is not None:
        batch, kgs = ordered
    if not block:
        return batch, kgs, RUNS_FIELD
    return batch, kgs, pa.field(KG_COLUMN, pa.uint16(), metadata={_RUNS: b"1", _BLOCK: b"%d" % block})


def laid_out(batch: pa.RecordBatch) -> int:
    """The rows of a block of a gate batch in runs of key groups (its rows if it is one block);
    0 if it is not laid out."""
    meta = batch.schema.field(KG_COLUMN).metadata
    if meta is None or meta.get(_RUNS) != b"1":
        return 0
    return int(meta.get(_BLOCK, 0)) or max(batch.num_rows, 1)


def not_laid_out(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch of a gate's rows picked out or sliced off, marked as not laid out if it was in
    blocks (its blocks no longer line up: its readers then test each row); rows picked out of one
    block are still in key-group order, and keep their mark."""
    meta = batch.schema.field(KG_COLUMN).metadata
    if meta is None or _BLOCK not in meta:
        return batch
    i = batch.schema.get_field_index(KG_COLUMN)
    return pa.RecordBatch.from_arrays(batch.columns, schema=batch.schema.set(i, KG_FIELD))


def owned_ranges(owners: np.ndarray, me: int) -> np.ndarray:
    """The key groups ``me`` owns as ranges [start, stop) of adjacent ones: shape (ranges, 2)."""
    mine = np.flatnonzero(owners == me)
    if not mine.size:
        return np.empty((0, 2), dtype=np.uint16)
    breaks = np.flatnonzero(np.diff(mine) != 1) + 1
    starts = mine[np.r_[0, breaks]]
    stops = mine[np.r_[breaks - 1, mine.size - 1]] + 1
    return np.stack([starts, stops], axis=1).astype(np.uint16)  # the dtype of __kg: no cast per batch


def owns_all(ranges: np.ndarray, max_parallelism: int) -> bool:
    return ranges.shape[0] == 1 and ranges[0, 0] == 0 and ranges[0, 1] == max_parallelism


def spans(kgs: np.ndarray, ranges: np.ndarray, block: int = 0) -> list[tuple[int, int]]:
    """The rows [start, stop) of a batch in runs (in blocks of ``block`` rows, if given) that hold
    the key groups of ``ranges``, in order; adjacent ones joined."""
    n = kgs.shape[0]
    out: list[tuple[int, int]] = []
    bounds = ranges.ravel()  # uint16, as kgs: no cast
    for first in range(0, n, block or max(n, 1)):
        part = kgs[first : first + block] if block else kgs
        for a, b in (np.searchsorted(part, bounds) + first).reshape(-1, 2).tolist():
            if b <= a:
                continue
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
    return out
