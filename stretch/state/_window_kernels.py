"""Numba kernels of the vectorized window aggregates (private; see stretch.runtime.operators.vector_window).

Each key's open windows live in one variable-length value of the operator's state: a ring of
window slots, ``[R, slot_0 .. slot_{R-1}]`` in int64 words, a slot being ``[window index, count,
acc_0 .. acc_{m-1}]`` (floats bit-cast). Window ``w`` lives in slot ``w & (R - 1)``; a slot is
free when its count is 0. When two open windows of a key need the same slot, the add kernel stops
and the caller doubles that key's ring.

Each key group also keeps an index of its open windows, a timer wheel: ``B`` buckets (a power of
two), window ``w`` in bucket ``w & (B - 1)``, a bucket being ``[window index, open count, bitmap
of rows]`` with a bit set for every row that has ``w`` open. A slot that opens sets its row's bit;
a watermark visits, per key group, only the buckets of the windows it fires and, in them, only the
set bits, in row order. Its cost is in proportion to the windows that fire (plus a word of bitmap
per 64 keys), not to the keys. The wheel is one block of a ``heap``-storage state (like the
timers' heaps), so it is copied, restored and moved with its key group like any other state. When
a bucket holds another open window, or a row lies beyond the bitmaps, the add kernel stops and the
caller grows the wheel. Word ``S_INDEXED`` of the index column's header says the key group's wheel
is complete (a key group restored from a snapshot taken without one is indexed from its rings
first, see ``window_index_rebuild``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from stretch.state._prefetch import prefetch
from stretch.state._table_kernels import H_KEYS_OFF, H_NKEYS, KG_WORDS, S_DATA_CAP, S_DATA_OFF, S_HEAP_OFF

SUM, MIN, MAX = 0, 1, 2
S_INDEXED = 7  # word of the index column's per-key-group header: 1 once the index holds every open window
RING_FULL, INDEX_FULL = 1, 2  # why window_add stopped
W_BUCKETS, W_WIDTH, W_HEAD = 0, 1, 2  # the wheel block: buckets, bitmap words per bucket, buckets from here
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DEBRUIJN_POS = np.array(
    [0, 1, 48, 2, 57, 49, 28, 3, 61, 58, 50, 42, 38, 29, 17, 4, 62, 55, 59, 36, 53, 51, 43, 22, 45, 39, 33,
     30, 24, 18, 12, 5, 63, 47, 56, 27, 60, 41, 37, 16, 54, 35, 52, 21, 44, 32, 23, 11, 46, 26, 40, 15,
     34, 20, 31, 10, 25, 14, 19, 9, 13, 8, 7, 6],
    dtype=np.int64,
)  # fmt: skip
_OPTS = {"cache": True, "nogil": True}
_AHEAD = 8  # records between a ring's prefetch and its use


@njit(inline="always", **_OPTS)
def _fold(a64, af64, w, v, fv, op, is_float):
    if is_float:
        if op == SUM:
            af64[w] += fv
        elif op == MIN:
            af64[w] = min(af64[w], fv)
        elif fv > af64[w]:
            af64[w] = fv
    elif op == SUM:
        a64[w] += v
    elif op == MIN:
        a64[w] = min(a64[w], v)
    elif v > a64[w]:
        a64[w] = v


@njit(inline="always", **_OPTS)
def _wheel(a64, ih):
    """Word offset of the wheel whose column header is at word ih, or -1 when it has none."""
    if a64[ih + S_DATA_CAP] == 0:
        return -1
    return a64[ih + S_DATA_OFF] >> 3


@njit(inline="always", **_OPTS)
def _mark(a64, wb, widx, row):
    """Set row's bit in window widx's bucket of the wheel at word wb; False when the wheel has no
    room for it (no wheel, the bucket holds another open window, or the row is beyond the bitmaps)."""
    if wb < 0:
        return False
    width = a64[wb + W_WIDTH]
    if row >= width * 64:
        return False
    b = wb + W_HEAD + (widx & (a64[wb + W_BUCKETS] - 1)) * (2 + width)
    if a64[b + 1] == 0:
        a64[b] = widx
    elif a64[b] != widx:
        return False
    a64[b + 1] += 1
    a64[b + 2 + (row >> 6)] |= np.int64(1) << (row & 63)
    return True


@njit(inline="always", **_OPTS)
def _lowest_bit(x):
    """Index of the lowest set bit of a non-zero int64."""
    u = np.uint64(x & -x)
    return _DEBRUIJN_POS[np.int64((u * _DEBRUIJN) >> np.uint64(58))]


@njit(**_OPTS)
def window_add(
    a64,
    af64,
    ibase_w,
    kgs,
    rows,
    offs,
    ts,
    vals,
    ops,
    is_float,
    size,
    slide,
    offset,
    ring0,
    wm,
    late,
    progress,
):
    """Fold each record into every window it belongs to that the watermark has not passed; a window
    that opens enters its key group's index.

    ``progress`` is ``[record, resume window start, stopped, any live]``: the kernel starts at
    ``progress[0]`` (at window start ``progress[1]`` unless it is ``MIN``) and stops before
    touching a window when the key's ring has no free slot for it (``stopped = RING_FULL``) or
    the key group's wheel has no room for it (``stopped = INDEX_FULL``), so the caller can grow
    that and resume.
    ``late[i]`` says every window of record i was already past the watermark. The ring lines of
    the record ``_AHEAD`` places on (its header, and its latest window's slot in a ring of the
    initial ``ring0`` slots) are prefetched, so the cache misses of records overlap.
    """
    m = ops.shape[0]
    sw = 2 + m
    fvals = vals.view(np.float64)
    resume_none = np.int64(-(2**63))
    progress[2] = 0
    n = ts.shape[0]
    for i in range(progress[0], n):
        if i + _AHEAD < n:
            ahead = offs[i + _AHEAD] >> 3
            u = ts[i + _AHEAD]
            prefetch(a64, ahead)
            prefetch(a64, ahead + 1 + (((u - (u - offset) % slide - offset) // slide) & (ring0 - 1)) * sw)
        t = ts[i]
        last = t - (t - offset) % slide
        start = last
        any_live = False
        if i == progress[0] and progress[1] != resume_none:
            start = progress[1]
            any_live = progress[3] != 0
        base = offs[i] >> 3
        ring = a64[base]
        while start > t - size:
            if start + size - 1 > wm:
                widx = (start - offset) // slide
                s = base + 1 + (widx & (ring - 1)) * sw
                cnt = a64[s + 1]
                if cnt == 0:
                    if not _mark(a64, _wheel(a64, ibase_w + np.int64(kgs[i]) * KG_WORDS), widx, rows[i]):
                        progress[0], progress[1], progress[2] = i, start, INDEX_FULL
                        progress[3] = np.int64(any_live)
                        return
                    a64[s] = widx
                    for j in range(m):
                        a64[s + 2 + j] = vals[j, i]
                elif a64[s] != widx:
                    progress[0], progress[1], progress[2] = i, start, RING_FULL
                    progress[3] = np.int64(any_live)
                    return
                else:
                    for j in range(m):
                        _fold(a64, af64, s + 2 + j, vals[j, i], fvals[j, i], ops[j], is_float[j])
                a64[s + 1] = cnt + 1
                any_live = True
            start -= slide
        late[i] = not any_live
    progress[0] = ts.shape[0]


@njit(inline="always", **_OPTS)
def _ring_base(a64, h, r):
    """Word offset of row r's ring in the column with header h, or -1 when it has none."""
    if r >= a64[h + S_DATA_CAP]:
        return -1
    vw = (a64[h + S_DATA_OFF] >> 3) + 2 * r
    if a64[vw + 1] == 0:
        return -1
    return (a64[h + S_HEAP_OFF] + a64[vw]) >> 3


