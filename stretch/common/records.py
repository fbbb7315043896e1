"""Python records <-> Arrow record batches: the conversion every hop of the engine uses.

Layout of a records batch (all contracts, other modules rely on them):

* schema metadata ``RECORD_KIND_KEY`` (``b"stretch.kind"``) says what a record is:

  - ``b"tuple"``: one column per tuple field, named ``f0..fn``; records are tuples;
  - ``b"row"``: one column per Row field, named by the field names; records are :class:`Row`
    named like the columns. As in PyFlink, an unnamed ``Types.ROW`` gives Rows named ``f0..fn``
    (schema metadata ``b"stretch.named": b"default"``); Rows inferred from positional Rows stay
    positional (``b"stretch.named": b"0"``). If any Row's kind is not INSERT, an int8 column
    ``"__row_kind"`` holds ``RowKind.value``;
  - ``b"scalar"``: one column ``f0``; records are its values;
  - ``b"pickled"``: one ``large_binary`` column ``f0`` of ``pickle.dumps(record, protocol=5)``.

* a field whose type is PICKLED_BYTE_ARRAY, or whose values could not be represented in Arrow
  while inferring, is ``large_binary`` with field metadata ``{b"stretch.pickled": b"1"}``;
* nested struct fields carry ``{b"stretch.kind": b"tuple" | b"row"}`` (see ``typeinfo``);
* columns whose names start with ``"__"`` belong to the engine (``__kg``, ``__key``, ...) and are
  never part of a record.

Declared types are checked: a record that does not fit raises ``TypeError`` naming the record's
index, the record, the field and the expected type. Checks are per column and vectorized (the set
of Python types in a column, then pyarrow's own range checks); only when a column fails does a
per-record scan look for the culprit.

Decisions where PyFlink has no exact counterpart: ints are accepted for FLOAT/DOUBLE (widening),
floats and bools are rejected for integer types, None is accepted as null in every field (but a
TUPLE/ROW record itself must not be None), an aware datetime in a SQL_TIMESTAMP field is stored
as its UTC wall clock, INSTANT fields accept Instant or aware datetimes and give back Instant,
and RowKinds of nested Rows are not kept.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any, NoReturn

import pyarrow as pa

from stretch.common.arrow_types import from_arrow_field
from stretch.common.row import Row, RowKind
from stretch.common.type_classes import KIND_KEY, NAMED_KEY, misplaced_type_repr
from stretch.common.typeinfo import (
    PickledBytesTypeInfo,
    RowTypeInfo,
    TupleTypeInfo,
    TypeInformation,
    Types,
)
from stretch.common.value_encoding import (
    MismatchError,
    RecordTypeError,
    dumps_any,
    encode,
    pa_array,
    pickle_values,
    raise_mismatch,
    struct_columns,
)

__all__ = [
    "RECORD_KIND_KEY",
    "ROW_KIND_COLUMN",
    "field_names",
    "records_schema_kind",
    "schema_for",
    "to_batch",
    "type_info_of",
]

RECORD_KIND_KEY = KIND_KEY
ROW_KIND_COLUMN = "__row_kind"

_NONE = type(None)
_INSERT = RowKind.INSERT
_get_values = attrgetter("_values")
_ROW_KINDS = list(RowKind)
_GC_PAUSE_MIN = 2048  # records; below this, pausing the collector costs more than it saves


@contextlib.contextmanager
def gc_paused(n: int) -> Iterator[None]:
    """Pause the cyclic GC while ``n`` records are built or run through user functions.

    Building 1M Rows (or tuples) otherwise triggers dozens of full collections that scan every
    object built so far; pausing is a 5x speedup there. A batch's per-record calls likewise spend
    a tenth of their time in collections that find the batch's records and results all alive.
    Cycles a user function makes are collected after the batch, so they last one batch at most.
    """
    if n < _GC_PAUSE_MIN or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _as_list(records: Any) -> list:
    if isinstance(records, list):
        return records
    if isinstance(records, (str, bytes, dict)) or not isinstance(records, Iterable):
        raise TypeError(f"records must be a list or sequence of records, got {type(records).__name__}")
    return list(records)


# ==================================================================================================
# inference
# ==================================================================================================
PICKLED = Types.PICKLED_BYTE_ARRAY()
_INFER_SIMPLE: dict[type, tuple[TypeInformation, pa.DataType]] = {
    int: (Types.LONG(), pa.int64()),
    float: (Types.DOUBLE(), pa.float64()),
    str: (Types.STRING(), pa.large_string()),
    bytes: (Types.PRIMITIVE_ARRAY(Types.BYTE()), pa.large_binary()),
    bool: (Types.BOOLEAN(), pa.bool_()),
    datetime.datetime: (Types.SQL_TIMESTAMP(), pa.timestamp("us")),
    datetime.date: (Types.SQL_DATE(), pa.date32()),
    datetime.time: (Types.SQL_TIME(), pa.time64("us")),
}
_TZ_TYPES = (datetime.datetime, datetime.time)


def _infer_column(values: list) -> tuple[TypeInformation, pa.Array]:
    """The type and array of one column of Python values; PICKLED when Arrow would change them."""
    types = set(map(type, values))
    types.discard(_NONE)
    if len(types) == 1:
        tp = types.pop()
        simple = _INFER_SIMPLE.get(tp)
        if simple is not None and not (
            tp in _TZ_TYPES and any(v is not None and v.tzinfo is not None for v in values)
        ):
            try:
                return simple[0], pa.array(values, type=simple[1], from_pandas=False)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                pass  # e.g. ints beyond int64
    return PICKLED, pa.array(pickle_values(values), type=pa.large_binary())


def _raise_unpicklable(records: list, exc: MismatchError) -> NoReturn:
    for i, record in enumerate(records):
        try:
            dumps_any(record)
        except MismatchError as found:
            raise RecordTypeError(i, record, f"cannot be pickled: {found.__cause__!r}") from None
    raise TypeError(f"records cannot be pickled: {exc.__cause__!r}") from exc


def _infer_records(records: list) -> tuple[str, TypeInformation, list[pa.Array] | None]:
    """(kind, type, encoded columns or None) for records without a declared type."""
    n = len(records)
    types = set(map(type, records))
    if types == {tuple}:
        lengths = set(map(len, records))
        if len(lengths) == 1 and (arity := lengths.pop()) > 0:
            inferred = [_infer_column(list(map(itemgetter(i), records))) for i in range(arity)]
            return "tuple", Types.TUPLE([t for t, _ in inferred]), [a for _, a in inferred]
    elif types == {Row}:
        fields = list(map(getattr, records, repeat("_fields"), repeat(None)))
        first = fields[0]
        if fields.count(first) == n:
            rows = list(map(_get_values, records))
            lengths = set(map(len, rows))
            arity = lengths.pop() if len(lengths) == 1 else 0
            if arity > 0 and (first is None or len(first) == arity) and _names_ok(first):
                inferred = [_infer_column(list(map(itemgetter(i), rows))) for i in range(arity)]
                field_types = [t for t, _ in inferred]
                row_type = Types.ROW(field_types) if first is None else Types.ROW_NAMED(first, field_types)
                return "row", row_type, [a for _, a in inferred]
    else:
        types.discard(_NONE)
        if len(types) == 1 and next(iter(types)) in _INFER_SIMPLE:
            t, arr = _infer_column(records)
            if t is not PICKLED:
                return "scalar", t, [arr]
    return "pickled", PICKLED, None


def _names_ok(names: list | None) -> bool:
    if names is None:
        return True
    return all(isinstance(n, str) and not n.startswith("__") for n in names) and len(set(names)) == len(names)


# ==================================================================================================
# schemas
# ==================================================================================================
def _kind_of(type_info: TypeInformation) -> str:
    if isinstance(type_info, TupleTypeInfo):
        return "tuple"
    if isinstance(type_info, RowTypeInfo):
        return "row"
    if isinstance(type_info, PickledBytesTypeInfo):
        return "pickled"
    return "scalar"


def field_names(type_info: TypeInformation | None) -> list[str] | None:
    """Column names of the records batch of ``type_info`` (None: decided by the data)."""
    if type_info is None:
        return None
    if isinstance(type_info, (TupleTypeInfo, RowTypeInfo)):
        return type_info.get_field_names()
    return ["f0"]


_schema_cache: dict[TypeInformation, pa.Schema] = {}


def schema_for(type_info: TypeInformation | None) -> pa.Schema | None:
    """The Arrow schema of batches of records of ``type_info``; None means inferred per batch."""
    if type_info is None:
        return None
    schema = _schema_cache.get(type_info)
    if schema is None:
        if not isinstance(type_info, TypeInformation):
            raise TypeError(f"type_info must be a TypeInformation, got {misplaced_type_repr(type_info)}")
        kind = _kind_of(type_info)
        metadata = {RECORD_KIND_KEY: kind.encode()}
        if kind in ("tuple", "row"):
            bad = [n for n in type_info.get_field_names() if n.startswith("__")]  # type: ignore[attr-defined]
            if bad:
                raise ValueError(f"field names starting with '__' are reserved for the engine: {bad}")
            fields = [
                ft.to_arrow_field(name)
                for name, ft in zip(type_info.get_field_names(), type_info.get_field_types(), strict=False)  # type: ignore[attr-defined]
            ]
            if isinstance(type_info, RowTypeInfo) and not type_info.is_named():
                metadata[NAMED_KEY] = b"default"
        else:
            fields = [type_info.to_arrow_field("f0")]
        schema = pa.schema(fields, metadata=metadata)
        if len(_schema_cache) < 4096:
            _schema_cache[type_info] = schema
    return schema


def data_fields(schema: pa.Schema) -> list[int]:
    return [i for i, name in enumerate(schema.names) if not name.startswith("__")]


def records_schema_kind(schema: pa.Schema) -> str:
    """``"tuple"``, ``"row"``, ``"scalar"`` or ``"pickled"``: what from_batch returns.

    Batches without stretch metadata (e.g. from Spark) are tuples if their columns are named
    ``f0..fn`` (a single ``f0``: scalars), else named Rows.
    """
    kind = (schema.metadata or {}).get(RECORD_KIND_KEY)
    if kind is not None:
        return kind.decode()
    names = [schema.names[i] for i in data_fields(schema)]
    if names == ["f0"]:
        return "scalar"
    if names == [f"f{i}" for i in range(len(names))]:
        return "tuple"
    return "row"


def type_info_of(schema: pa.Schema) -> TypeInformation:
    """The record type of batches with this schema (inverse of :func:`schema_for`)."""
    kind = records_schema_kind(schema)
    fields = [schema.field(i) for i in data_fields(schema)]
    if kind == "pickled":
        return PICKLED
    if kind == "scalar":
        return from_arrow_field(fields[0])
    types = [from_arrow_field(f) for f in fields]
    if kind == "tuple":
        return Types.TUPLE(types)
    if (schema.metadata or {}).get(NAMED_KEY) in (b"default", b"0"):
        return Types.ROW(types)
    return Types.ROW_NAMED([f.name for f in fields], types)


# ==================================================================================================
# to_batch
# ==================================================================================================
def to_batch(records: Sequence, type_info: TypeInformation | None = None) -> pa.RecordBatch:
    """Convert Python records to one Arrow record batch (see the module docstring for the layout).

    With ``type_info`` every record is checked against it; a mismatch raises ``TypeError`` naming
    the record's index, the record, the field and the expected type. Without it the layout is
    inferred so that :func:`from_batch` gives back equal objects of the same types.
    """
    records = _as_list(records)
    with gc_paused(len(records)):
        if type_info is None:
            try:
                kind, type_info, arrays = _infer_records(records)
                if arrays is None:  # pickled
                    arrays = [pa.array(pickle_values(records), type=pa.large_binary())]
            except MismatchError as exc:
                _raise_unpicklable(records, exc)
            schema = schema_for(type_info)
            if kind == "row" and not type_info.is_named():  # type: ignore[attr-defined]
                schema = schema.with_metadata({**schema.metadata, NAMED_KEY: b"0"})
        else:
            schema = schema_for(type_info)
            kind = _kind_of(type_info)
            if not records:
                return _empty(schema)
            try:
                arrays = _encode_records(records, type_info, kind)
            except (MismatchError, pa.ArrowException) as exc:
                raise_mismatch(records, type_info, kind, exc)
        batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
        if kind == "row":
            kinds = list(map(getattr, records, repeat("_row_kind"), repeat(_INSERT)))
            if kinds.count(_INSERT) != len(kinds):
                values = [k.value if isinstance(k, RowKind) else 0 for k in kinds]
                batch = batch.append_column(ROW_KIND_COLUMN, pa.array(values, type=pa.int8()))
        return batch


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], type=f.type) for f in schema], schema=schema)


def _encode_records(records: list, type_info: TypeInformation, kind: str) -> list[pa.Array]:
    if kind in ("tuple", "row"):
        columns, _ = struct_columns(records, type_info, allow_none=False)
        return [
            encode(col, ft)
            for col, ft in zip(columns, type_info.get_field_types(), strict=False)  # type: ignore[attr-defined]
        ]
    if kind == "pickled":
        return [pa_array(pickle_values(records), pa.large_binary())]
    return [encode(records, type_info)]
