"""Vectorized event-time window aggregates: count/sum/min/max/mean per key and window.

Records are folded into their windows by a numba kernel over the batch's Arrow columns; a
watermark emits every window it passed as one Arrow batch. A key's open windows are a ring of
slots in one variable-length value of the operator's keyed state, and each key group keeps an
index of its open windows by window (see ``stretch.state._window_kernels``), so a watermark
visits only the windows it fires. Both live in shared memory and follow their key group through
live rescales, checkpoints and restores like any other state.
"""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa

from stretch.common.records import to_batch
from stretch.common.value_encoding import PICKLE_PROTOCOL
from stretch.plan.specs import VectorWindowSpec
from stretch.runtime.batch import TS_COLUMN, Records, resolve_field
from stretch.runtime.operators.base import KeyedOperator
from stretch.state import _table_kernels as TK
from stretch.state import _window_kernels as K
from stretch.state.keyed_table import KeyMode
from stretch.state.timers import EVENT
from stretch.state.warm import warm_window_kernels

_MIN = -(2**63)
_MAX = 2**63 - 1
_CHUNK = 1 << 16
_NO_TIMESTAMPS = (
    "event-time windows need record timestamps: use assign_timestamps_and_watermarks "
    "or from_source with a WatermarkStrategy that has a timestamp assigner"
)


