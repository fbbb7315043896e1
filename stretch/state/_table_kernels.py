"""Numba kernels over the state arena (private; see :mod:`stretch.state.keyed_table`).

The arena is one shared-memory segment seen as typed numpy views (``a64`` int64, ``a32`` int32,
``a8`` uint8, ...). A key group's header is ``KG_WORDS`` int64 words at ``dir_w + kg * KG_WORDS``
(word offsets); every other structure is addressed by the byte offsets stored in that header.
Kernels never allocate: the Python side grows structures first, so a kernel always has room.
Each key group has one writer (its owner), so no kernel needs atomics.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from stretch.state._hash_kernels import xxh64_span
from stretch.state._prefetch import prefetch

# Key-group header layout (int64 words).
KG_WORDS = 512
H_VERSION, H_NKEYS, H_INDEX_OFF, H_INDEX_CAP, H_KEYS_OFF, H_KEYS_CAP = 0, 1, 2, 3, 4, 5
H_KHEAP_OFF, H_KHEAP_USED, H_KHEAP_CAP, H_KHASH_OFF = 6, 7, 8, 9
# 1: the key group's state is not (wholly) in this arena: a cluster node that does not own it, or is
# loading it from another node. An instance owns key groups of every node's share (its ownership
# table covers all of them), so its timers, windows and checkpoints leave such key groups alone.
H_AWAY = 10
# Rows at the end of the key capacity whose memory is not reserved in /dev/shm yet: the key column,
# and each state column that holds one entry per key, are reserved up to row H_KEYS_CAP - H_UNRESERVED
# only (a capacity doubles; reserving all of it held up to twice the state). Inserts stop short of
# the unreserved rows, and the Python side reserves more (``KeyedTable.reserve_rows``). 0: all.
H_UNRESERVED = 11
STATE_BASE, STATE_WORDS = 16, 8
MAX_STATES = (KG_WORDS - STATE_BASE) // STATE_WORDS
# Per-state column words (relative to the state's base).
S_DATA_OFF, S_DATA_CAP, S_VALID_OFF, S_HEAP_OFF, S_HEAP_USED, S_HEAP_CAP, S_HEAP_GARBAGE = 0, 1, 2, 3, 4, 5, 6

MIN_VAR_ALLOC = 16
_OPTS = {"cache": True, "nogil": True}
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_INDEX_SEED = np.uint64(0x5354524554434821)


@njit(inline="always", **_OPTS)
def _mix(k):
    """Murmur3's 64-bit finaliser: spreads int keys over index slots (independent of the kg hash)."""
    k ^= k >> _S33
    k *= _M1
    k ^= k >> _S33
    k *= _M2
    k ^= k >> _S33
    return k


@njit(**_OPTS)
def var_alloc_size(length):
    """Bytes reserved for a variable-length value: the next power of two, so appends amortise."""
    size = MIN_VAR_ALLOC
    while size < length:
        size *= 2
    return size


# ---- key index: int64 keys ---------------------------------------------------------------


@njit(**_OPTS)
def lookup_i64(a64, a32, dir_w, kgs, keys, rows, insert):
    """Row of each key in its key group's table (inserting new keys if ``insert``, else -1)."""
    for i in range(kgs.shape[0]):
        h = dir_w + np.int64(kgs[i]) * KG_WORDS
        key = keys[i]
        if a64[h + H_INDEX_CAP] == 0:  # a key group that never held a key (lookups only)
            rows[i] = -1
            continue
        idx = a64[h + H_INDEX_OFF] >> 2
        mask = a64[h + H_INDEX_CAP] - 1
        kw = a64[h + H_KEYS_OFF] >> 3
        s = np.int64(_mix(np.uint64(key)) & np.uint64(mask))
        while True:
            r = a32[idx + s]
            if r == 0:
                if insert:
                    row = a64[h + H_NKEYS]
                    a64[kw + row] = key
                    a32[idx + s] = row + 1
                    a64[h + H_NKEYS] = row + 1
                else:
                    row = -1
                break
            if a64[kw + r - 1] == key:
                row = r - 1
                break
            s = (s + 1) & mask
        rows[i] = row


