"""The fused rolling pass writes back only what it changed: a cluster node loads key groups into the
arena while its instances run passes over the key groups they own (an instance's ownership table
covers every key group, so it covers those being loaded too)."""

from __future__ import annotations

import threading
import time

import numpy as np

from stretch.state import _table_kernels as K

MAX_LOAD = 0.7


def _memory(n: int) -> tuple[np.ndarray, int]:
    """Two key groups' headers, then key group 0's index, keys, records and validity bytes (room
    for ``n`` keys); key group 1 is empty, as one not yet loaded."""
    index_cap = 1 << int(np.ceil(np.log2(n / MAX_LOAD + 1)))
    header_bytes = 2 * K.KG_WORDS * 8
    index_off = header_bytes
    keys_off = index_off + index_cap * 4
    rec_off = keys_off + n * 8
    valid_off = rec_off + n * 8
    a8 = np.zeros(valid_off + n, dtype=np.uint8)
    a64 = a8[: len(a8) // 8 * 8].view(np.int64)
    h, s = 0, K.STATE_BASE
    a64[h + K.H_INDEX_OFF], a64[h + K.H_INDEX_CAP] = index_off, index_cap
    a64[h + K.H_KEYS_OFF], a64[h + K.H_KEYS_CAP] = keys_off, n
    a64[s + K.S_DATA_OFF], a64[s + K.S_DATA_CAP], a64[s + K.S_VALID_OFF] = rec_off, n, valid_off
    return a8, K.STATE_BASE


def _pass(a8: np.ndarray, base_w: int, keys: np.ndarray) -> np.ndarray:
    a64 = a8[: len(a8) // 8 * 8].view(np.int64)
    n = len(keys)
    vals = np.ones((1, n), np.int64)
    progress = np.zeros(3, np.int64)
    K.rolling_aggregate_i64(
        a64,
        a8[: len(a8) // 4 * 4].view(np.int32),
        a8,
        a64.view(np.float64),
        0,
        base_w,
        np.zeros(n, np.uint16),  # every row in key group 0
        keys,
        np.zeros(2, np.int16),  # the instance owns both key groups
        0,
        0,  # sum
        vals,
        np.zeros(1, np.bool_),
        np.ones(1, np.bool_),
        np.empty(n, np.int64),
        np.empty_like(vals),
        progress,
        MAX_LOAD,
    )
    return progress


def test_a_key_group_loaded_during_a_pass_keeps_its_key_count():
    _pass(*_memory(64), np.arange(64, dtype=np.int64))  # compiled (or loaded from the cache) now
    n = 1 << 19
    while True:  # a pass that takes long enough to land a load inside it
        keys = np.random.default_rng(1).permutation(n).astype(np.int64)
        t0 = time.perf_counter()
        _pass(*_memory(n), keys)
        took = time.perf_counter() - t0
        if took > 0.05 or n >= 1 << 23:
            break
        n *= 2
    a8, base_w = _memory(n)
    a64 = a8[: len(a8) // 8 * 8].view(np.int64)
    done: list = []
    running = threading.Thread(target=lambda: done.append(_pass(a8, base_w, keys)))
    running.start()
    time.sleep(took / 3)
    a64[K.KG_WORDS + K.H_NKEYS] = 777  # another thread loads key group 1 meanwhile
    running.join()
    assert done[0][0] == n and done[0][2] == -1  # the whole batch, no key group full
    assert a64[K.H_NKEYS] == n  # its own key group's count is published
    assert a64[K.KG_WORDS + K.H_NKEYS] == 777  # the loaded one's is left as the load wrote it