@njit(**_OPTS)
def window_fire(
    a64,
    dir_w,
    base_w,
    ibase_w,
    owned,
    hi,
    m,
    ring0,
    out_kg,
    out_row,
    out_key,
    out_widx,
    out_cnt,
    out_acc,
    progress,
):
    """Emit and free every open window up to index ``hi`` of the owned key groups, key group by
    key group (in ``owned`` order), row by row, a row's windows in order; the caller orders the
    results by window. Only the wheel buckets of the due windows are read, and in them the rows
    whose bit is set: the work is in proportion to the windows that fire. Each row's ring is
    visited once for all its due windows; the rows' ring views, then their rings (where a ring of
    the initial ``ring0`` slots holds the first due window), are prefetched a key group at a time,
    so the cache misses overlap instead of following one another.

    A non-empty ``out_key`` takes each result's int64 key (a table of int64 keys, whose key
    groups' headers are at word ``dir_w``), read here beside the ring: gathered afterwards, the
    keys would be cache misses again, one after another.

    Resumable: ``progress`` is ``[owned position, emitted]``; the kernel stops when the outputs
    may not take a row's due windows and returns with the position to continue from (``-k`` as
    emitted when they cannot take even one row's ``k`` windows).
    """
    sw = 2 + m
    cap = out_kg.shape[0]
    keys = out_key.shape[0] > 0
    n = 0
    due = np.empty(16, np.int64)  # word offsets of a key group's due buckets, by window
    rows = np.empty(1024, np.int64)  # the rows with a due window, and their rings
    rings = np.empty(1024, np.int64)
    for ki in range(progress[0], owned.shape[0]):
        kg = owned[ki]
        wb = _wheel(a64, ibase_w + kg * KG_WORDS)
        if wb < 0:
            continue
        width = a64[wb + W_WIDTH]
        n_buckets = a64[wb + W_BUCKETS]
        if due.shape[0] < n_buckets:
            due = np.empty(n_buckets, np.int64)
        k = 0
        for q in range(n_buckets):
            b = wb + W_HEAD + q * (2 + width)
            if a64[b + 1] > 0 and a64[b] <= hi:
                j = k  # insertion sort by window: few are due at once
                while j > 0 and a64[due[j - 1]] > a64[b]:
                    due[j] = due[j - 1]
                    j -= 1
                due[j] = b
                k += 1
        if k == 0:
            continue
        h = base_w + kg * KG_WORDS
        if rows.shape[0] < width * 64:
            rows = np.empty(width * 64, np.int64)
            rings = np.empty(width * 64, np.int64)
        nr = 0
        views = (a64[h + S_DATA_OFF] >> 3) if a64[h + S_DATA_CAP] > 0 else 0
        kw = (a64[dir_w + kg * KG_WORDS + H_KEYS_OFF] >> 3) if keys else 0
        for j in range(width):  # the rows with a due window, their ring views prefetched
            x = np.int64(0)
            for d in range(k):
                x |= a64[due[d] + 2 + j]
            while x != 0:
                r = j * 64 + _lowest_bit(x)
                x &= x - 1
                rows[nr] = r
                if views:
                    prefetch(a64, views + 2 * r)
                if keys:
                    prefetch(a64, kw + r)
                nr += 1
        for i in range(nr):  # their rings, the lines to be read prefetched
            r = rows[i]
            rb = _ring_base(a64, h, r)
            rings[i] = rb
            if rb >= 0:
                prefetch(a64, rb)
                word, bit = 2 + (r >> 6), np.int64(1) << (r & 63)
                for d in range(k):  # the row's first due window, in a ring not grown
                    if a64[due[d] + word] & bit:
                        prefetch(a64, rb + 1 + (a64[due[d]] & (ring0 - 1)) * sw)
                        break
        for i in range(nr):
            rb = rings[i]
            if rb < 0:
                continue
            if n + k > cap:
                progress[0], progress[1] = ki, n if n else -k
                return  # (emitted windows' slots are free now: a resume skips them)
            r, size = rows[i], a64[rb] - 1
            word, bit = 2 + (r >> 6), np.int64(1) << (r & 63)
            for d in range(k):
                if a64[due[d] + word] & bit == 0:
                    continue
                w = a64[due[d]]
                s = rb + 1 + (w & size) * sw
                if a64[s + 1] == 0 or a64[s] != w:
                    continue  # emitted before a resume (or never: a set bit is an open slot)
                out_kg[n], out_row[n], out_widx[n], out_cnt[n] = kg, r, w, a64[s + 1]
                if keys:
                    out_key[n] = a64[kw + r]
                for c in range(m):
                    out_acc[c, n] = a64[s + 2 + c]
                a64[s + 1] = 0
                n += 1
        for d in range(k):  # every row of the due buckets was visited: empty them
            a64[due[d] + 1 : due[d] + 2 + width] = 0
    progress[0], progress[1] = owned.shape[0], n


@njit(**_OPTS)
def window_index_rebuild(a64, dir_w, base_w, ibase_w, kg, m):
    """Mark every open window slot of key group kg's rings in its (empty) wheel: for a key group
    whose wheel is not complete (restored from a snapshot taken without one). False when the wheel
    has no room for them all (the caller grows it and tries again)."""
    sw = 2 + m
    h = base_w + kg * KG_WORDS
    wb = _wheel(a64, ibase_w + kg * KG_WORDS)
    for r in range(a64[dir_w + kg * KG_WORDS + H_NKEYS]):
        rb = _ring_base(a64, h, r)
        if rb < 0:
            continue
        for q in range(a64[rb]):
            s = rb + 1 + q * sw
            if a64[s + 1] > 0 and not _mark(a64, wb, a64[s], r):
                return False
    return True