@njit(**_OPTS)
def rehash_i64(a64, a32, h, new_idx_off, new_cap):
    """Fill a fresh (zeroed) index of ``new_cap`` slots from the key column of header word ``h``."""
    idx = new_idx_off >> 2
    mask = new_cap - 1
    kw = a64[h + H_KEYS_OFF] >> 3
    for row in range(a64[h + H_NKEYS]):
        s = np.int64(_mix(np.uint64(a64[kw + row])) & np.uint64(mask))
        while a32[idx + s] != 0:
            s = (s + 1) & mask
        a32[idx + s] = row + 1


# ---- key index: byte-string keys ---------------------------------------------------------


@njit(**_OPTS)
def _bytes_equal(a8, off, data, start, length):
    for j in range(length):  # noqa: SIM110 - an explicit loop compiles to a tight numba loop
        if a8[off + j] != data[start + j]:
            return False
    return True


@njit(**_OPTS)
def lookup_bytes(a64, a32, a8, dir_w, kgs, offsets, data, rows, insert):
    """Like lookup_i64 for keys given as Arrow binary (offsets, data); keys are copied on insert."""
    for i in range(kgs.shape[0]):
        h = dir_w + np.int64(kgs[i]) * KG_WORDS
        start = np.int64(offsets[i])
        length = np.int64(offsets[i + 1]) - start
        if a64[h + H_INDEX_CAP] == 0:
            rows[i] = -1
            continue
        hv = xxh64_span(data, start, length, _INDEX_SEED)
        idx = a64[h + H_INDEX_OFF] >> 2
        mask = a64[h + H_INDEX_CAP] - 1
        kw = a64[h + H_KEYS_OFF] >> 3
        hw = a64[h + H_KHASH_OFF] >> 3
        s = np.int64(hv & np.uint64(mask))
        while True:
            r = a32[idx + s]
            if r == 0:
                if insert:
                    row = a64[h + H_NKEYS]
                    used = a64[h + H_KHEAP_USED]
                    dst = a64[h + H_KHEAP_OFF] + used
                    for j in range(length):
                        a8[dst + j] = data[start + j]
                    a64[h + H_KHEAP_USED] = used + length
                    a64[kw + 2 * row] = used
                    a64[kw + 2 * row + 1] = length
                    a64[hw + row] = np.int64(hv)
                    a32[idx + s] = row + 1
                    a64[h + H_NKEYS] = row + 1
                else:
                    row = -1
                break
            row = r - 1
            if (
                a64[hw + row] == np.int64(hv)
                and a64[kw + 2 * row + 1] == length
                and _bytes_equal(a8, a64[h + H_KHEAP_OFF] + a64[kw + 2 * row], data, start, length)
            ):
                break
            s = (s + 1) & mask
        rows[i] = row


@njit(**_OPTS)
def rehash_bytes(a64, a32, h, new_idx_off, new_cap):
    idx = new_idx_off >> 2
    mask = new_cap - 1
    hw = a64[h + H_KHASH_OFF] >> 3
    for row in range(a64[h + H_NKEYS]):
        s = np.int64(np.uint64(a64[hw + row]) & np.uint64(mask))
        while a32[idx + s] != 0:
            s = (s + 1) & mask
        a32[idx + s] = row + 1


# ---- batch-local dedup -------------------------------------------------------------------


@njit(**_OPTS)
def dedup(kgs, rows, scratch, uidx, first):
    """Map each row to a batch-unique key slot; returns the number of unique keys.

    ``scratch`` is a zeroed int64 array whose length is a power of two >= 2 * len(rows);
    ``first[u]`` receives the first position of unique key ``u``.
    """
    mask = scratch.shape[0] - 1
    n_unique = 0
    for i in range(kgs.shape[0]):
        code = (np.int64(kgs[i]) << 40) | rows[i]
        s = np.int64(_mix(np.uint64(code)) & np.uint64(mask))
        while True:
            e = scratch[s]
            if e == 0:
                scratch[s] = n_unique + 1
                first[n_unique] = i
                uidx[i] = n_unique
                n_unique += 1
                break
            f = first[e - 1]
            if kgs[f] == kgs[i] and rows[f] == rows[i]:
                uidx[i] = e - 1
                break
            s = (s + 1) & mask
    return n_unique


# ---- fixed-width state columns -----------------------------------------------------------