class VectorWindowOperator(KeyedOperator):
    """Tumbling/sliding event-time windows with built-in aggregates, a batch at a time."""

    def __init__(self, spec, name, table):
        super().__init__(spec, name, table)
        warm_window_kernels()  # here, before the job starts, not at the first batch or watermark
        self.w: VectorWindowSpec = spec.fn
        # stored accumulators: count is in every slot; mean keeps a sum
        self.slots = [a for a in self.w.aggregates if a.op != "count"]
        self.ops = np.array(
            [{"sum": K.SUM, "mean": K.SUM, "min": K.MIN, "max": K.MAX}[a.op] for a in self.slots]
        )
        self.sid = table.arena.register_state(
            {"name": "__windows", "kind": "windows", "storage": "var", "type": None}
        )
        self.iid = table.arena.register_state(
            {"name": "__window_index", "kind": "window_index", "storage": "heap", "type": None}
        )
        # Every instance must read the slots alike, even one that has not seen a record yet, so
        # whether an accumulator is a float follows the declared output type, not the input.
        self.out_schema = to_batch([], spec.output_type).schema
        out_fields = {a.name: self.out_schema.field(a.name).type for a in self.w.aggregates}
        self.is_float = np.array(
            [a.op == "mean" or pa.types.is_floating(out_fields[a.name]) for a in self.slots], dtype=np.bool_
        )
        self.fields: list[int] | None = None  # input columns of the accumulators, from the first batch

    # ---- records ---------------------------------------------------------------------------
    def process_owned(self, batch: pa.RecordBatch, kgs: np.ndarray, owners: np.ndarray, me: int):
        mine = owners[kgs] == me
        self.rows_in = n = int(np.count_nonzero(mine))
        if not n:
            return None
        if n < len(kgs):
            sel = np.flatnonzero(mine)
            batch, kgs = batch.take(pa.array(sel)), kgs[sel]
        if TS_COLUMN not in batch.schema.names:
            raise ValueError(_NO_TIMESTAMPS)
        if self.fields is None:
            self._bind(batch.schema)
        ts = batch.column(TS_COLUMN).to_numpy()
        col, mode = self.key_column(batch)
        rows = self.table.rows(kgs, col, mode)
        vals = self._values(batch)
        late = np.zeros(len(ts), dtype=np.bool_)
        touched = np.unique(kgs)
        table, arena = self.table, self.table.arena
        table.begin_write(touched)
        try:
            self._ensure_indexed(touched)
            offs = self._rings(kgs, rows)
            progress = np.array([0, _MIN, 0, 0], dtype=np.int64)
            while True:
                K.window_add(
                    arena.a64,
                    arena.views[np.dtype(np.float64)][0],
                    arena.state_base_w(self.iid),
                    kgs,
                    rows,
                    offs,
                    ts,
                    vals,
                    self.ops,
                    self.is_float,
                    self.w.size,
                    self.w.slide,
                    self.w.offset,
                    self.w.ring,
                    self.watermark,
                    late,
                    progress,
                )
                if not progress[2]:
                    break
                i = int(progress[0])
                if progress[2] == K.INDEX_FULL:
                    start = int(progress[1])
                    self._grow_index(int(kgs[i]), (start - self.w.offset) // self.w.slide, int(rows[i]))
                    continue
                self._grow(kgs[i : i + 1], rows[i : i + 1])
                offs = self._offsets(kgs, rows)
        finally:
            table.end_write(touched)
        if self.w.late_tag is None or not late.any():
            return None
        idx = pa.array(np.flatnonzero(late))
        late_records = Records(batch=batch.take(idx).select(self._data_columns(batch)), timestamps=ts[late])
        return Records(items=[], type_info=self.spec.output_type, side={self.w.late_tag.tag_id: late_records})

    def _bind(self, schema: pa.Schema) -> None:
        fields = [resolve_field(schema, a.field) for a in self.slots]
        for a, i in zip(self.slots, fields):
            t = schema.field(i).type
            if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
                raise TypeError(
                    f"{a.op}({a.field!r}) of operator {self.name!r} needs a number field, got {t}"
                )
        self.fields = fields

    @staticmethod
    def _data_columns(batch: pa.RecordBatch) -> list[int]:
        return [i for i, n in enumerate(batch.schema.names) if not n.startswith("__")]

    def _values(self, batch: pa.RecordBatch) -> np.ndarray:
        vals = np.empty((len(self.fields), batch.num_rows), dtype=np.int64)
        for j, i in enumerate(self.fields):
            col = batch.column(i)
            if col.null_count:
                raise ValueError(f"{self.slots[j]} of operator {self.name!r}: a record has no value")
            if self.is_float[j]:
                vals[j] = col.to_numpy().astype(np.float64, copy=False).view(np.int64)
            else:
                vals[j] = col.to_numpy().astype(np.int64, copy=False)
        return vals

    # ---- rings -----------------------------------------------------------------------------
    def _slot_words(self) -> int:
        return 2 + len(self.slots)

    def _offsets(self, kgs: np.ndarray, rows: np.ndarray) -> np.ndarray:
        offs = np.empty(len(rows), dtype=np.int64)
        lens = np.empty(len(rows), dtype=np.int64)
        TK.var_views(self.table.arena.a64, self.table.arena.state_base_w(self.sid), kgs, rows, offs, lens)
        return offs

    def _rings(self, kgs: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each record's ring offset, creating empty rings for keys that have none."""
        offs = np.empty(len(rows), dtype=np.int64)
        lens = np.empty(len(rows), dtype=np.int64)
        a = self.table.arena
        TK.var_views(a.a64, a.state_base_w(self.sid), kgs, rows, offs, lens)
        new = np.flatnonzero(lens < 0)
        if not len(new):
            return offs
        code = (kgs[new].astype(np.int64) << 40) | rows[new]
        _, first = np.unique(code, return_index=True)
        pick = new[first]
        ring = np.zeros(1 + self.w.ring * self._slot_words(), dtype=np.int64)
        ring[0] = self.w.ring
        self.table.write_var(self.sid, kgs[pick], rows[pick], [ring.tobytes()] * len(pick))
        return self._offsets(kgs, rows)

    def _grow(self, kgs: np.ndarray, rows: np.ndarray) -> None:
        """Double a key's ring until its open windows have a slot each."""
        (raw,) = self.table.read_var(self.sid, kgs, rows)
        old = np.frombuffer(bytes(raw), dtype=np.int64)
        sw = self._slot_words()
        slots = old[1:].reshape(-1, sw)
        live = slots[slots[:, 1] > 0]
        size = int(old[0])
        while True:
            size *= 2
            if len(np.unique(live[:, 0] & (size - 1))) == len(live):
                break
        new = np.zeros((size, sw), dtype=np.int64)
        new[live[:, 0] & (size - 1)] = live
        self.table.write_var(self.sid, kgs, rows, [np.concatenate(([size], new.ravel())).tobytes()])

    # ---- the index of open windows (a timer wheel per key group) ---------------------------
    def _index_words(self, kgs: np.ndarray) -> np.ndarray:
        """Word offsets of these key groups' index column headers."""
        return self.table.arena.state_base_w(self.iid) + kgs.astype(np.int64) * TK.KG_WORDS

    def _grow_index(self, kg: int, widx: int | None = None, row: int = 0, buckets: int = 0) -> None:
        """Give key group kg's wheel room for window ``widx`` of ``row`` (and every open window it
        holds): bitmaps as wide as the key group's key capacity, buckets doubled until no two open
        windows share one."""
        table, a = self.table, self.table.arena
        c = table._state_words(self.iid)[kg]
        cap = int(c[TK.S_DATA_CAP])
        if cap:
            off = int(c[TK.S_DATA_OFF]) // 8
            old_b, old_w = int(a.a64[off + K.W_BUCKETS]), int(a.a64[off + K.W_WIDTH])
            old = (
                a.a64[off + K.W_HEAD : off + K.W_HEAD + old_b * (2 + old_w)].reshape(old_b, 2 + old_w).copy()
            )
            old = old[old[:, 1] > 0]
        else:
            old_b, old_w, old = self.w.ring, 0, np.zeros((0, 2), np.int64)
        width = max(old_w, int(table.headers[kg, TK.H_KEYS_CAP]) // 64, row // 64 + 1)
        wanted = old[:, 0] if widx is None else np.append(old[:, 0], widx)
        n_buckets = max(old_b, buckets)
        while len(np.unique(wanted & (n_buckets - 1))) < len(np.unique(wanted)):
            n_buckets *= 2
        units = -(-(K.W_HEAD + n_buckets * (2 + width)) // 2)  # the block's size in 16-byte units
        new = np.zeros((n_buckets, 2 + width), np.int64)
        new[old[:, 0] & (n_buckets - 1), : old.shape[1]] = old
        block = table._move(int(c[TK.S_DATA_OFF]), cap * 16, 0, units * 16)
        words = block // 8
        a.a64[words : words + units * 2] = 0
        a.a64[words + K.W_BUCKETS], a.a64[words + K.W_WIDTH] = n_buckets, width
        a.a64[words + K.W_HEAD : words + K.W_HEAD + new.size] = new.ravel()
        c[TK.S_DATA_OFF], c[TK.S_DATA_CAP], c[TK.S_HEAP_USED] = block, units, units

    def _ensure_indexed(self, kgs: np.ndarray) -> None:
        """Index the open windows of key groups whose wheel is not complete: new ones (nothing to
        index) and ones restored from a snapshot taken before the index existed."""
        a = self.table.arena
        flags = a.a64[self._index_words(kgs) + K.S_INDEXED]
        if flags.all():
            return
        base, ibase, m = a.state_base_w(self.sid), a.state_base_w(self.iid), len(self.slots)
        for kg in np.unique(kgs[flags == 0]).tolist():
            c = self.table._state_words(self.iid)[kg]
            buckets = 0
            while not K.window_index_rebuild(a.a64, a.dir_w, base, ibase, kg, m):
                buckets = max(2 * buckets, 2 * self.w.ring)
                a.free(int(c[TK.S_DATA_OFF]), int(c[TK.S_DATA_CAP]) * 16)
                c[TK.S_DATA_OFF] = c[TK.S_DATA_CAP] = c[TK.S_HEAP_USED] = 0
                self._grow_index(kg, buckets=buckets)
            c[K.S_INDEXED] = 1

    # ---- firing ----------------------------------------------------------------------------
    def fire(self, domain: int, limit: int) -> Records | None:
        """Emit every window the watermark ``limit`` passed, in window order (as Flink's timers)."""
        if domain != EVENT:
            return None
        owned = self.owned_here()
        if not len(owned):
            return None
        w = self.w
        hi = max((limit - w.size + 1 - w.offset) // w.slide, _MIN) if limit < _MAX else _MAX
        a = self.table.arena
        m = len(self.slots)
        int_keys = self._int_keys()
        parts = []
        progress = np.zeros(2, dtype=np.int64)
        chunk = _CHUNK
        self.table.begin_write(owned)
        try:
            self._ensure_indexed(owned)
            while progress[0] < len(owned):
                out = (
                    np.empty(chunk, np.int64),
                    np.empty(chunk, np.int64),
                    np.empty(chunk if int_keys else 0, np.int64),
                    np.empty(chunk, np.int64),
                    np.empty(chunk, np.int64),
                    np.empty((m, chunk), np.int64),
                )
                K.window_fire(
                    a.a64,
                    a.dir_w,
                    a.state_base_w(self.sid),
                    a.state_base_w(self.iid),
                    owned,
                    hi,
                    m,
                    w.ring,
                    *out,
                    progress,
                )
                n = int(progress[1])
                if n < 0:  # one key has more due windows than a chunk
                    chunk = -n
                elif n:
                    parts.append(tuple(x[..., :n] for x in out))
        finally:
            self.table.end_write(owned)
        if not parts:
            return None
        if len(parts) == 1:
            kg, row, key, widx, cnt, acc = parts[0]
        else:
            kg, row, key, widx, cnt, acc = (np.concatenate(x, axis=-1) for x in zip(*parts))
        span = int(widx.max() - widx.min())
        if span == 0:
            return Records(batch=self._output(kg, row, key, widx, cnt, acc))
        # window-major, as Flink's timers fire; small ints make numpy's stable sort a radix sort
        rel = widx - widx.min()
        order = np.argsort(rel.astype(np.uint16) if span < 65536 else rel, kind="stable")
        key = key[order] if int_keys else key
        return Records(batch=self._output(kg[order], row[order], key, widx[order], cnt[order], acc[:, order]))

    def _int_keys(self) -> bool:
        """Whether the results' keys are the table's int64 keys as they are (the fire kernel then
        reads them beside the rings)."""
        return self.table.mode() is KeyMode.INT64 and pa.types.is_integer(self.out_schema.field(0).type)

    def _output(self, kg, row, key, widx, cnt, acc) -> pa.RecordBatch:
        """The results as one batch; ``key``: their int64 keys when the kernel read them."""
        w = self.w
        start = widx * w.slide + w.offset
        end = start + w.size
        schema = self.out_schema
        if len(key) == len(kg):
            key = pa.array(key).cast(schema.field(0).type)
        else:
            keys = self.table.keys_at(kg.astype(np.uint16), row)
            if (schema.field(0).metadata or {}).get(b"stretch.pickled") == b"1":
                keys = [pickle.dumps(k, PICKLE_PROTOCOL) for k in keys]
            key = pa.array(keys, type=schema.field(0).type)
        columns = [key, pa.array(start), pa.array(end)]
        stored = iter(range(len(self.slots)))
        for j, agg in enumerate(self.w.aggregates, 3):
            if agg.op == "count":
                col = pa.array(cnt)
            else:
                k = next(stored)
                values = acc[k].view(np.float64) if self.is_float[k] else acc[k]
                col = pa.array(values / cnt if agg.op == "mean" else values)
            columns.append(col.cast(schema.field(j).type))
        data = pa.RecordBatch.from_arrays(columns, schema=schema)
        return data.append_column(TS_COLUMN, pa.array(end - 1))
