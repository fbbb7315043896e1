"""Gate batches laid out in runs of key groups, so that each instance reads only its own rows.

Every instance of a keyed operator reads every entry of its gate (one gate, the same order for all
readers, ownership a table that changes at epochs' positions). When several instances read a gate,
the producer sorts each batch by key group before appending it (a stable counting sort: each key's
records keep their order) and marks its ``__kg`` field. An instance then finds the rows of the key
groups it owns with a binary search at each end of its ranges of key groups (ranges of adjacent
key groups: one per instance under Flink's contiguous assignment) and reads them as zero-copy
slices, instead of testing every row and copying its own out. A key group's rows are also folded
together, so its table stays in cache meanwhile.

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

RUNS_META = {b"stretch.kg_runs": b"1"}
KG_FIELD = pa.field(KG_COLUMN, pa.uint16())
RUNS_FIELD = pa.field(KG_COLUMN, pa.uint16(), metadata=RUNS_META)
MIN_ROWS = 256  # smaller batches cost more to sort than their readers save
_scratch = threading.local()  # each producing thread lays its batches out into memory of its own


def in_runs(batch: pa.RecordBatch, kgs: np.ndarray, max_parallelism: int):
    """(batch, kgs, ``__kg`` field): the batch and its rows' key groups in key-group order, and the
    field that says so; a small batch as it is. A laid-out batch lives in memory this thread reuses
    for its next one: the producer appends it to the gate (a copy) before it lays out another."""
    if batch.num_rows < MIN_ROWS:
        return batch, kgs, KG_FIELD
    scratch = getattr(_scratch, "memory", None)
    if scratch is None:
        scratch = _scratch.memory = LayoutScratch()
    ordered = in_key_group_order(batch, kgs, max_parallelism, scratch)
    if ordered is not None:
        batch, kgs = ordered
    return batch, kgs, RUNS_FIELD


def laid_out(batch: pa.RecordBatch) -> bool:
    """Whether a gate batch is in runs of key groups."""
    meta = batch.schema.field(KG_COLUMN).metadata
    return meta is not None and meta.get(b"stretch.kg_runs") == b"1"


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


def spans(kgs: np.ndarray, ranges: np.ndarray) -> list[tuple[int, int]]:
    """The rows [start, stop) of a batch in runs that hold the key groups of ``ranges``."""
    bounds = np.searchsorted(kgs, ranges.ravel()).reshape(-1, 2).tolist()  # both uint16
    return [(a, b) for a, b in bounds if b > a]