@njit(**_OPTS)
def gather_fixed(view, shift, a64, a8, base_w, kgs, rows, out, valid):
    """Read one fixed-width state column for each (kg, row); ``valid`` 0 where unset."""
    for i in range(kgs.shape[0]):
        h = base_w + np.int64(kgs[i]) * KG_WORDS
        r = rows[i]
        if r < a64[h + S_DATA_CAP]:
            v = a8[a64[h + S_VALID_OFF] + r]
            valid[i] = v
            if v:
                out[i] = view[(a64[h + S_DATA_OFF] >> shift) + r]
        else:
            valid[i] = 0


@njit(**_OPTS)
def scatter_fixed(view, shift, a64, a8, base_w, kgs, rows, values, valid):
    """Write one fixed-width state column for each (kg, row) (capacity ensured by the caller)."""
    for i in range(kgs.shape[0]):
        h = base_w + np.int64(kgs[i]) * KG_WORDS
        r = rows[i]
        a8[a64[h + S_VALID_OFF] + r] = valid[i]
        if valid[i]:
            view[(a64[h + S_DATA_OFF] >> shift) + r] = values[i]


# ---- variable-length state columns -------------------------------------------------------
# A value's view is two words: its offset in the column's heap, and (length + 1) with the log2 of
# its allocation in the top byte. Word two is 0 for "unset" (then there is no allocation).

_LEN_MASK = (1 << 56) - 1


@njit(inline="always", **_OPTS)
def _view_len(w):
    return (w & _LEN_MASK) - 1


@njit(inline="always", **_OPTS)
def _view_cap(w):
    return 0 if w == 0 else np.int64(1) << (w >> 56)


@njit(inline="always", **_OPTS)
def _view_word(length, cap):
    e = 0
    while (np.int64(1) << e) < cap:
        e += 1
    return (length + 1) | (np.int64(e) << 56)


@njit(**_OPTS)
def var_views(a64, base_w, kgs, rows, out_off, out_len):
    """Absolute offset and length of each value; length -1 where the value is unset."""
    for i in range(kgs.shape[0]):
        h = base_w + np.int64(kgs[i]) * KG_WORDS
        r = rows[i]
        out_len[i] = -1
        out_off[i] = 0
        if r < a64[h + S_DATA_CAP]:
            vw = (a64[h + S_DATA_OFF] >> 3) + 2 * r
            w = a64[vw + 1]
            if w != 0:
                out_len[i] = _view_len(w)
                out_off[i] = a64[h + S_HEAP_OFF] + a64[vw]


@njit(inline="always", **_OPTS)
def _target(old_len, old_cap, n, append):
    """(new length, whether it fits the current allocation) for a write of n bytes."""
    new = old_len + n if append and old_len > 0 else n
    return new, old_cap > 0 and new <= old_cap


@njit(**_OPTS)
def var_demand(a64, base_w, kgs, rows, lengths, appends, demand):
    """Heap bytes the writes need at the end of each key group's heap (0 where they fit in place)."""
    for i in range(kgs.shape[0]):
        if lengths[i] < 0:
            continue
        h = base_w + np.int64(kgs[i]) * KG_WORDS
        w = 0
        if rows[i] < a64[h + S_DATA_CAP]:
            w = a64[(a64[h + S_DATA_OFF] >> 3) + 2 * rows[i] + 1]
        new, fits = _target(_view_len(w), _view_cap(w), lengths[i], appends[i])
        if not fits:
            demand[np.int64(kgs[i])] += var_alloc_size(new)


@njit(**_OPTS)
def var_write(a64, a8, base_w, kgs, rows, lengths, appends, payload, payload_off):
    """Write (or append to) each value; length -1 clears. Heap room is ensured by the caller."""
    for i in range(kgs.shape[0]):
        h = base_w + np.int64(kgs[i]) * KG_WORDS
        vw = (a64[h + S_DATA_OFF] >> 3) + 2 * rows[i]
        heap = a64[h + S_HEAP_OFF]
        w = a64[vw + 1]
        old_len, old_cap = _view_len(w), _view_cap(w)
        n = lengths[i]
        src = payload_off[i]
        if n < 0:
            a64[h + S_HEAP_GARBAGE] += old_cap
            a64[vw + 1] = 0
            continue
        new, fits = _target(old_len, old_cap, n, appends[i])
        keep = old_len if appends[i] and old_len > 0 else 0  # bytes of the old value kept in front
        if fits:
            dst = heap + a64[vw]
            cap = old_cap
        else:
            cap = var_alloc_size(new)
            used = a64[h + S_HEAP_USED]
            dst = heap + used
            if keep:
                src_old = heap + a64[vw]
                for j in range(keep):
                    a8[dst + j] = a8[src_old + j]
            a64[h + S_HEAP_USED] = used + cap
            a64[h + S_HEAP_GARBAGE] += old_cap
            a64[vw] = used
        for j in range(n):
            a8[dst + keep + j] = payload[src + j]
        a64[vw + 1] = _view_word(new, cap)


