"""Arrow record batches -> Python records: ``from_batch``, the inverse of ``records.to_batch``
(the layout it reads is described there). Decoding is per column, through NumPy where a column is
fixed-width; Rows are made without ``Row.__init__``."""

from __future__ import annotations

import decimal
import pickle
from itertools import pairwise

import numpy as np
import pyarrow as pa

from stretch.common.arrow_types import from_arrow_field
from stretch.common.records import PICKLED, ROW_KIND_COLUMN, data_fields, gc_paused, records_schema_kind
from stretch.common.row import Row, RowKind
from stretch.common.time import Instant
from stretch.common.type_classes import NAMED_KEY
from stretch.common.typeinfo import TupleTypeInfo, TypeInformation
from stretch.common.value_encoding import category_of, element_type_of

_INSERT = RowKind.INSERT
_ROW_KINDS = list(RowKind)

_TIMESTAMP_US = pa.timestamp("us")
_DATE32 = pa.date32()


def _field_type(field: pa.Field) -> TypeInformation:
    """The type from_batch decodes a column as (an all-null column decodes as Nones)."""
    if pa.types.is_null(field.type):
        return PICKLED
    return from_arrow_field(field)


def _plain_list(arr: pa.Array) -> list:
    """Values of a fixed-width column via NumPy (fast), with None at the nulls."""
    if arr.null_count == 0:
        return arr.to_numpy(zero_copy_only=False).tolist()
    fill = pa.scalar(False) if pa.types.is_boolean(arr.type) else pa.scalar(0, type=arr.type)
    out = arr.fill_null(fill).to_numpy(zero_copy_only=False).tolist()
    for i in np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False)).tolist():
        out[i] = None
    return out


def _with_nulls(arr: pa.Array, out: list) -> list:
    if arr.null_count:
        for i in np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False)).tolist():
            out[i] = None
    return out


def _slice_offsets(arr: pa.Array) -> tuple[list[int], int, int]:
    offsets = arr.offsets.to_numpy(zero_copy_only=False)
    start, stop = int(offsets[0]), int(offsets[-1])
    return (offsets - start).tolist(), start, stop


def _decode(arr: pa.Array, t: TypeInformation) -> list:
    """Python values of one column (None for nulls)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    category = category_of(t)
    if category in ("int", "float", "bool", "timestamp", "date"):
        if category == "timestamp" and arr.type != _TIMESTAMP_US:
            arr = arr.cast(_TIMESTAMP_US, safe=False)
        elif category == "date" and arr.type != _DATE32:
            arr = arr.cast(_DATE32)
        return _plain_list(arr)
    if category == "pickled":
        loads = pickle.loads
        return [None if b is None else loads(b) for b in arr.to_pylist()]
    if category == "struct":
        return _decode_struct(arr, t)
    if category == "list":
        elem = element_type_of(t)
        offsets, start, stop = _slice_offsets(arr)
        elements = _decode(arr.values.slice(start, stop - start), elem)
        out = [elements[a:b] for a, b in pairwise(offsets)]
        return _with_nulls(arr, out)
    if category == "map":
        offsets, start, stop = _slice_offsets(arr)
        keys = _decode(arr.keys.slice(start, stop - start), t._key_type_info)  # type: ignore[attr-defined]
        items = _decode(arr.items.slice(start, stop - start), t._value_type_info)  # type: ignore[attr-defined]
        out = [dict(zip(keys[a:b], items[a:b], strict=False)) for a, b in pairwise(offsets)]
        return _with_nulls(arr, out)
    if category == "bigint":
        return [None if d is None else int(d) for d in arr.to_pylist()]
    if category == "instant":
        if pa.types.is_timestamp(arr.type) and arr.type.unit != "us":  # counts of another unit
            arr = arr.cast(pa.timestamp("us", tz=arr.type.tz), safe=False)
        micros = _plain_list(arr.cast(pa.int64()))
        of_micro = Instant.of_epoch_micro
        return [None if m is None else of_micro(m) for m in micros]
    if category == "decimal":
        return [None if d is None else _unpadded(d) for d in arr.to_pylist()]
    # str, char, bytes, time
    return arr.to_pylist()


def _unpadded(d: decimal.Decimal) -> decimal.Decimal:
    """A BIG_DEC value without the zeros Arrow's fixed scale (18) padded it with: Decimal(3) comes
    back as Decimal('3'), as in Flink, not Decimal('3.000000000000000000')."""
    if d == d.to_integral_value():
        return d.quantize(_ONE)
    return d.normalize()


_ONE = decimal.Decimal(1)


def _decode_struct(arr: pa.StructArray, t: TypeInformation) -> list:
    columns = [_decode(arr.field(i), ft) for i, ft in enumerate(t.get_field_types())]  # type: ignore[attr-defined]
    if isinstance(t, TupleTypeInfo):
        out: list = list(zip(*columns, strict=False))
    else:
        out = _make_rows(columns, t.get_field_names())  # type: ignore[attr-defined]
    return _with_nulls(arr, out)


def _make_rows(columns: list[list], names: list[str] | None, kinds: list | None = None) -> list:
    """Rows from columns without going through ``Row.__init__`` (3x faster)."""
    new = object.__new__
    out = []
    append = out.append
    if names is not None:
        names = list(names)
        for values in zip(*columns, strict=False):
            row = new(Row)
            row._values = list(values)
            row._fields = names
            row._row_kind = _INSERT
            append(row)
    else:
        for values in zip(*columns, strict=False):
            row = new(Row)
            row._values = list(values)
            row._row_kind = _INSERT
            append(row)
    if kinds is not None:
        for row, k in zip(out, kinds, strict=False):
            if k:
                row._row_kind = _ROW_KINDS[k]
    return out


def from_batch(batch: pa.RecordBatch | pa.Table) -> list:
    """The Python records of a batch: tuples, Rows, scalars or unpickled objects, as they went in.

    Columns whose names start with ``"__"`` are ignored (``"__row_kind"`` sets the Rows' kinds).
    """
    n = batch.num_rows
    if n == 0:
        return []
    schema = batch.schema
    kind = records_schema_kind(schema)
    data = data_fields(schema)
    with gc_paused(n):
        if kind in ("scalar", "pickled"):
            if not data:
                raise ValueError(f"a {kind} records batch needs a data column: {schema}")
            field = schema.field(data[0])
            t = PICKLED if kind == "pickled" else _field_type(field)
            return _decode(batch.column(data[0]), t)
        columns = [_decode(batch.column(i), _field_type(schema.field(i))) for i in data]
        if not columns:
            return [() for _ in range(n)] if kind == "tuple" else [Row() for _ in range(n)]
        if kind == "tuple":
            return list(zip(*columns, strict=False))
        kinds = None
        if ROW_KIND_COLUMN in schema.names:
            kind_col = batch.column(schema.get_field_index(ROW_KIND_COLUMN))
            kinds = _plain_list(kind_col.cast(pa.int8()).fill_null(0))
        named = (schema.metadata or {}).get(NAMED_KEY) != b"0"
        names = [schema.names[i] for i in data] if named else None
        return _make_rows(columns, names, kinds)
