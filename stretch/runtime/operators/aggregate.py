"""Flink's rolling sum/min/max on numeric fields, folded into the state with one numba pass per
batch (a key's numeric fields are one record of 8-byte words): never a Python object per record."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pyarrow as pa

from stretch.common.user_code import dumps_value
from stretch.plan.stages import OperatorSpec
from stretch.runtime.batch import KEY_COLUMN, Records, resolve_field
from stretch.runtime.operators.base import KeyedOperator
from stretch.runtime.operators.process import ProcessOperator
from stretch.state import _table_kernels as K
from stretch.state.keyed_table import MAX_LOAD, KeyMode

_OPS = {"sum": 0, "min": 1, "max": 2}


class AggregateOperator(KeyedOperator):
    """Flink's rolling sum/min/max over one or more numeric fields, vectorized.

    As in Flink, each input record yields one output record: the aggregated fields hold the running
    result, every other field the value it had in the key's first record. A key's numeric fields
    live together in one record of 8-byte words (one column of the state table), so folding a row
    costs one random memory access; non-numeric fields keep their first value in columns of their
    own. Records that are not Arrow numbers (pickled) take PyFlink's per-record path instead.
    """

    def __init__(self, spec, name, table):
        super().__init__(spec, name, table)
        self.op = _OPS[spec.op]
        self._layouts: dict = {}
        self._fallback: ProcessOperator | None = None
        self._decided = False
        self._runtime_context = None

    def open(self, runtime_context) -> None:
        self._runtime_context = runtime_context

    def _decide(self, batch: pa.RecordBatch) -> None:
        self._decided = True
        schema = batch.schema
        try:
            numeric = all(_is_numeric(schema.field(resolve_field(schema, f))) for f in self.spec.fields)
        except (KeyError, IndexError):
            numeric = False
        if not numeric:
            spec = OperatorSpec("process", self.spec.fn, self.spec.output_type, self.spec.key)
            self._fallback = ProcessOperator(spec, self.name, self.table)
            # the function's state must be bound to the fallback's own view of the table, which
            # is the one that process() positions on each record's key
            context = copy.copy(self._runtime_context)
            context._backend = self._fallback.backend
            self._fallback.open(context)

    def process_owned(
        self, batch: pa.RecordBatch, kgs: np.ndarray, owners: np.ndarray, me: int
    ) -> Records | None:
        """Process the rows of a whole batch that this instance owns."""
        self.rows_in = 0
        if not self._decided:
            self._decide(batch)
        layout = None if self._fallback is not None else self._layout(batch)
        if layout is not None and layout.fused:
            return self._fused(batch, kgs, owners, me, layout)
        mine = owners[kgs] == me
        if not mine.any():
            return None
        sel = np.flatnonzero(mine)
        self.rows_in = len(sel)
        batch, kgs = batch.take(sel), kgs[sel]
        try:
            return self._fallback.process(batch, kgs) if self._fallback else self._located(batch, kgs, layout)
        except TypeError as e:  # a key of another type: admit() routes or raises it
            batch, kgs = self.admit(batch, kgs, e)
            if batch is None:
                return None
            return self._fallback.process(batch, kgs) if self._fallback else self._located(batch, kgs, layout)

    def _layout(self, batch: pa.RecordBatch) -> _Layout:
        layout = self._layouts.get(batch.schema)
        if layout is None:
            layout = self._layouts[batch.schema] = _Layout(self, batch)
        return layout

    def _fused(self, batch, kgs, owners, me, layout) -> Records | None:
        table, arena = self.table, self.table.arena
        vals = layout.values(batch)
        n = batch.num_rows
        pos = np.empty(n, dtype=np.int64)
        out = np.empty_like(vals)
        keys = _numpy(batch.column(layout.key_index), np.int64)
        progress = np.zeros(3, dtype=np.int64)
        af64 = arena.views[np.dtype(np.float64)][0]
        base_w = arena.state_base_w(layout.sid)
        owned = np.flatnonzero(owners == me)
        table.begin_write(owned)  # queryable readers retry rather than see half a batch
        while True:
            K.rolling_aggregate_i64(
                arena.a64,
                arena.a32,
                arena.a8,
                af64,
                arena.dir_w,
                base_w,
                kgs,
                keys,
                owners,
                me,
                self.op,
                vals,
                layout.is_float,
                layout.is_acc,
                pos,
                out,
                progress,
                MAX_LOAD,
            )
            full = int(progress[2])
            if full < 0:
                break
            table.grow_for(full, layout.sid, 8 * layout.width)
        table.end_write(owned)
        m = int(progress[1])
        self.rows_in = m  # one output per owned input
        if not m:
            return None
        return layout.output(batch, pos[:m], out[:, :m], {}, keys[pos[:m]])

    def _located(self, batch, kgs, layout) -> Records:
        touched = np.unique(kgs)
        table = self.table
        table.begin_write(touched)  # queryable readers retry rather than see a new key's value unset
        try:
            return self._aggregate_located(batch, kgs, layout, touched)
        finally:
            table.end_write(touched)

    def _aggregate_located(self, batch, kgs, layout, touched) -> Records:
        _, _, rows, uidx, first = self.locate(batch, kgs)
        table, arena = self.table, self.table.arena
        table.ensure_columns(layout.sid, touched, 8 * layout.width)
        vals = layout.values(batch)
        out = np.empty_like(vals)
        K.rolling_records(
            arena.a64,
            arena.a8,
            arena.views[np.dtype(np.float64)][0],
            arena.state_base_w(layout.sid),
            kgs,
            rows,
            vals,
            layout.is_float,
            layout.is_acc,
            self.op,
            out,
        )
        others = {
            i: self._first_value(batch.schema.field(i).name, batch.column(i), kgs, rows, uidx, first)
            for i in layout.other
        }
        return layout.output(batch, None, out, others)

    def _first_value(self, name, column, kgs, rows, uidx, first) -> pa.Array:
        """A non-numeric field's value in the key's first record (kept as a pickled value)."""
        sid = self.table.arena.register_state(
            {"name": f"first({name})", "kind": "value", "storage": "var", "type": None}
        )
        ukgs, urows = kgs[first], rows[first]
        raw = self.table.read_var(sid, ukgs, urows)
        values = [None if r is None else pickle.loads(r) for r in raw]
        new = [i for i, r in enumerate(raw) if r is None]
        if new:
            picked = column.take(pa.array(first[new])).to_pylist()
            for i, v in zip(new, picked):
                values[i] = v
            idx = np.array(new, dtype=np.int64)
            self.table.write_var(sid, ukgs[idx], urows[idx], [dumps_value(v) for v in picked])
        return pa.array([values[u] for u in uidx.tolist()], type=column.type)


class _Layout:
    """How one batch schema maps onto an aggregate operator's per-key record."""

    def __init__(self, op: AggregateOperator, batch: pa.RecordBatch):
        schema = batch.schema
        agg = {resolve_field(schema, f) for f in op.spec.fields}
        self.key_index = -1 if op.spec.key.field is None else resolve_field(schema, op.spec.key.field)
        self.data = [i for i, n in enumerate(schema.names) if not n.startswith("__")]
        self.numeric = [i for i in self.data if i != self.key_index and _is_numeric(schema.field(i))]
        self.other = [i for i in self.data if i != self.key_index and i not in self.numeric]
        self.width = len(self.numeric)
        self.is_acc = np.array([i in agg for i in self.numeric], dtype=np.bool_)
        self.is_float = np.array(
            [pa.types.is_floating(schema.field(i).type) for i in self.numeric], dtype=np.bool_
        )
        fields = [
            {"name": schema.field(i).name, "float": bool(f), "acc": bool(a)}
            for i, f, a in zip(self.numeric, self.is_float, self.is_acc)
        ]
        for other in _OPS:  # a live update from another built-in: its state is this one's
            if other != op.spec.op:
                op.table.arena.rename_state(f"rolling {other}", f"rolling {op.spec.op}")
        entry = {
            "name": f"rolling {op.spec.op}",
            "kind": "record",
            "storage": "words",
            "type": None,
            "fields": fields,
        }
        try:
            self.sid = op.table.arena.register_state(entry)
        except ValueError:
            raise TypeError(
                f"{op.spec.op} of operator {op.name!r}: the records changed shape ({schema}); "
                "a rolling aggregate needs records with the same fields throughout"
            ) from None
        key_col, mode = op._sent_keys(batch)  # each batch's keys are checked where they are used
        self.fused = (
            mode is KeyMode.INT64
            and pa.types.is_int64(key_col.type)
            and KEY_COLUMN not in schema.names
            and not self.other
        )
        if self.fused:
            op.table.claim_mode(KeyMode.INT64)  # the fused pass stores int64 keys without rows()

    def values(self, batch: pa.RecordBatch) -> np.ndarray:
        """The numeric fields as a (k, n) int64 array, floats bit-cast."""
        vals = np.empty((self.width, batch.num_rows), dtype=np.int64)
        for j, i in enumerate(self.numeric):
            if self.is_float[j]:
                vals[j] = _numpy(batch.column(i), np.float64).view(np.int64)
            else:
                vals[j] = _numpy(batch.column(i), np.int64)
        return vals

    def output(self, batch: pa.RecordBatch, pos, out: np.ndarray, others: dict, keys=None) -> Records:
        schema = batch.schema
        columns = []
        for i in self.data:
            t = schema.field(i).type
            if i in others:
                columns.append(others[i])
            elif i in self.numeric:
                j = self.numeric.index(i)
                values = out[j].view(np.float64) if self.is_float[j] else out[j]
                columns.append(pa.array(values).cast(t, safe=False))
            elif keys is not None:  # the int64 key column, already picked in numpy
                columns.append(pa.array(keys).cast(t, safe=False))
            else:
                col = batch.column(i)
                columns.append(col if pos is None else col.take(pa.array(pos)))
        fields = [schema.field(i) for i in self.data]
        return Records(
            batch=pa.RecordBatch.from_arrays(columns, schema=pa.schema(fields, metadata=schema.metadata))
        )


def _is_numeric(field: pa.Field) -> bool:
    t = field.type
    pickled = (field.metadata or {}).get(b"stretch.pickled") == b"1"
    return not pickled and (pa.types.is_integer(t) or pa.types.is_floating(t)) and not pa.types.is_float16(t)


def _numpy(column: pa.Array, dtype) -> np.ndarray:
    """A column as a numpy array of dtype (zero-copy when it already is one)."""
    if column.null_count:
        raise ValueError("rolling aggregates need values; a field is null in a record")
    arr = column.to_numpy(zero_copy_only=False)
    return arr if arr.dtype == dtype else arr.astype(dtype)
