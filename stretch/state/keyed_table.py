"""Per-key-group keyed state tables in the arena: a key index plus one column per declared state.

Each key group has its own table (key column, open-addressing index, state columns), written only
by the instance that owns the key group; ownership moves by rewriting the ownership table, never by
copying these bytes. Everything here works on whole batches: the Python side sizes structures, the
numba kernels in ``_table_kernels`` do the per-row work.
"""

from __future__ import annotations

import time
from enum import IntEnum

import numpy as np
import pyarrow as pa

from stretch.state import _table_kernels as K
from stretch.state.arena import Arena
from stretch.state.key_codec import decode_key, encode_key

MAX_LOAD = 0.7
_MIN_ROWS = 64
# Rows are reserved a sixteenth more at a time, or 1024 rows if that is more, in whole pages of
# int64 keys: memory held stays within 1/16 of the rows taken plus 1024 rows a key group, and a
# growing key group stops a fused pass for more rows a few dozen times in its life, not per batch.
_RESERVE_PART = 16
_RESERVE_MIN = 1024
_RESERVE_ROWS = 512


class KeyMode(IntEnum):
    """How an operator's keys are stored: int64 values, or byte strings decoded as str/bytes/objects."""

    INT64 = 1
    UTF8 = 2
    BINARY = 3
    CANONICAL = 4  # stretch.state.key_codec encoding: tuples, floats, mixed types


def key_mode_of(arrow_type: pa.DataType) -> KeyMode:
    """The key mode for a key column of this Arrow type."""
    if pa.types.is_integer(arrow_type) or pa.types.is_boolean(arrow_type):
        return KeyMode.INT64
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return KeyMode.UTF8
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return KeyMode.BINARY
    raise TypeError(f"keys of Arrow type {arrow_type} cannot be stored; key by an int, str or bytes field")


_KEY_TYPE_NAMES = {
    KeyMode.INT64: "int",
    KeyMode.UTF8: "str",
    KeyMode.BINARY: "bytes",
    KeyMode.CANONICAL: "tuple, float, None or mixed",
}


def key_type_name(mode: KeyMode) -> str:
    """How errors name the keys a mode stores."""
    return _KEY_TYPE_NAMES[mode]


def stored_mode_of(key: object) -> KeyMode:
    """The mode a Python key is stored in when a batch holds only keys of its type."""
    if isinstance(key, bool) or (isinstance(key, int) and -(1 << 63) <= key < 1 << 63):
        return KeyMode.INT64
    if isinstance(key, str):
        return KeyMode.UTF8
    if isinstance(key, bytes):
        return KeyMode.BINARY
    return KeyMode.CANONICAL


def fits_mode(key: object, mode: KeyMode) -> bool:
    """Whether an operator whose keys are stored in ``mode`` can hold this key (a canonical one
    holds any key; the others, keys of their own type)."""
    return mode is KeyMode.CANONICAL or stored_mode_of(key) is mode


def key_array(keys: list, mode: KeyMode) -> pa.Array:
    """Keys that fit ``mode`` as a key column of that mode (for a batch sent in another mode)."""
    if mode is KeyMode.CANONICAL:
        return pa.array([encode_key(k) for k in keys], pa.large_binary())
    arrow = {KeyMode.INT64: pa.int64(), KeyMode.UTF8: pa.large_string(), KeyMode.BINARY: pa.large_binary()}
    return pa.array(keys, arrow[mode])


def pow2(n: int) -> int:
    """The smallest power of two >= n (at least 2)."""
    return 1 << max(int(n) - 1, 1).bit_length()


def writable(a: np.ndarray) -> np.ndarray:
    """Kernels are compiled for writable arrays; zero-copy views of Arrow buffers are read-only."""
    return a if a.flags.writeable else a.copy()


