"""Keyed operators as one instance runs them: over the rows of a batch that it owns.

Every operator first maps the batch's keys to rows of the shared key-group tables (one vectorized
lookup), then either runs the user's function per record against state loaded in bulk
(``ProcessOperator``), or folds whole columns into the state with a numba kernel
(``AggregateOperator``: Flink's rolling sum/min/max, never a Python object per record).
"""

from __future__ import annotations

import pickle
import time

import numpy as np
import pyarrow as pa

from stretch.contracts import state as api_state
from stretch.contracts.functions import KeyedProcessFunction, RuntimeContext, TimeDomain, TimerService
from stretch.plan.stages import OperatorSpec
from stretch.runtime.batch import KEY_COLUMN, Records, resolve_field, split_outputs
from stretch.runtime.event_time import MIN_WATERMARK
from stretch.runtime.outputs import StepError
from stretch.state import _table_kernels as K
from stretch.state.backend import KeyedStateBackend
from stretch.state.key_codec import decode_key
from stretch.state.keyed_table import MAX_LOAD, KeyedTable, KeyMode, key_mode_of
from stretch.state.timers import EVENT, PROCESSING

_OPS = {"sum": 0, "min": 1, "max": 2}


class InstanceRuntimeContext(RuntimeContext):
    """What a user function learns about its instance in open(): names, parallelism, state."""

    def __init__(self, task_name: str, index: int, parallelism, max_parallelism: int, backend=None):
        self._task_name = task_name
        self._index = index
        self._parallelism = parallelism  # a callable: parallelism changes with rescales
        self._max_parallelism = max_parallelism
        self._backend = backend

    def get_task_name(self) -> str:
        return self._task_name

    def get_number_of_parallel_subtasks(self) -> int:
        return self._parallelism()

    def get_max_number_of_parallel_subtasks(self) -> int:
        return self._max_parallelism

    def get_index_of_this_subtask(self) -> int:
        return self._index

    def _state(self, descriptor, cls):
        if self._backend is None:
            raise RuntimeError("This state is only accessible by functions executed on a KeyedStream.")
        if not isinstance(descriptor, cls):
            raise TypeError(f"expected a {cls.__name__}, got {descriptor!r}")
        return self._backend.state(descriptor)

    def get_state(self, state_descriptor):
        return self._state(state_descriptor, api_state.ValueStateDescriptor)

    def get_list_state(self, state_descriptor):
        return self._state(state_descriptor, api_state.ListStateDescriptor)

    def get_map_state(self, state_descriptor):
        return self._state(state_descriptor, api_state.MapStateDescriptor)

    def get_reducing_state(self, state_descriptor):
        return self._state(state_descriptor, api_state.ReducingStateDescriptor)

    def get_aggregating_state(self, state_descriptor):
        return self._state(state_descriptor, api_state.AggregatingStateDescriptor)


class KeyedTimerService(TimerService):
    """Timers of the current key, kept with its state; registrations apply at the batch's end."""

    __slots__ = ("_b", "_op")

    def __init__(self, backend: KeyedStateBackend, operator):
        self._b = backend
        self._op = operator

    def current_processing_time(self) -> int:
        return time.time_ns() // 1_000_000

    def current_watermark(self) -> int:
        return self._op.watermark

    def register_event_time_timer(self, timestamp: int) -> None:
        self._b.timer_op(EVENT, int(timestamp), True)

    def register_processing_time_timer(self, timestamp: int) -> None:
        self._b.timer_op(PROCESSING, int(timestamp), True)

    def delete_event_time_timer(self, timestamp: int) -> None:
        self._b.timer_op(EVENT, int(timestamp), False)

    def delete_processing_time_timer(self, timestamp: int) -> None:
        self._b.timer_op(PROCESSING, int(timestamp), False)


class KeyedContext(KeyedProcessFunction.OnTimerContext):
    """The ``ctx`` of process_element and on_timer: current key, record or timer time, timers."""

    __slots__ = ("_b", "_timers", "domain", "ts")

    def __init__(self, backend: KeyedStateBackend, timers: KeyedTimerService):
        self._b = backend
        self._timers = timers
        self.ts = None
        self.domain = TimeDomain.EVENT_TIME

    def get_current_key(self):
        return self._b.keys[self._b.current]

    def timer_service(self) -> TimerService:
        return self._timers

    def timestamp(self):
        return self.ts

    def time_domain(self) -> TimeDomain:
        return self.domain


