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

from stretch.datastream import state as api_state
from stretch.datastream.functions import KeyedProcessFunction, RuntimeContext, TimerService
from stretch.plan.stages import OperatorSpec
from stretch.runtime.chain import KEY_COLUMN, Records, StepError, resolve_field
from stretch.state import _table_kernels as K
from stretch.state.backend import KeyedStateBackend
from stretch.state.codecs import numeric_dtype
from stretch.state.key_codec import decode_key
from stretch.state.keyed_table import KeyedTable, KeyMode, key_mode_of

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


class _NoTimers(TimerService):
    """Processing time only: event time and timers arrive with the watermark machinery."""

    def current_processing_time(self) -> int:
        return time.time_ns() // 1_000_000

    def current_watermark(self) -> int:
        return -(2**63)

    def _unsupported(self, *_):
        raise NotImplementedError("timers are not supported yet by this version of stretch")

    register_processing_time_timer = register_event_time_timer = _unsupported
    delete_processing_time_timer = delete_event_time_timer = _unsupported


class KeyedContext(KeyedProcessFunction.Context):
    """The ``ctx`` of process_element: the current key and the timer service."""

    __slots__ = ("_b", "_timers")

    def __init__(self, backend: KeyedStateBackend):
        self._b = backend
        self._timers = _NoTimers()

    def get_current_key(self):
        return self._b.keys[self._b.current]

    def timer_service(self) -> TimerService:
        return self._timers

    def timestamp(self):
        return None


class KeyedOperator:
    """Shared part: the state tables, and keys -> table rows -> batch-unique key slots."""

    def __init__(self, spec: OperatorSpec, name: str, table: KeyedTable):
        self.spec = spec
        self.name = name
        self.table = table
        self.backend = KeyedStateBackend(table)
        self._scratch = np.zeros(0, dtype=np.int64)

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
        self.ctx = KeyedContext(self.backend)

    def open(self, runtime_context) -> None:
        self.fn.open(runtime_context)

    def close(self) -> None:
        self.fn.close()

    def process(self, batch: pa.RecordBatch, kgs: np.ndarray) -> Records:
        col, mode, rows, uidx, first = self.locate(batch, kgs)
        b = self.backend
        b.begin(kgs[first], rows[first], self.python_keys(col, mode, first))
        records = Records(batch=batch).items()
        out: list = []
        ext = out.extend
        pe = self.fn.process_element
        ctx = self.ctx
        u = 0
        record = None
        try:
            for u, record in zip(uidx.tolist(), records):
                b.current = u
                res = pe(record, ctx)
                if res is not None:
                    ext(res)
        except Exception as e:
            raise StepError(self.name, record, b.keys[u], e, "process_element") from e
        b.end()
        return Records(items=out, type_info=self.spec.output_type)


class AggregateOperator(KeyedOperator):
    """Flink's rolling sum/min/max over one or more numeric fields, vectorized.

    As in Flink, each input record yields one output record: the aggregated fields hold the running
    result, every other field the value it had in the key's first record.
    """

    def __init__(self, spec, name, table):
        super().__init__(spec, name, table)
        self.op = _OPS[spec.op]
        self._sids: dict[str, int] = {}

    def _sid(self, label: str, storage: str) -> int:
        sid = self._sids.get(label)
        if sid is None:
            entry = {"name": label, "kind": "value", "storage": storage, "type": None}
            sid = self._sids[label] = self.table.arena.register_state(entry)
        return sid

    def process(self, batch: pa.RecordBatch, kgs: np.ndarray) -> Records:
        col, mode, rows, uidx, first = self.locate(batch, kgs)
        schema = batch.schema
        agg_idx = {resolve_field(schema, f) for f in self.spec.fields}
        key_idx = -1 if self.spec.key.field is None else resolve_field(schema, self.spec.key.field)
        columns = list(batch.columns)
        for i, name in enumerate(schema.names):
            if name.startswith("__") or i == key_idx:
                continue
            if i in agg_idx:
                columns[i] = self._aggregate(name, columns[i], kgs, rows, mode, first, col)
            else:
                columns[i] = self._first_value(name, columns[i], kgs, rows, uidx, first)
        out = pa.RecordBatch.from_arrays(columns, schema=schema)
        keep = [i for i, n in enumerate(schema.names) if not n.startswith("__")]
        return Records(batch=out.select(keep))

    def _aggregate(self, name, column, kgs, rows, mode, first, key_col) -> pa.Array:
        t = column.type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t)) or pa.types.is_float16(t):
            raise TypeError(
                f"{self.spec.op} of operator {self.name!r} needs a numeric field; {name!r} is {t}"
            )
        if column.null_count:
            bad = column.is_null().to_numpy(zero_copy_only=False).nonzero()[0][0]
            raise ValueError(
                f"{self.spec.op} of operator {self.name!r}: field {name!r} is null in a record "
                f"(row {bad} of a batch); rolling aggregates need values"
            )
        wide = pa.int64() if pa.types.is_integer(t) else pa.float64()
        values = column.cast(wide).to_numpy(zero_copy_only=False)
        sid = self._sid(f"{self.spec.op}({name})", np.dtype(values.dtype).name)
        result = self.table.aggregate(sid, kgs, rows, values, self.op)
        return pa.array(result).cast(t, safe=False)

    def _first_value(self, name, column, kgs, rows, uidx, first) -> pa.Array:
        ukgs, urows = kgs[first], rows[first]
        dtype = numeric_dtype(column.type)
        if dtype is not None and not column.null_count:
            sid = self._sid(f"first({name})", dtype.name)
            stored, valid = self.table.gather(sid, dtype, ukgs, urows)
            new = valid == 0
            if new.any():
                fresh = column.take(first[new]).to_numpy(zero_copy_only=False).astype(dtype)
                stored[new] = fresh
                self.table.scatter(
                    sid, dtype, ukgs[new], urows[new], fresh, np.ones(int(new.sum()), np.uint8)
                )
            return pa.array(stored[uidx]).cast(column.type)
        sid = self._sid(f"first({name})", "var")
        raw = self.table.read_var(sid, ukgs, urows)
        unique_vals = column.take(first)
        new = [i for i, r in enumerate(raw) if r is None]
        values = [None if r is None else pickle.loads(r) for r in raw]
        if new:
            picked = unique_vals.take(pa.array(new)).to_pylist()
            payloads = []
            for i, v in zip(new, picked):
                values[i] = v
                payloads.append(pickle.dumps(v, protocol=5))
            idx = np.array(new, dtype=np.int64)
            self.table.write_var(sid, ukgs[idx], urows[idx], payloads)
        return pa.array([values[u] for u in uidx.tolist()], type=column.type)


def make_operator(spec: OperatorSpec, name: str, table: KeyedTable) -> KeyedOperator:
    if spec.kind == "process":
        return ProcessOperator(spec, name, table)
    if spec.kind == "aggregate":
        return AggregateOperator(spec, name, table)
    raise ValueError(f"unknown keyed operator kind {spec.kind!r}")