@njit(**_OPTS)
def var_compact(a64, a8, h, n_rows, new_heap_off):
    """Copy the live values of one column into a fresh heap; returns the bytes used there."""
    vw0 = a64[h + S_DATA_OFF] >> 3
    old_heap = a64[h + S_HEAP_OFF]
    used = 0
    for r in range(min(n_rows, a64[h + S_DATA_CAP])):
        w = a64[vw0 + 2 * r + 1]
        if w == 0:
            continue
        n = _view_len(w)
        src = old_heap + a64[vw0 + 2 * r]
        for j in range(n):
            a8[new_heap_off + used + j] = a8[src + j]
        cap = var_alloc_size(n)
        a64[vw0 + 2 * r] = used
        a64[vw0 + 2 * r + 1] = _view_word(n, cap)
        used += cap
    return used


# ---- fused rolling aggregation -------------------------------------------------------------


_CHUNK = 256


@njit(inline="always", **_OPTS)
def _fold_chunk(a64, af64, ptr, fresh, src, c, m, vals, fvals, is_float, is_acc, op, out, fout):
    """Fold the chunk's rows into their keys' records, field by field.

    A key's numeric fields are one record of k contiguous 8-byte words (``ptr[q]`` is the record
    of chunk row q, ``fresh[q]`` says the key was new). Accumulated fields (``is_acc``) fold in
    the value with ``op`` (0 sum, 1 min, 2 max); the others keep the key's first value. Looping
    field by field over a chunk keeps the per-field decisions out of the per-row loop while the
    chunk's records are still in cache. Float fields travel bit-cast in the int64 arrays.
    """
    for j in range(vals.shape[0]):
        acc = is_acc[j]
        if is_float[j]:
            for q in range(c):
                p = ptr[q] + j
                v = fvals[j, src[q]]
                if fresh[q]:
                    af64[p] = v
                elif acc:
                    if op == 0:
                        af64[p] += v
                    elif op == 1:
                        af64[p] = min(af64[p], v)
                    else:
                        af64[p] = max(af64[p], v)
                fout[j, m + q] = af64[p]
        else:
            for q in range(c):
                p = ptr[q] + j
                v = vals[j, src[q]]
                if fresh[q]:
                    a64[p] = v
                elif acc:
                    if op == 0:
                        a64[p] += v
                    elif op == 1:
                        a64[p] = min(a64[p], v)
                    else:
                        a64[p] = max(a64[p], v)
                out[j, m + q] = a64[p]


@njit(inline="always", **_OPTS)
def _record_of(a64, a8, h, r, k, ptr, fresh, c):
    """Locate row r's record in the column at header word h; mark it valid."""
    ptr[c] = (a64[h + S_DATA_OFF] >> 3) + r * k
    vb = a64[h + S_VALID_OFF] + r
    fresh[c] = a8[vb] == 0
    a8[vb] = 1


# Per-key-group fields the fused pass keeps in a small local table (word offsets, counts), so a row
# never reads the key group's 4 KiB header page: index, index mask, keys, keys in use, room left,
# records, validity bytes, keys in use when the pass began.
_L_INDEX, _L_MASK, _L_KEYS, _L_N, _L_ROOM, _L_REC, _L_VALID, _L_N0 = 0, 1, 2, 3, 4, 5, 6, 7