def binary_buffers(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(int64 offsets, uint8 data) of a string/binary array, zero-copy for large types."""
    if column.null_count:
        raise ValueError("a key is null; keys must not be null")
    if pa.types.is_string(column.type):
        column = column.cast(pa.large_string())
    elif pa.types.is_binary(column.type):
        column = column.cast(pa.large_binary())
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64, count=len(column) + 1, offset=column.offset * 8)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    return writable(offsets), writable(data)


class KeyedTable:
    """Batch operations on one operator's key-group tables (used by the owning instances)."""

    def __init__(self, arena: Arena):
        self.arena = arena
        self.headers = arena.headers
        self.maxp = arena.max_parallelism

    # ---- keys --------------------------------------------------------------------------
    def mode(self) -> KeyMode | None:
        m = self.arena.key_mode()
        return KeyMode(m) if m else None

    def claim_mode(self, mode: KeyMode, example=None) -> None:
        """Fix the operator's key type on first use; keys of another type later are an error."""
        held = self.arena.claim_key_mode(int(mode))
        if held != mode:
            hint = f" (key {example!r})" if example is not None else ""
            raise TypeError(
                f"keys of this operator are {KeyMode(held).name.lower()} but a {mode.name.lower()} key "
                f"arrived{hint}; one operator's keys must share one type, as in Flink"
            )

    def rows(self, kgs: np.ndarray, keys, mode: KeyMode, insert: bool = True) -> np.ndarray:
        """Row of each key within its key group's table; new keys get rows if ``insert`` (else -1)."""
        self.claim_mode(mode)
        kgs = writable(kgs)
        n = len(kgs)
        rows = np.empty(n, dtype=np.int64)
        if mode is KeyMode.INT64:
            values = writable(keys if isinstance(keys, np.ndarray) else _int64_keys(keys))
            if insert:
                self._ensure_keys(kgs, None)
            K.lookup_i64(self.arena.a64, self.arena.a32, self.arena.dir_w, kgs, values, rows, insert)
        else:
            offsets, data = keys if isinstance(keys, tuple) else binary_buffers(keys)
            if insert:
                self._ensure_keys(kgs, np.diff(offsets))
            K.lookup_bytes(
                self.arena.a64,
                self.arena.a32,
                self.arena.a8,
                self.arena.dir_w,
                kgs,
                offsets,
                data,
                rows,
                insert,
            )
        return rows

    def _ensure_keys(self, kgs: np.ndarray, key_lengths: np.ndarray | None) -> None:
        self.ensure_key_room(np.bincount(kgs, minlength=self.maxp), kgs, key_lengths)

    def ensure_key_room(self, counts: np.ndarray, kgs=None, key_lengths=None) -> None:
        """Grow the key structures of key groups about to receive up to ``counts`` new keys."""
        h = self.headers
        need = h[:, K.H_NKEYS] + counts
        reserved = h[:, K.H_KEYS_CAP] - h[:, K.H_UNRESERVED]
        short = (need > reserved) | (need > h[:, K.H_INDEX_CAP] * MAX_LOAD)
        heap_need = None
        if key_lengths is not None:
            heap_need = h[:, K.H_KHEAP_USED] + np.bincount(
                kgs, weights=key_lengths, minlength=self.maxp
            ).astype(np.int64)
            short |= heap_need > h[:, K.H_KHEAP_CAP]
        for kg in np.flatnonzero(short):
            self._grow_keys(int(kg), int(need[kg]), None if heap_need is None else int(heap_need[kg]))

    def grow_for(self, kg: int, sid: int, width: int) -> None:
        """Give key group `kg` room for another key, and state `sid`'s column its key capacity (a
        fused pass found no room)."""
        h = self.headers[kg]
        n = int(h[K.H_NKEYS])
        full = n >= h[K.H_KEYS_CAP] or n >= int(h[K.H_INDEX_CAP] * MAX_LOAD)
        # a full table doubles its keys' room (and index) as it always did; otherwise the pass
        # took the rows reserved so far, and only more are reserved
        self._grow_keys(kg, n + 1, None, max(2 * n, _MIN_ROWS) if full else None)
        if self._state_words(sid)[kg, K.S_DATA_CAP] < h[K.H_KEYS_CAP]:
            self.ensure_columns(sid, np.array([kg]), width)

    def _grow_keys(self, kg: int, need_rows: int, need_heap: int | None, room: int | None = None) -> None:
        """Reserve ``need_rows`` rows of key group `kg`, its key capacity and index sized for
        ``room`` rows (``need_rows`` if None), and its key heap ``need_heap`` bytes."""
        a = self.arena
        h = self.headers[kg]
        n = int(h[K.H_NKEYS])
        byte_keys = need_heap is not None
        room = need_rows if room is None else room
        if room > h[K.H_KEYS_CAP]:
            cap = pow2(max(room, _MIN_ROWS))
            width = 16 if byte_keys else 8
            h[K.H_KEYS_OFF] = self._move(
                int(h[K.H_KEYS_OFF]), int(h[K.H_KEYS_CAP]) * width, n * width, cap * width, n * width
            )
            if byte_keys:
                h[K.H_KHASH_OFF] = self._move(
                    int(h[K.H_KHASH_OFF]), int(h[K.H_KEYS_CAP]) * 8, n * 8, cap * 8, n * 8
                )
            h[K.H_KEYS_CAP] = cap
            h[K.H_UNRESERVED] = cap - n  # the new blocks hold the live rows; reserve_rows adds more
        if need_rows > h[K.H_KEYS_CAP] - h[K.H_UNRESERVED]:
            self.reserve_rows(kg, need_rows)
        if room > h[K.H_INDEX_CAP] * MAX_LOAD:
            cap = pow2(max(int(room / MAX_LOAD) + 1, _MIN_ROWS))
            off = a.alloc(cap * 4)
            w = a.dir_w + kg * K.KG_WORDS
            (K.rehash_bytes if byte_keys else K.rehash_i64)(a.a64, a.a32, w, off, cap)
            a.free(int(h[K.H_INDEX_OFF]), int(h[K.H_INDEX_CAP]) * 4)
            h[K.H_INDEX_OFF] = off
            h[K.H_INDEX_CAP] = cap
        if byte_keys and need_heap > h[K.H_KHEAP_CAP]:
            cap = pow2(max(need_heap, 4096))
            used = int(h[K.H_KHEAP_USED])
            h[K.H_KHEAP_OFF] = self._move(int(h[K.H_KHEAP_OFF]), int(h[K.H_KHEAP_CAP]), used, cap)
            h[K.H_KHEAP_CAP] = cap

    def reserve_rows(self, kg: int, need_rows: int) -> None:
        """Reserve key group `kg`'s first ``need_rows`` rows (or more, see ``_RESERVE_PART``; within
        its key capacity) in its key blocks and in every state column with an entry per key."""
        h = self.headers[kg]
        cap = int(h[K.H_KEYS_CAP])
        held = cap - int(h[K.H_UNRESERVED])
        want = max(need_rows, held + max(held // _RESERVE_PART, _RESERVE_MIN))
        rows = min(cap, -(-want // _RESERVE_ROWS) * _RESERVE_ROWS)
        if rows <= held:
            return
        for word, span, width in self._row_blocks(kg):
            lo, hi = min(held, span), min(rows, span)
            self.arena.reserve(int(h[word]) + lo * width, (hi - lo) * width)
        h[K.H_UNRESERVED] = cap - rows

    def _row_blocks(self, kg: int):
        """(header word of its offset, rows it has room for, bytes per row) of each of key group
        `kg`'s blocks that hold an entry per key: keys, key hashes, state values and validity."""
        h = self.headers[kg]
        cap = int(h[K.H_KEYS_CAP])
        if self.mode() in (None, KeyMode.INT64):
            yield K.H_KEYS_OFF, cap, 8
        else:
            yield K.H_KEYS_OFF, cap, 16
            yield K.H_KHASH_OFF, cap, 8
        for sid, entry in enumerate(self.arena.registry()):
            base = K.STATE_BASE + sid * K.STATE_WORDS
            span = int(h[base + K.S_DATA_CAP])
            if entry["storage"] == "heap" or not span:  # timers and window wheels: not per key
                continue
            yield base + K.S_DATA_OFF, span, row_width(entry)
            if h[base + K.S_VALID_OFF]:
                yield base + K.S_VALID_OFF, span, 1

    def _move(self, old_off: int, old_size: int, live: int, new_size: int, reserve: int | None = None) -> int:
        """Allocate `new_size` bytes (reserving the first ``reserve``, all if None), copy the first
        `live` bytes of the old block, free the old one."""
        a = self.arena
        off = a.alloc(new_size, reserve)
        if live:
            a.a8[off : off + live] = a.a8[old_off : old_off + live]
        a.free(old_off, old_size)
        return off

    def n_keys(self, kg: int) -> int:
        return int(self.headers[kg, K.H_NKEYS])

    def keys_at(self, kgs: np.ndarray, rows: np.ndarray) -> list:
        """The Python keys of some (key group, row) pairs."""
        mode = self.mode()
        h = self.headers
        a = self.arena
        if mode is KeyMode.INT64:
            return [
                int(a.a64[int(h[kg, K.H_KEYS_OFF]) // 8 + r]) for kg, r in zip(kgs.tolist(), rows.tolist())
            ]
        out = []
        for kg, r in zip(kgs.tolist(), rows.tolist()):
            kw = int(h[kg, K.H_KEYS_OFF]) // 8 + 2 * r
            off = int(h[kg, K.H_KHEAP_OFF]) + int(a.a64[kw])
            raw = bytes(a.a8[off : off + int(a.a64[kw + 1])])
            out.append(
                raw.decode()
                if mode is KeyMode.UTF8
                else decode_key(raw)
                if mode is KeyMode.CANONICAL
                else raw
            )
        return out

    def keys_of(self, kg: int) -> list:
        """All keys of a key group as Python objects, in row order."""
        mode = self.mode()
        h = self.headers[kg]
        n = int(h[K.H_NKEYS])
        if n == 0 or mode is None:
            return []
        a = self.arena
        if mode is KeyMode.INT64:
            off = int(h[K.H_KEYS_OFF]) // 8
            return a.a64[off : off + n].tolist()
        views = a.a64[int(h[K.H_KEYS_OFF]) // 8 :][: 2 * n].reshape(n, 2)
        heap = int(h[K.H_KHEAP_OFF])
        raw = [bytes(a.a8[heap + o : heap + o + ln]) for o, ln in views.tolist()]
        if mode is KeyMode.UTF8:
            return [b.decode() for b in raw]
        if mode is KeyMode.CANONICAL:
            return [decode_key(b) for b in raw]
        return raw

    def key_array(self, kg: int) -> pa.Array | None:
        """All keys of a key group as one Arrow array (copied out of shared memory), in row order,
        with no Python object per key; None for keys stored canonically (tuples, floats, mixed
        types: ``keys_of`` decodes them)."""
        mode = self.mode()
        h = self.headers[kg]
        n = int(h[K.H_NKEYS])
        a = self.arena
        if mode is None or mode is KeyMode.CANONICAL:
            return None
        off = int(h[K.H_KEYS_OFF]) // 8
        if mode is KeyMode.INT64:
            return pa.array(a.a64[off : off + n].copy())
        views = a.a64[off : off + 2 * n].reshape(n, 2)
        starts, lengths = views[:, 0], views[:, 1]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # every key's bytes in row order: its start in the heap, then one byte after another
        at = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]), dtype=np.int64)
        data = a.a8[int(h[K.H_KHEAP_OFF]) + at]
        if offsets[-1] < 2**31:  # the types Arrow infers from Python str/bytes, as keys_of's were
            kind, offsets = (pa.string() if mode is KeyMode.UTF8 else pa.binary()), offsets.astype(np.int32)
        else:
            kind = pa.large_string() if mode is KeyMode.UTF8 else pa.large_binary()
        return pa.Array.from_buffers(kind, n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])

    # ---- state columns -----------------------------------------------------------------
    def _state_words(self, sid: int) -> np.ndarray:
        base = K.STATE_BASE + sid * K.STATE_WORDS
        return self.headers[:, base : base + K.STATE_WORDS]

    def ensure_columns(self, sid: int, kgs: np.ndarray, width: int, validity: bool = True) -> None:
        """Make state `sid`'s column as long as the key capacity of these key groups (new rows unset).

        ``width`` is bytes per row; fixed-width columns keep a validity byte per row, variable-length
        ones (``validity=False``) encode "unset" in their views.
        """
        cols = self._state_words(sid)
        short = np.flatnonzero(cols[:, K.S_DATA_CAP] < self.headers[:, K.H_KEYS_CAP])
        if not short.size:
            return
        wanted = np.zeros(self.maxp, dtype=bool)
        wanted[kgs] = True
        for kg in short[wanted[short]]:
            c, h = cols[kg], self.headers[kg]
            old_cap = int(c[K.S_DATA_CAP])
            cap = int(h[K.H_KEYS_CAP])
            held = cap - int(h[K.H_UNRESERVED])  # the key group's reserved rows
            live = min(int(h[K.H_NKEYS]), old_cap)  # rows past the keys were never written
            c[K.S_DATA_OFF] = self._move(
                int(c[K.S_DATA_OFF]), old_cap * width, live * width, cap * width, held * width
            )
            if validity:
                c[K.S_VALID_OFF] = self._move(int(c[K.S_VALID_OFF]), old_cap, live, cap, held)
            c[K.S_DATA_CAP] = cap

    def gather(
        self, sid: int, dtype: np.dtype, kgs: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        view, shift = self.arena.views[np.dtype(dtype)]
        out = np.zeros(len(rows), dtype=dtype)
        valid = np.empty(len(rows), dtype=np.uint8)
        K.gather_fixed(
            view, shift, self.arena.a64, self.arena.a8, self.arena.state_base_w(sid), kgs, rows, out, valid
        )
        return out, valid

    def scatter(self, sid: int, dtype: np.dtype, kgs, rows, values: np.ndarray, valid: np.ndarray) -> None:
        dtype = np.dtype(dtype)
        self.ensure_columns(sid, kgs, dtype.itemsize)
        view, shift = self.arena.views[dtype]
        K.scatter_fixed(
            view, shift, self.arena.a64, self.arena.a8, self.arena.state_base_w(sid), kgs, rows, values, valid
        )

    def read_var(self, sid: int, kgs, rows) -> list:
        """The stored bytes of each (kg, row), or None where unset."""
        n = len(rows)
        offs = np.empty(n, dtype=np.int64)
        lens = np.empty(n, dtype=np.int64)
        K.var_views(self.arena.a64, self.arena.state_base_w(sid), kgs, rows, offs, lens)
        mem = self.arena.segment.mmap
        return [None if ln < 0 else mem[o : o + ln] for o, ln in zip(offs.tolist(), lens.tolist())]

    def write_var(self, sid: int, kgs, rows, payloads: list, appends: np.ndarray | None = None) -> None:
        """Store (or, where ``appends``, append to) each value; a None payload clears it."""
        n = len(rows)
        if n == 0:
            return
        self.ensure_columns(sid, kgs, 16, validity=False)
        lengths = np.fromiter((-1 if p is None else len(p) for p in payloads), dtype=np.int64, count=n)
        starts = np.zeros(n, dtype=np.int64)
        np.cumsum(np.maximum(lengths[:-1], 0), out=starts[1:])
        blob = np.frombuffer(bytearray(b"".join(p for p in payloads if p)), dtype=np.uint8)
        if appends is None:
            appends = np.zeros(n, dtype=np.bool_)
        a = self.arena
        base_w = a.state_base_w(sid)
        demand = np.zeros(self.maxp, dtype=np.int64)
        K.var_demand(a.a64, base_w, kgs, rows, lengths, appends, demand)
        for kg in np.flatnonzero(demand):
            self._ensure_heap(sid, int(kg), int(demand[kg]))
        K.var_write(a.a64, a.a8, base_w, kgs, rows, lengths, appends, blob, starts)

    def _ensure_heap(self, sid: int, kg: int, extra: int) -> None:
        """Give a column's heap room for `extra` bytes, compacting away garbage as it moves."""
        c = self._state_words(sid)[kg]
        used, cap, garbage = int(c[K.S_HEAP_USED]), int(c[K.S_HEAP_CAP]), int(c[K.S_HEAP_GARBAGE])
        if used + extra <= cap:
            return
        new_cap = pow2(max(2 * (used - garbage + extra), 4096))
        off = self.arena.alloc(new_cap)
        words = self.arena.state_base_w(sid) + kg * K.KG_WORDS
        new_used = K.var_compact(self.arena.a64, self.arena.a8, words, int(self.headers[kg, K.H_NKEYS]), off)
        self.arena.free(int(c[K.S_HEAP_OFF]), cap)
        c[K.S_HEAP_OFF] = off
        c[K.S_HEAP_CAP] = new_cap
        c[K.S_HEAP_USED] = new_used
        c[K.S_HEAP_GARBAGE] = 0

    def live_ranges(self):
        """(offset, length) of every structure in use: key indexes, keys, state columns, heaps."""
        h = self.headers
        byte_keys = self.mode() not in (None, KeyMode.INT64)
        for kg in np.flatnonzero(h[:, K.H_NKEYS]):
            w = h[kg]
            n = int(w[K.H_NKEYS])
            yield int(w[K.H_INDEX_OFF]), int(w[K.H_INDEX_CAP]) * 4
            yield int(w[K.H_KEYS_OFF]), n * (16 if byte_keys else 8)
            if byte_keys:
                yield int(w[K.H_KHASH_OFF]), n * 8
                yield int(w[K.H_KHEAP_OFF]), int(w[K.H_KHEAP_USED])
            for sid, entry in enumerate(self.arena.registry()):
                c = w[K.STATE_BASE + sid * K.STATE_WORDS :][: K.STATE_WORDS]
                if entry["storage"] == "heap":  # timers: (timestamp, row) pairs, not one per key
                    yield int(c[K.S_DATA_OFF]), int(c[K.S_HEAP_USED]) * 16
                    continue
                rows = min(n, int(c[K.S_DATA_CAP]))
                if rows:
                    yield int(c[K.S_DATA_OFF]), rows * row_width(entry)
                    yield int(c[K.S_VALID_OFF]), rows if c[K.S_VALID_OFF] else 0
                    yield int(c[K.S_HEAP_OFF]), int(c[K.S_HEAP_USED])

    def populate(self) -> None:
        """Pre-fault the live state into this process (see Arena.populate); no-op if unchanged."""
        size = int(self.headers[:, K.H_NKEYS].sum())
        if size != getattr(self, "_populated_keys", -1):
            self.arena.populate(self.live_ranges())
            self._populated_keys = size

    # ---- key groups of another node -----------------------------------------------------
    def here(self, kgs: np.ndarray) -> np.ndarray:
        """Those of ``kgs`` whose state is in this arena (on one node: all of them)."""
        return kgs[self.headers[kgs, K.H_AWAY] == 0]

    def set_away(self, kgs, away: bool) -> None:
        """Say that key groups' state is elsewhere (a node that does not own them, or is loading
        them) or here; instances' timers, windows and checkpoints touch only key groups here."""
        self.headers[np.asarray(kgs, dtype=np.int64), K.H_AWAY] = int(away)

    # ---- consistency for concurrent readers ---------------------------------------------
    def begin_write(self, kgs_unique: np.ndarray) -> None:
        """Mark key groups as being written (odd version), for readers outside the owner."""
        self.headers[kgs_unique, K.H_VERSION] += 1

    def end_write(self, kgs_unique: np.ndarray) -> None:
        self.headers[kgs_unique, K.H_VERSION] += 1

    def stable_read(self, kg: int, read, attempts: int = 1000):
        """Run ``read()`` until it saw no concurrent write to key group `kg` (a seqlock read).
        A read torn by a write may also fail (a key's length changed under it): it is retried
        like any torn read; a failure with no write meanwhile is the read's own and raised."""
        region = self.arena.region
        word = (self.arena.dir_w + kg * K.KG_WORDS + K.H_VERSION) * 8
        for _ in range(attempts):
            before = region.load64(word)
            if before % 2 == 0:
                try:
                    result = read()
                except Exception:
                    if region.load64(word) == before:
                        raise
                else:
                    if region.load64(word) == before:
                        return result
            time.sleep(0.0005)
        raise TimeoutError(f"key group {kg} kept changing while being read")


def row_width(entry: dict) -> int:
    """Bytes per row of a declared state's column (see the registry entries in ``codecs``)."""
    storage = entry["storage"]
    if storage == "var":
        return 16
    if storage == "words":
        return 8 * len(entry["fields"])
    return np.dtype(storage).itemsize


def per_key_words(registry: list[dict]) -> set[int]:
    """Header words pointing at a key group's blocks with an entry per key (keys, key hashes, the
    values and validity of states kept per key): those are reserved row by row, not in full."""
    words = {K.H_KEYS_OFF, K.H_KHASH_OFF}
    for sid, entry in enumerate(registry):
        if entry["storage"] != "heap":
            base = K.STATE_BASE + sid * K.STATE_WORDS
            words |= {base + K.S_DATA_OFF, base + K.S_VALID_OFF}
    return words


def _int64_keys(column) -> np.ndarray:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.null_count:
        raise ValueError("a key is null; keys must not be null")
    if not pa.types.is_int64(column.type):
        column = column.cast(pa.int64())
    return column.to_numpy(zero_copy_only=False)
