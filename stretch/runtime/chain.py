"""Chained stateless steps and the hand-off of records to gates and sinks, inside one stage.

Records move through a chain as whole batches: an Arrow batch, a Python list of records, or both,
converted only when a step needs the other form. A ``to_gate`` step is where a key_by happens:
it computes each record's key and key group once, here in the producer, and appends the batch
with ``__key``/``__kg`` columns to the gate of the keyed operator.
"""

from __future__ import annotations

import time
import traceback

import numpy as np
import pyarrow as pa

from stretch.common.records import from_batch, to_batch
from stretch.common.typeinfo import Types
from stretch.datastream.functions import Function, KeySelector
from stretch.datastream.output_tag import OutputTag
from stretch.plan.stages import KeySpec, Step
from stretch.runtime.event_time import MAX_WATERMARK, WatermarkGenerator, timestamps_of
from stretch.runtime.gate import Kind
from stretch.state.key_codec import encode_key
from stretch.state.key_groups import key_groups_of, key_groups_of_keys, stable_hash

KEY_COLUMN = "__key"
KG_COLUMN = "__kg"
TS_COLUMN = "__ts"
CANONICAL_META = {b"stretch.key": b"canonical"}
INFERRED_META = b"stretch.inferred"


class Records:
    """Records in flight: an Arrow batch, a Python list, or both (each made on demand), and the
    records' event timestamps (epoch ms; the batch's ``__ts`` column in gates) if they have any."""

    __slots__ = ("_batch", "_items", "_ts", "side", "type_info")

    def __init__(
        self,
        batch: pa.RecordBatch | None = None,
        items: list | None = None,
        type_info=None,
        timestamps: np.ndarray | None = None,
        side: dict | None = None,
    ):
        self._batch = batch
        self._items = items
        self.type_info = type_info
        self._ts = timestamps
        self.side = side  # side outputs: tag id -> Records

    def timestamps(self) -> np.ndarray | None:
        if self._ts is None and self._batch is not None and TS_COLUMN in self._batch.schema.names:
            self._ts = self._batch.column(TS_COLUMN).to_numpy()
        return self._ts

    def __len__(self) -> int:
        return self._batch.num_rows if self._batch is not None else len(self._items)

    def items(self) -> list:
        if self._items is None:
            self._items = from_batch(self._batch)
        return self._items

    def batch(self) -> pa.RecordBatch:
        if self._batch is None:
            batch = to_batch(self._items, self.type_info)
            if self.type_info is None:  # remembered so print() can show the records as Python does
                batch = batch.replace_schema_metadata({**(batch.schema.metadata or {}), INFERRED_META: b"1"})
            self._batch = batch
        return self._batch

    def data_batch(self) -> pa.RecordBatch:
        """The batch without engine columns (``__kg``, ``__key``)."""
        b = self.batch()
        keep = [
            i for i, name in enumerate(b.schema.names) if not name.startswith("__") or name == "__row_kind"
        ]
        return b if len(keep) == b.num_columns else b.select(keep)


class StepError(Exception):
    """A user function failed on a record; carries what the job error must name."""

    def __init__(self, operator: str, record, key, cause: BaseException, what: str = "user function"):
        self.operator = operator
        self.record = record
        self.key = key
        self.cause = cause
        self.what = what
        self.user_traceback = "".join(traceback.format_exception(cause))
        super().__init__(describe_failure(operator, record, key, cause, what))


def describe_failure(operator: str, record, key, cause: BaseException, what: str = "user function") -> str:
    key_part = "" if key is _NO_KEY else f", key {_short(key)}"
    reason = f"{type(cause).__name__}: {cause}"
    return f"{what} of operator {operator!r} failed on record {_short(record)}{key_part}: {reason}"


_NO_KEY = object()