@njit(**_OPTS)
def rolling_aggregate_i64(
    a64,
    a32,
    a8,
    af64,
    dir_w,
    base_w,
    kgs,
    keys,
    owners,
    me,
    op,
    vals,
    is_float,
    is_acc,
    pos,
    out,
    progress,
    max_load,
):
    """Flink's rolling sum/min/max over a whole batch in one pass, for int64 keys.

    For each row whose key group this instance owns: find or insert the key and fold the row into
    the key's record in state column ``base_w``. ``vals``/``out`` are (k, n) int64 arrays; outputs
    are compacted to the owned rows, whose batch positions go to ``pos``. A key is new exactly when
    this pass inserts it (the record state exists before the operator's first key), so existing
    keys never read their validity byte.

    Resumable: ``progress`` holds (next row, outputs so far, key group that needs room or -1). When
    a key group's table is full, or its reserved rows are taken, the pass stops there; the caller
    grows it and calls again.
    """
    k = vals.shape[0]
    fvals, fout = vals.view(np.float64), out.view(np.float64)
    maxp = owners.shape[0]
    local = np.zeros((maxp, 8), np.int64)
    for kg in range(maxp):
        if owners[kg] == me:
            h = dir_w + kg * KG_WORDS
            hs = base_w + kg * KG_WORDS
            local[kg, _L_INDEX] = a64[h + H_INDEX_OFF] >> 2
            local[kg, _L_MASK] = a64[h + H_INDEX_CAP] - 1
            local[kg, _L_KEYS] = a64[h + H_KEYS_OFF] >> 3
            local[kg, _L_N] = local[kg, _L_N0] = a64[h + H_NKEYS]
            local[kg, _L_ROOM] = min(
                a64[h + H_KEYS_CAP] - a64[h + H_UNRESERVED],
                a64[hs + S_DATA_CAP],
                np.int64(a64[h + H_INDEX_CAP] * max_load),
            )
            local[kg, _L_REC] = a64[hs + S_DATA_OFF] >> 3
            local[kg, _L_VALID] = a64[hs + S_VALID_OFF]
    ptr = np.empty(_CHUNK, np.int64)
    fresh = np.empty(_CHUNK, np.bool_)
    slots = np.empty(_CHUNK, np.int64)
    n = kgs.shape[0]
    i, m = progress[0], progress[1]
    progress[2] = -1
    while i < n and progress[2] < 0:
        # 1. pick the chunk's owned rows, hash them and prefetch their index slots
        c = 0
        while i < n and c < _CHUNK:
            kg = np.int64(kgs[i])
            if owners[kg] == me:
                mask = local[kg, _L_MASK]
                if mask >= 0:
                    slot = np.int64(_mix(np.uint64(keys[i])) & np.uint64(mask))
                    slots[c] = slot
                    prefetch(a32, local[kg, _L_INDEX] + slot)
                pos[m + c] = i
                c += 1
            i += 1
        # 2. find or insert each key, prefetch its record
        done = 0
        for q in range(c):
            row = pos[m + q]
            kg = np.int64(kgs[row])
            key = keys[row]
            mask = local[kg, _L_MASK]
            r = -1
            new = False
            if mask >= 0:
                idx, kw = local[kg, _L_INDEX], local[kg, _L_KEYS]
                s = slots[q]
                while True:
                    e = a32[idx + s]
                    if e == 0:
                        nk = local[kg, _L_N]
                        if nk < local[kg, _L_ROOM]:
                            a64[kw + nk] = key
                            a32[idx + s] = nk + 1
                            local[kg, _L_N] = nk + 1
                            r = nk
                            new = True
                        break
                    if a64[kw + e - 1] == key:
                        r = e - 1
                        break
                    s = (s + 1) & mask
            if r < 0:  # table full: stop before this row, the caller grows it and resumes
                progress[2] = kg
                i = row
                break
            p = local[kg, _L_REC] + r * k
            ptr[q] = p
            fresh[q] = new
            if new:
                a8[local[kg, _L_VALID] + r] = 1
            else:
                prefetch(a64, p)
            done += 1
        # 3. fold the rows into their records
        _fold_chunk(
            a64, af64, ptr, fresh, pos[m : m + done], done, m, vals, fvals, is_float, is_acc, op, out, fout
        )
        m += done
    # publish the key counts of the key groups this pass inserted into, and only those: ``owners``
    # covers every key group, also those that another thread may be loading into this arena
    # meanwhile (a node adopting key groups), whose counts this pass read before the load
    for kg in range(maxp):
        if owners[kg] == me and local[kg, _L_N] != local[kg, _L_N0]:
            a64[dir_w + kg * KG_WORDS + H_NKEYS] = local[kg, _L_N]
    progress[0], progress[1] = i, m


