"""Compile (or load from numba's cache) the state-table kernels before a worker takes work."""

from __future__ import annotations

import numpy as np

from stretch.state import _table_kernels as K
from stretch.state import _window_kernels as W


def warm_table_kernels() -> None:
    """Run every kernel once on a tiny scratch arena with the dtypes the engine uses."""
    words = K.KG_WORDS * 2 + 4096
    a8 = np.zeros(words * 8, dtype=np.uint8)
    a64 = a8.view(np.int64)
    a32 = a8.view(np.int32)
    h = 0
    index_off, keys_off = K.KG_WORDS * 8, K.KG_WORDS * 8 + 1024
    a64[K.H_INDEX_OFF], a64[K.H_INDEX_CAP] = index_off, 64
    a64[K.H_KEYS_OFF], a64[K.H_KEYS_CAP] = keys_off, 64
    a64[K.H_KHEAP_OFF], a64[K.H_KHEAP_CAP] = keys_off + 2048, 1024
    a64[K.H_KHASH_OFF] = keys_off + 4096
    kgs = np.zeros(1, dtype=np.uint16)
    rows = np.zeros(1, dtype=np.int64)
    K.lookup_i64(a64, a32, h, kgs, np.zeros(1, dtype=np.int64), rows, False)
    K.rehash_i64(a64, a32, h, index_off, 64)
    K.lookup_bytes(
        a64, a32, a8, h, kgs, np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.uint8), rows, False
    )
    K.rehash_bytes(a64, a32, h, index_off, 64)
    scratch = np.zeros(4, dtype=np.int64)
    K.dedup(kgs, rows, scratch, np.zeros(1, np.int64), np.zeros(1, np.int64))
    base = K.STATE_BASE
    views = {
        np.int64: (a64, 3),
        np.float64: (a8.view(np.float64), 3),
        np.int32: (a32, 2),
        np.float32: (a8.view(np.float32), 2),
        np.int16: (a8.view(np.int16), 1),
        np.int8: (a8.view(np.int8), 0),
        np.uint8: (a8, 0),
    }
    for dtype, (view, shift) in views.items():
        out = np.zeros(1, dtype=dtype)
        valid = np.zeros(1, dtype=np.uint8)
        K.gather_fixed(view, shift, a64, a8, base, kgs, rows, out, valid)
        K.scatter_fixed(view, shift, a64, a8, base, kgs, rows[:0], out[:0], valid[:0])
    lens = np.full(1, -1, dtype=np.int64)
    K.var_views(a64, base, kgs, rows, np.zeros(1, np.int64), np.zeros(1, np.int64))
    K.var_demand(a64, base, kgs, rows, lens, np.zeros(1, np.bool_), np.zeros(1, np.int64))
    K.var_write(a64, a8, base, kgs[:0], rows[:0], lens[:0], np.zeros(0, np.bool_), a8[:0], lens[:0])
    K.var_compact(a64, a8, base, 0, 0)


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.setflags(write=False)
    return v


def warm_fused_kernels() -> None:
    """The rolling-aggregate passes, with the argument kinds the operator passes."""
    words = K.KG_WORDS * 2 + 4096
    a8 = np.zeros(words * 8, dtype=np.uint8)
    a64, a32, af64 = a8.view(np.int64), a8.view(np.int32), a8.view(np.float64)
    kgs = np.zeros(0, dtype=np.uint16)
    owners = np.zeros(1, dtype=np.int16)
    keys = _readonly(np.zeros(0, dtype=np.int64))
    vals, flags = np.zeros((1, 0), np.int64), np.zeros(1, np.bool_)
    pos = np.zeros(0, np.int64)
    progress = np.zeros(3, np.int64)
    K.rolling_aggregate_i64(
        a64, a32, a8, af64, 0, 0, kgs, keys, owners, 0, 0, vals, flags, flags, pos, vals.copy(), progress, 0.7
    )
    K.rolling_records(a64, a8, af64, 0, kgs, pos, vals, flags, flags, 0, vals.copy())


def warm_timer_kernels() -> None:
    """The timer heaps' push, pop and peek, with the argument kinds the timer store passes."""
    a64 = np.zeros(K.KG_WORDS * 2 + 64, dtype=np.int64)
    none64 = np.zeros(0, np.int64)
    K.heap_push(a64, 0, np.zeros(0, np.uint16), none64, none64)
    K.heap_pop_due(a64, 0, 0, 0, np.zeros(4, np.int64), np.zeros(4, np.int64))
    K.heap_heads(a64, 0, none64, none64)


def warm_window_kernels() -> None:
    """The vectorized window kernels, with the argument kinds the window operator passes."""
    a64 = np.zeros(K.KG_WORDS * 2 + 64, dtype=np.int64)
    none64, kgs = np.zeros(0, np.int64), np.zeros(0, np.uint16)
    ops, is_float = np.zeros(1, np.int64), np.zeros(1, np.bool_)
    vals = np.zeros((1, 0), np.int64)
    progress = np.array([0, -(2**63), 0, 0], np.int64)
    W.window_add(
        a64, a64.view(np.float64), 0, kgs, none64, none64, _readonly(none64), vals, ops, is_float, 1, 1,
        0, 16, 0, np.zeros(0, np.bool_), progress,
    )  # fmt: skip
    out = (none64, none64, none64, none64, none64, vals)
    W.window_fire(a64, 0, 0, 0, none64, 0, 1, 16, *out, np.zeros(2, np.int64))
    W.window_index_rebuild(a64, 0, 0, 0, 0, 1)