def _short(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call_of(fn, method: str):
    """The callable behind a user function object or plain callable."""
    if isinstance(fn, Function):
        return getattr(fn, method)
    if callable(fn):
        return fn
    raise TypeError(f"{fn!r} is neither a {method} function nor callable")


class Chain:
    """Runs a stage's chained steps on each batch and hands results to gates and sinks."""

    def __init__(self, steps: list[Step], stage_name: str, outputs: Outputs):
        self.roots = [_make(s, stage_name, outputs) for s in steps]
        self.functions = [f for r in self.roots for f in r.functions()]
        self.nodes = [n for r in self.roots for n in r.walk()]

    def open(self, runtime_context) -> None:
        for f in self.functions:
            f.open(runtime_context)
        for n in self.nodes:
            n.open()

    def close(self) -> None:
        for f in self.functions:
            f.close()
        for n in self.nodes:
            n.close()

    def push(self, records: Records) -> None:
        if records is None:
            return
        side = records.side
        for r in self.roots:
            if isinstance(r, _Side):
                part = side.get(r.tag.tag_id) if side else None
                if part is not None and len(part):
                    r.forward(part)
            elif len(records):
                r.push(records)

    def emit(self, kind, value: int = 0) -> None:
        """A watermark (or IDLE/LEAVE) of this producer to every gate the chain feeds."""
        for n in self.nodes:
            if isinstance(n, _ToGate):
                n.control(kind, value)

    def tick(self) -> None:
        """Time passes without records: watermark generators may declare the producer idle."""
        for n in self.nodes:
            if isinstance(n, _Assign):
                n.tick()

    def finish(self) -> None:
        """End of a bounded input: watermarks advance to the maximum, firing everything downstream."""
        for n in self.nodes:
            if isinstance(n, _ToGate):
                n.control(Kind.WATERMARK, MAX_WATERMARK)


class Outputs:
    """Where a stage's terminal steps write: gates, sink gates and chained sinks by id."""

    def __init__(
        self, gates: dict, sink_gates: dict, sinks: dict, producer: int, count_out, producer_id: int = 0
    ):
        self.gates = gates
        self.sink_gates = sink_gates
        self.sinks = sinks  # sink id -> SinkSpec, for sinks chained into this stage
        self.producer = producer  # 1-based instance index (print prefixes)
        self.producer_id = producer_id  # stage and instance, in watermark records
        self.count_out = count_out
        self.dead_letter_gate = None  # the job's dead-letter policy: where rejected records go

    def dead_letter(self, error: StepError) -> None:
        """Under the dead-letter policy: the record, the error and the time go to the job's
        dead-letter channel; the caller skips the record. Otherwise the error fails the job."""
        if self.dead_letter_gate is None:
            raise error
        self.dead_letter_gate.append_batch(dead_letter_batch(error), producer=self.producer)


DEAD_LETTER_SCHEMA = pa.schema(
    [
        ("operator", pa.string()),
        ("function", pa.string()),
        ("record", pa.string()),
        ("key", pa.string()),
        ("error", pa.string()),
        ("traceback", pa.string()),
        ("time", pa.timestamp("ms", tz="UTC")),
    ]
)


def dead_letter_batch(error: StepError) -> pa.RecordBatch:
    key = None if error.key is _NO_KEY else repr(error.key)
    values = [
        error.operator,
        error.what,
        repr(error.record),
        key,
        f"{type(error.cause).__name__}: {error.cause}",
        error.user_traceback,
        int(time.time() * 1000),
    ]
    return pa.record_batch(
        [pa.array([v], f.type) for v, f in zip(values, DEAD_LETTER_SCHEMA)], DEAD_LETTER_SCHEMA
    )


def per_record(items: list, f, stage: str, what: str, outputs: Outputs) -> tuple[list, list[int]]:
    """``f`` of each record, one by one, after a batch failed: the failing records go to dead
    letters (or the first fails the job). Returns the results and the indexes they belong to."""
    out, kept = [], []
    for i, r in enumerate(items):
        try:
            out.append(f(r))
        except Exception as e:
            e.__suppress_context__ = True  # raised while handling the batch's failure: unrelated
            err = StepError(stage, r, _NO_KEY, e, what)
            err.__cause__ = e
            outputs.dead_letter(err)
            continue
        kept.append(i)
    return out, kept


def _take(ts: np.ndarray | None, kept: list[int]) -> np.ndarray | None:
    return None if ts is None else ts[np.asarray(kept, dtype=np.int64)]


class _Node:
    def __init__(self, step: Step, stage_name: str, outputs: Outputs):
        self.step = step
        self.stage_name = stage_name
        self.outputs = outputs
        self.children = [_make(c, stage_name, outputs) for c in step.children]

    @property
    def operator(self) -> str:
        """The name errors give: the step's own (``.name(...)``, else Flink's "Map" and so on)."""
        return self.step.name or self.stage_name

    def gates_below(self) -> list:
        return [n for n in self.walk() if isinstance(n, _ToGate)]

    def functions(self) -> list:
        own = [self.step.fn] if isinstance(self.step.fn, Function) else []
        return own + [f for c in self.children for f in c.functions()]

    def walk(self):
        yield self
        for c in self.children:
            yield from c.walk()

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def forward(self, records: Records) -> None:
        if len(records):
            for c in self.children:
                c.push(records)


class _Map(_Node):
    def push(self, records: Records) -> None:
        f = call_of(self.step.fn, "map")
        items = records.items()
        ts = records.timestamps()
        try:
            out = [f(r) for r in items]
        except Exception:
            out, kept = per_record(items, f, self.operator, "map function", self.outputs)
            ts = _take(ts, kept)
        self.forward(Records(items=out, type_info=self.step.output_type, timestamps=ts))


class _FlatMap(_Node):
    def push(self, records: Records) -> None:
        f = call_of(self.step.fn, "flat_map")
        try:
            flat = self._flat_mapped(records, f)
        except StepError:  # this step's own failure (the children run below, outside the try)
            if self.outputs.dead_letter_gate is None:
                raise
            items = records.items()  # again, record by record, rejecting the ones that fail
            results, kept = per_record(
                items, lambda r: list(f(r) or ()), self.operator, "flat_map function", self.outputs
            )
            ts = records.timestamps()
            out = [x for res in results for x in res]
            out_ts = np.repeat(_take(ts, kept), [len(res) for res in results]) if ts is not None else None
            flat = Records(items=out, type_info=self.step.output_type, timestamps=out_ts)
        self.forward(flat)

    def _flat_mapped(self, records: Records, f) -> Records:
        out: list = []
        ext = out.extend
        record = None
        ts = records.timestamps()
        counts = [] if ts is not None else None
        try:
            for record in records.items():
                res = f(record)
                if res is not None:
                    before = len(out)
                    ext(res)
                    if counts is not None:
                        counts.append(len(out) - before)
                elif counts is not None:
                    counts.append(0)
        except Exception as e:
            raise StepError(self.operator, record, _NO_KEY, e, "flat_map function") from e
        out_ts = np.repeat(ts, counts) if ts is not None else None
        return Records(items=out, type_info=self.step.output_type, timestamps=out_ts)


class _Filter(_Node):
    def push(self, records: Records) -> None:
        f = call_of(self.step.fn, "filter")
        items = records.items()
        try:
            mask = [bool(f(r)) for r in items]
        except Exception:
            results, kept = per_record(
                items, lambda r: bool(f(r)), self.operator, "filter function", self.outputs
            )
            mask = [False] * len(items)  # rejected records do not pass
            for i, ok in zip(kept, results):
                mask[i] = ok
        ts = records.timestamps()
        keep_ts = ts[np.array(mask, dtype=bool)] if ts is not None else None
        if records._batch is not None:
            out = Records(
                batch=records._batch.filter(pa.array(mask)), type_info=records.type_info, timestamps=keep_ts
            )
            out._items = [r for r, m in zip(items, mask) if m]
        else:
            out = Records(
                items=[r for r, m in zip(items, mask) if m], type_info=records.type_info, timestamps=keep_ts
            )
        self.forward(out)


def _culprit(items: list, f):
    """The first record on which ``f`` raises (re-run only after a failure)."""
    for r in items:
        try:
            f(r)
        except Exception:
            return r
    return None


class _ToSink(_Node):
    def __init__(self, step, stage_name, outputs):
        super().__init__(step, stage_name, outputs)
        self.gate = outputs.sink_gates[step.sink]

    def push(self, records: Records) -> None:
        batch = records.data_batch()
        self.outputs.count_out(batch.num_rows)
        self.gate.append_batch(batch, producer=self.outputs.producer)


class _Assign(_Node):
    """assign_timestamps_and_watermarks (or a source's strategy): event timestamps for the
    records, and watermarks, per Flink's rule, to the gates downstream of this step."""

    def __init__(self, step, stage_name, outputs):
        super().__init__(step, stage_name, outputs)
        self.strategy = step.fn
        self.generator = WatermarkGenerator(self.strategy)
        self.assigner = self.strategy.timestamp_assigner

    def functions(self) -> list:
        return [f for c in self.children for f in c.functions()]

    def push(self, records: Records) -> None:
        ts = self._timestamps(records)
        if ts is not None:
            records = Records(records._batch, records._items, records.type_info, ts)
        self.forward(records)
        ts = records.timestamps()
        if ts is not None:
            wm = self.generator.on_timestamps(ts)
            if wm is not None:
                for g in self.gates_below():
                    g.control(Kind.WATERMARK, wm)

    def _timestamps(self, records: Records) -> np.ndarray | None:
        a = self.assigner
        if a is None:
            return None
        if isinstance(a, str):  # beyond PyFlink: a field holding the timestamp, read as a column
            batch = records.data_batch()
            return timestamps_of(batch.column(resolve_field(batch.schema, a)))
        previous = records.timestamps()
        prev = previous.tolist() if previous is not None else [-(2**63)] * len(records)
        items = records.items()
        try:
            return np.array([a.extract_timestamp(r, p) for r, p in zip(items, prev)], dtype=np.int64)
        except Exception as e:
            culprit = _culprit(items, lambda r: a.extract_timestamp(r, -(2**63)))
            raise StepError(self.operator, culprit, _NO_KEY, e, "timestamp assigner") from e

    def tick(self) -> None:
        if self.generator.check_idle():
            for g in self.gates_below():
                g.control(Kind.IDLE)


class _Side(_Node):
    """The start of a side output's chain: receives the records yielded with its OutputTag."""

    def __init__(self, step, stage_name, outputs):
        super().__init__(step, stage_name, outputs)
        self.tag = step.fn

    def push(self, records: Records) -> None:
        self.forward(records)


def split_outputs(items: list, stamps: list | None, timestamped: bool, type_info) -> Records:
    """A keyed operator's outputs as Records: ``(tag, value)`` pairs go to their side outputs,
    and for functions that emit ``(value, timestamp)`` pairs the timestamps are taken apart."""
    if timestamped:
        stamps = [ts for _, ts in items]
        items = [v for v, _ in items]
    side: dict = {}
    if any(type(o) is tuple and len(o) == 2 and type(o[0]) is OutputTag for o in items):
        main, main_ts = [], []
        for i, o in enumerate(items):
            if type(o) is tuple and len(o) == 2 and type(o[0]) is OutputTag:
                vals, tss, _ = side.setdefault(o[0].tag_id, ([], [], o[0]))
                vals.append(o[1])
                tss.append(stamps[i] if stamps is not None else None)
            else:
                main.append(o)
                main_ts.append(stamps[i] if stamps is not None else None)
        items, stamps = main, (main_ts if stamps is not None else None)
        side = {
            tid: Records(
                items=v, type_info=tag.type_info, timestamps=_stamps(t) if stamps is not None else None
            )
            for tid, (v, t, tag) in side.items()
        }
    return Records(items=items, type_info=type_info, timestamps=_stamps(stamps), side=side or None)


def _stamps(stamps) -> np.ndarray | None:
    return None if stamps is None else np.array(stamps, dtype=np.int64)


class _ToChainedSink(_Node):
    """A sink that runs inside the producing instance (e.g. DiscardingSink)."""

    def __init__(self, step, stage_name, outputs):
        super().__init__(step, stage_name, outputs)
        self.spec = outputs.sinks[step.sink]
        self.writer = None

    def open(self) -> None:
        self.writer = self.spec.sink.create_writer(self.spec.upstream_parallelism)

    def close(self) -> None:
        self.writer.close()

    def push(self, records: Records) -> None:
        self.outputs.count_out(len(records))
        self.writer.write_records(records, self.outputs.producer)


class _ToGate(_Node):
    def __init__(self, step, stage_name, outputs):
        super().__init__(step, stage_name, outputs)
        self.gate = outputs.gates[step.gate]
        self.key: KeySpec = step.key

    def control(self, kind, value: int = 0) -> None:
        self.gate.append_control(kind, self.outputs.producer_id, value)

    def push(self, records: Records) -> None:
        key = self.key
        if key.field is not None:
            batch = records.data_batch()
            column = batch.column(resolve_field(batch.schema, key.field))
            kgs = key_groups_of(column, key.max_parallelism)
            extra = []
            if not (
                pa.types.is_integer(column.type)
                or pa.types.is_boolean(column.type)
                or pa.types.is_string(column.type)
                or pa.types.is_large_string(column.type)
                or pa.types.is_binary(column.type)
                or pa.types.is_large_binary(column.type)
            ):
                extra = [
                    (
                        pa.field(KEY_COLUMN, pa.large_binary(), metadata=CANONICAL_META),
                        pa.array([encode_key(k) for k in column.to_pylist()], pa.large_binary()),
                    )
                ]
        else:
            items = records.items()
            keys, kept = self._keys(items)
            if kept is not None:  # records whose key selector failed went to dead letters
                if not kept:
                    return
                items = [items[i] for i in kept]
                records = Records(
                    items=items, type_info=records.type_info, timestamps=_take(records.timestamps(), kept)
                )
            kgs = self._key_groups(items, keys)
            extra = [key_column(keys, key.key_type)]
            batch = records.data_batch()
        for f, arr in extra:
            batch = batch.append_column(f, arr)
        ts = records.timestamps()
        if ts is not None:
            batch = batch.append_column(TS_COLUMN, pa.array(ts, type=pa.int64()))
        batch = batch.append_column(KG_COLUMN, pa.array(kgs, type=pa.uint16()))
        self.outputs.count_out(batch.num_rows)
        self.gate.append_batch(batch, producer=self.outputs.producer)

    def _keys(self, items: list) -> tuple[list, list[int] | None]:
        """Each record's key, and which records have one (None: all of them)."""
        sel = self.key.selector.get_key if isinstance(self.key.selector, KeySelector) else self.key.selector
        try:
            return [sel(r) for r in items], None
        except Exception:
            return per_record(items, sel, self.operator, "key selector", self.outputs)

    def _key_groups(self, items: list, keys: list) -> np.ndarray:
        try:
            return key_groups_of_keys(keys, self.key.max_parallelism)
        except TypeError:
            for r, k in zip(items, keys):
                try:
                    stable_hash(k)
                except TypeError:
                    raise TypeError(
                        f"key_by of operator {self.operator!r}: record {_short(r)} has key {_short(k)} "
                        f"of type {type(k).__name__}, which cannot be hashed stably; keys must be int, "
                        "float, str, bytes, bool, None or tuples of these"
                    ) from None
            raise


def key_column(keys: list, key_type) -> tuple[pa.Field, pa.Array]:
    """The ``__key`` column for keys a selector returned: int64, string, bytes, or canonical bytes."""
    if key_type is not None and key_type != Types.PICKLED_BYTE_ARRAY():
        arrow = key_type.to_arrow()
        try:
            if pa.types.is_integer(arrow) or pa.types.is_boolean(arrow):
                if not all(isinstance(k, int) for k in keys):
                    raise TypeError("not an int")
                return pa.field(KEY_COLUMN, pa.int64()), pa.array(keys, pa.int64())
            if pa.types.is_string(arrow) or pa.types.is_large_string(arrow):
                return pa.field(KEY_COLUMN, pa.large_string()), pa.array(keys, pa.large_string())
        except (TypeError, pa.ArrowException, OverflowError):
            bad = next((k for k in keys if not _matches(k, arrow)), None)
            raise TypeError(f"key {_short(bad)} does not match the declared key_type {key_type!r}") from None
    elif key_type is None:
        kinds = {type(k) for k in keys}
        if kinds <= {int, bool}:
            try:
                return pa.field(KEY_COLUMN, pa.int64()), pa.array(keys, pa.int64())
            except (OverflowError, pa.ArrowException):
                pass
        elif kinds == {str}:
            return pa.field(KEY_COLUMN, pa.large_string()), pa.array(keys, pa.large_string())
        elif kinds == {bytes}:
            return pa.field(KEY_COLUMN, pa.large_binary()), pa.array(keys, pa.large_binary())
    field = pa.field(KEY_COLUMN, pa.large_binary(), metadata=CANONICAL_META)
    return field, pa.array([encode_key(k) for k in keys], pa.large_binary())


def _matches(k, arrow) -> bool:
    if pa.types.is_integer(arrow) or pa.types.is_boolean(arrow):
        return isinstance(k, int)
    return isinstance(k, str)


def resolve_field(schema: pa.Schema, field: str | int) -> int:
    """Column index of a record field given by name or by position among the data columns."""
    data = [i for i, name in enumerate(schema.names) if not name.startswith("__")]
    if isinstance(field, int):
        if not 0 <= field < len(data):
            raise IndexError(f"field position {field} is out of range for records with {len(data)} fields")
        return data[field]
    if field not in schema.names or field.startswith("__"):
        names = [schema.names[i] for i in data]
        raise KeyError(f"records have no field {field!r} (fields: {names})")
    return schema.get_field_index(field)


_KINDS = {
    "map": _Map,
    "flat_map": _FlatMap,
    "filter": _Filter,
    "to_sink": _ToSink,
    "to_chained_sink": _ToChainedSink,
    "to_gate": _ToGate,
    "assign": _Assign,
    "side": _Side,
}


def _make(step: Step, stage_name: str, outputs: Outputs) -> _Node:
    return _KINDS[step.kind](step, stage_name, outputs)