@njit(**_OPTS)
def rolling_records(a64, a8, af64, base_w, kgs, rows, vals, is_float, is_acc, op, out):
    """The same fold for rows already located (any key type); every row is this instance's."""
    k = vals.shape[0]
    fvals, fout = vals.view(np.float64), out.view(np.float64)
    ptr = np.empty(_CHUNK, np.int64)
    fresh = np.empty(_CHUNK, np.bool_)
    n = kgs.shape[0]
    for start in range(0, n, _CHUNK):
        c = min(_CHUNK, n - start)
        for q in range(c):
            i = start + q
            _record_of(a64, a8, base_w + np.int64(kgs[i]) * KG_WORDS, rows[i], k, ptr, fresh, q)
        src = np.arange(start, start + c)
        _fold_chunk(a64, af64, ptr, fresh, src, c, start, vals, fvals, is_float, is_acc, op, out, fout)


# ---- timers: a binary min-heap of (timestamp, row) per key group --------------------------
# The heap lives in a state column's data block: entries of two words, S_HEAP_USED counts them.


@njit(inline="always", **_OPTS)
def _heap_less(a64, base, i, j):
    ti, tj = a64[base + 2 * i], a64[base + 2 * j]
    return ti < tj or (ti == tj and a64[base + 2 * i + 1] < a64[base + 2 * j + 1])


@njit(inline="always", **_OPTS)
def _heap_swap(a64, base, i, j):
    t, r = a64[base + 2 * i], a64[base + 2 * i + 1]
    a64[base + 2 * i], a64[base + 2 * i + 1] = a64[base + 2 * j], a64[base + 2 * j + 1]
    a64[base + 2 * j], a64[base + 2 * j + 1] = t, r


@njit(**_OPTS)
def heap_push(a64, base_w, kgs, rows, stamps):
    """Push (stamp, row) into each key group's heap (room ensured by the caller)."""
    for i in range(kgs.shape[0]):
        h = base_w + np.int64(kgs[i]) * KG_WORDS
        base = a64[h + S_DATA_OFF] >> 3
        n = a64[h + S_HEAP_USED]
        a64[base + 2 * n] = stamps[i]
        a64[base + 2 * n + 1] = rows[i]
        c = n
        while c > 0:
            parent = (c - 1) // 2
            if not _heap_less(a64, base, c, parent):
                break
            _heap_swap(a64, base, c, parent)
            c = parent
        a64[h + S_HEAP_USED] = n + 1


@njit(**_OPTS)
def heap_pop_due(a64, base_w, kg, limit, out_stamps, out_rows):
    """Pop every entry of key group kg with stamp <= limit (up to the outputs' size), in order."""
    h = base_w + np.int64(kg) * KG_WORDS
    base = a64[h + S_DATA_OFF] >> 3
    n = a64[h + S_HEAP_USED]
    k = 0
    while n > 0 and k < out_stamps.shape[0] and a64[base] <= limit:
        out_stamps[k] = a64[base]
        out_rows[k] = a64[base + 1]
        k += 1
        n -= 1
        a64[base], a64[base + 1] = a64[base + 2 * n], a64[base + 2 * n + 1]
        c = 0
        while True:
            left = 2 * c + 1
            if left >= n:
                break
            small = left
            if left + 1 < n and _heap_less(a64, base, left + 1, left):
                small = left + 1
            if not _heap_less(a64, base, small, c):
                break
            _heap_swap(a64, base, c, small)
            c = small
    a64[h + S_HEAP_USED] = n
    return k


@njit(**_OPTS)
def heap_heads(a64, base_w, owned, out):
    """The smallest stamp of each listed key group's heap (int64 max where empty)."""
    for i in range(owned.shape[0]):
        h = base_w + owned[i] * KG_WORDS
        if a64[h + S_HEAP_USED] > 0:
            out[i] = a64[a64[h + S_DATA_OFF] >> 3]
        else:
            out[i] = 9223372036854775807