class KeyedOperator:
    """Shared part: the state tables, and keys -> table rows -> batch-unique key slots."""

    def __init__(self, spec: OperatorSpec, name: str, table: KeyedTable):
        self.spec = spec
        self.name = name
        self.table = table
        self.backend = KeyedStateBackend(table)
        self._scratch = np.zeros(0, dtype=np.int64)
        self.watermark = MIN_WATERMARK  # this instance's input watermark
        self.rows_in = 0  # rows of the last batch this instance owned (operators with process_owned)
        self.owned = np.zeros(0, dtype=np.int64)  # key groups this instance owns (set per epoch)

    def fire(self, domain: int, limit: int) -> Records | None:
        """Fire the timers due at ``limit`` (event time: the watermark; processing: the clock)."""
        return None

    def next_timer(self, domain: int) -> int:
        return 2**63 - 1

    def open(self, runtime_context) -> None:
        pass

    def close(self) -> None:
        pass

    def key_column(self, batch: pa.RecordBatch) -> tuple[pa.Array, KeyMode]:
        schema = batch.schema
        if KEY_COLUMN in schema.names:
            i = schema.get_field_index(KEY_COLUMN)
            f = schema.field(i)
            canonical = (f.metadata or {}).get(b"stretch.key") == b"canonical"
            return batch.column(i), KeyMode.CANONICAL if canonical else key_mode_of(f.type)
        col = batch.column(resolve_field(schema, self.spec.key.field))
        return col, key_mode_of(col.type)

    def locate(self, batch: pa.RecordBatch, kgs: np.ndarray):
        """(key column, rows, unique slot per row, first position of each slot) for a batch."""
        col, mode = self.key_column(batch)
        try:
            rows = self.table.rows(kgs, col, mode)
        except TypeError as e:
            raise TypeError(f"operator {self.name!r}: {e}") from None
        n = len(rows)
        size = 1 << max(2 * n - 1, 1).bit_length()
        if self._scratch.shape[0] < size:
            self._scratch = np.zeros(size, dtype=np.int64)
        scratch = self._scratch[:size]
        scratch[:] = 0
        uidx = np.empty(n, dtype=np.int64)
        first = np.empty(n, dtype=np.int64)
        nu = K.dedup(kgs, rows, scratch, uidx, first)
        return col, mode, rows, uidx, first[:nu]

    @staticmethod
    def python_keys(col: pa.Array, mode: KeyMode, first: np.ndarray) -> list:
        picked = col.take(first)
        if mode is KeyMode.CANONICAL:
            return [decode_key(b) for b in picked.to_pylist()]
        if mode is KeyMode.INT64 and pa.types.is_int64(col.type) and not picked.null_count:
            return picked.to_numpy().tolist()
        return picked.to_pylist()


