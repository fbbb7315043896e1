"""Numba kernels of the vectorized window aggregates (private; see stretch.runtime.operators.vector_window).

Each key's open windows live in one variable-length value of the operator's state: a ring of
window slots, ``[R, slot_0 .. slot_{R-1}]`` in int64 words, a slot being ``[window index, count,
acc_0 .. acc_{m-1}]`` (floats bit-cast). Window ``w`` lives in slot ``w & (R - 1)``; a slot is
free when its count is 0. When two open windows of a key need the same slot, the add kernel stops
and the caller doubles that key's ring. Word ``S_MAX_WINDOW`` of the column's per-key-group
header holds the key group's largest window index so far (biased so 0 means none), which bounds
the windows a watermark can fire.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from stretch.state._table_kernels import H_NKEYS, KG_WORDS, S_DATA_CAP, S_DATA_OFF, S_HEAP_OFF

SUM, MIN, MAX = 0, 1, 2
S_MAX_WINDOW = 7
WINDOW_BIAS = np.int64(1) << np.int64(62)
_OPTS = {"cache": True, "nogil": True}


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


@njit(**_OPTS)
def window_add(
    a64, af64, base_w, kgs, offs, ts, vals, ops, is_float, size, slide, offset, wm, late, progress
):
    """Fold each record into every window it belongs to that the watermark has not passed.

    ``progress`` is ``[record, resume window start, stopped, any live]``: the kernel starts at
    ``progress[0]`` (at window start ``progress[1]`` unless it is ``MIN``) and, when a key's ring
    has no free slot for a window, stops there with ``stopped = 1`` so the caller can grow it.
    ``late[i]`` says every window of record i was already past the watermark.
    """
    m = ops.shape[0]
    sw = 2 + m
    fvals = vals.view(np.float64)
    resume_none = np.int64(-(2**63))
    progress[2] = 0
    for i in range(progress[0], ts.shape[0]):
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
                    a64[s] = widx
                    for j in range(m):
                        a64[s + 2 + j] = vals[j, i]
                    mw = base_w + np.int64(kgs[i]) * KG_WORDS + S_MAX_WINDOW
                    a64[mw] = max(a64[mw], widx + WINDOW_BIAS)
                elif a64[s] != widx:
                    progress[0], progress[1], progress[2], progress[3] = i, start, 1, np.int64(any_live)
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
def window_fire(a64, dir_w, base_w, owned, lo, hi, m, out_kg, out_row, out_widx, out_cnt, out_acc, progress):
    """Emit and free every open window up to index ``hi`` of every key in the owned key groups,
    key by key (a key's windows in order), in one pass over the keys' rings. ``lo`` is the lowest
    window that can be open (the rest fired before): when ``lo .. hi`` is shorter than a ring,
    only those windows' slots are probed.

    Resumable: ``progress`` is ``[owned position, row, emitted]``; the kernel stops when the
    outputs cannot take a whole key's windows and returns with the position to continue from
    (and ``-k`` as emitted when they cannot take even one key's ``k`` windows).
    """
    sw = 2 + m
    cap = out_kg.shape[0]
    n = 0
    ki, r0 = progress[0], progress[1]
    order = np.empty(64, np.int64)
    while ki < owned.shape[0]:
        kg = owned[ki]
        h = base_w + kg * KG_WORDS
        nkeys = a64[dir_w + kg * KG_WORDS + H_NKEYS]
        for r in range(r0, nkeys):
            base = _ring_base(a64, h, r)
            if base < 0:
                continue
            ring = a64[base]
            if order.shape[0] < ring:
                order = np.empty(ring, np.int64)
            k = 0
            span = ring if lo <= hi - ring else hi - lo + 1  # (no overflow when lo is MIN)
            for q in range(span):
                s = base + 1 + (q if span == ring else (lo + q) & (ring - 1)) * sw
                if a64[s + 1] > 0 and a64[s] <= hi:
                    # insertion sort by window index: a key has few due windows
                    j = k
                    while j > 0 and a64[order[j - 1]] > a64[s]:
                        order[j] = order[j - 1]
                        j -= 1
                    order[j] = s
                    k += 1
            if k == 0:
                continue
            if n + k > cap:  # full; -k when not even this key's windows fit
                progress[0], progress[1], progress[2] = ki, r, n if n else -k
                return
            for j in range(k):
                s = order[j]
                out_kg[n], out_row[n], out_widx[n], out_cnt[n] = kg, r, a64[s], a64[s + 1]
                for c in range(m):
                    out_acc[c, n] = a64[s + 2 + c]
                a64[s + 1] = 0
                n += 1
        r0 = 0
        ki += 1
    progress[0], progress[1], progress[2] = ki, 0, n