class ProcessOperator(KeyedOperator):
    """A KeyedProcessFunction, called once per record with its key's state in place."""

    def __init__(self, spec, name, table):
        super().__init__(spec, name, table)
        self.fn = spec.fn
        self.ctx = KeyedContext(self.backend, KeyedTimerService(self.backend, self))
        self.timestamped = getattr(spec.fn, "emits_timestamps", False)  # yields (value, timestamp)

    def open(self, runtime_context) -> None:
        self.fn.open(runtime_context)

    def close(self) -> None:
        self.fn.close()

    def process(self, batch: pa.RecordBatch, kgs: np.ndarray) -> Records:
        col, mode, rows, uidx, first = self.locate(batch, kgs)
        b = self.backend
        b.begin(kgs[first], rows[first], self.python_keys(col, mode, first))
        records_in = Records(batch=batch)
        records = records_in.items()
        ts = records_in.timestamps()
        out: list = []
        pe = self.fn.process_element
        ctx = self.ctx
        ctx.ts = None
        slots = uidx.tolist()
        stamps = ts.tolist() if ts is not None else None
        counts: list[int] = []
        start = 0
        while start < len(records):  # resumed after a record that went to dead letters
            start = self._process_from(start, records, slots, stamps, out, counts, pe, ctx)
        out_ts = np.repeat(ts, counts).tolist() if ts is not None else None
        b.end()
        return split_outputs(out, out_ts, self.timestamped, self.spec.output_type)

    def _process_from(self, start, records, slots, stamps, out, counts, pe, ctx) -> int:
        """process_element of records[start:]; returns where to resume (after a rejected record,
        whose outputs, if it yielded some before it raised, are dropped with it).

        Outputs carry the timestamp of the record that produced them, as in Flink (``counts``:
        how many each record produced, when records have timestamps).
        """
        b = self.backend
        ext = out.extend
        i, before = start, len(out)
        try:
            # i names the record that raised, in the handler below
            if stamps is None:
                for i, (slot, record) in enumerate(zip(slots[start:], records[start:]), start):  # noqa: B007
                    b.current = slot
                    res = pe(record, ctx)
                    if res is not None:
                        ext(res)
                        before = len(out)
            else:
                for i, (slot, record, ctx.ts) in enumerate(  # noqa: B007
                    zip(slots[start:], records[start:], stamps[start:]), start
                ):
                    b.current = slot
                    res = pe(record, ctx)
                    before = len(out)
                    if res is not None:
                        ext(res)
                    counts.append(len(out) - before)
        except Exception as e:
            del out[before:]  # what the rejected record yielded before it raised
            what = getattr(self.fn, "what", "process_element")
            err = StepError(self.name, records[i], b.keys[slots[i]], e, what)
            err.__cause__ = e
            self.dead_letter(err)  # raises unless the job's policy is dead letters
            if stamps is not None:
                counts.append(0)
            return i + 1
        return len(records)

    def dead_letter(self, error: StepError) -> None:
        outputs = getattr(self, "outputs", None)
        if outputs is None:
            raise error
        outputs.dead_letter(error)

    def next_timer(self, domain: int) -> int:
        store = self.backend.timer_store(create=False)
        return store.next_due(domain, self.owned) if store is not None else 2**63 - 1

    def fire(self, domain: int, limit: int) -> Records | None:
        store = self.backend.timer_store(create=False)
        if store is None or not len(self.owned):
            return None
        b, ctx, on_timer = self.backend, self.ctx, self.fn.on_timer
        out: list = []
        out_ts: list = []
        ctx.domain = TimeDomain.EVENT_TIME if domain == EVENT else TimeDomain.PROCESSING_TIME
        while True:  # timers registered while firing fire in the same round if already due
            stamps, kgs, rows = store.pop_due(domain, self.owned, limit)
            if not len(stamps):
                break
            code = (kgs.astype(np.int64) << 40) | rows
            _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
            b.begin(kgs[first], rows[first], self.table.keys_at(kgs[first], rows[first]))
            u = 0
            slots, times = inverse.tolist(), stamps.tolist()
            left = np.bincount(inverse).tolist()  # each key's timers still to fire this round
            deferred: set[int] = set()
            try:
                for j, (u, ctx.ts) in enumerate(zip(slots, times)):
                    if u in deferred:
                        continue
                    left[u] -= 1
                    b.current = u
                    res = on_timer(ctx.ts, ctx)
                    if res is not None:
                        before = len(out)
                        out.extend(res)
                        out_ts.extend([ctx.ts] * (len(out) - before))
                    if left[u] and b.has_timer_ops(domain, u):
                        # the timer changed its key's timers: put the key's later ones back so the
                        # next round fires them in order with the new ones (or not, if deleted)
                        later = [t for v, t in zip(slots[j + 1 :], times[j + 1 :]) if v == u]
                        b.defer_timers(domain, u, later)
                        deferred.add(u)
            except Exception as e:
                raise StepError(self.name, f"timer at {ctx.ts}", b.keys[u], e, "on_timer") from e
            b.end()
        if not out:
            return None
        return split_outputs(out, out_ts, self.timestamped, self.spec.output_type)


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
            self._fallback.open(self._runtime_context)

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
        if self._fallback is not None:
            return self._fallback.process(batch, kgs)
        return self._located(batch, kgs, layout)

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
        _, _, rows, uidx, first = self.locate(batch, kgs)
        table, arena = self.table, self.table.arena
        table.ensure_columns(layout.sid, np.unique(kgs), 8 * layout.width)
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
            self.table.write_var(sid, ukgs[idx], urows[idx], [pickle.dumps(v, protocol=5) for v in picked])
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
        key_col, mode = op.key_column(batch)
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


def make_operator(spec: OperatorSpec, name: str, table: KeyedTable) -> KeyedOperator:
    if spec.kind == "process":
        return ProcessOperator(spec, name, table)
    if spec.kind == "aggregate":
        return AggregateOperator(spec, name, table)
    if spec.kind == "vector_window":
        from stretch.runtime.vector_window import VectorWindowOperator

        return VectorWindowOperator(spec, name, table)
    if spec.kind == "band_join":
        from stretch.runtime.band_join import BandJoinOperator

        return BandJoinOperator(spec, name, table)
    raise ValueError(f"unknown keyed operator kind {spec.kind!r}")
