"""Python values of a declared type into Arrow arrays, checked: what ``records.to_batch`` does
per column. The fast path converts a column at a time (the set of Python types in it, then
pyarrow's own range checks); only when a column fails does the slow path find the culprit record
and say which field of it does not fit and why (``RecordTypeError``)."""

from __future__ import annotations

import datetime
import decimal
import pickle
from collections.abc import Sequence
from itertools import chain, repeat
from operator import attrgetter, itemgetter
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa

from stretch.common.row import Row
from stretch.common.time import Instant
from stretch.common.type_classes import _ArrayTypeInfo
from stretch.common.typeinfo import (
    BasicType,
    BasicTypeInfo,
    DateTypeInfo,
    ListTypeInfo,
    MapTypeInfo,
    PickledBytesTypeInfo,
    RowTypeInfo,
    TimestampTypeInfo,
    TimeTypeInfo,
    TupleTypeInfo,
    TypeInformation,
    type_expr,
)
from stretch.common.user_code import SCRIPT_MARK, dumps_value

PICKLE_PROTOCOL = 5
_NONE = type(None)
_get_values = attrgetter("_values")
_REPR_LIMIT = 200


class RecordTypeError(TypeError):
    """A record that does not fit the declared type (or cannot be pickled): the message names its
    index among the records converted; ``record`` and ``reason`` let a caller to whom that index
    means nothing (a batch of an operator's outputs) say it its own way."""

    def __init__(self, index: int, record: Any, reason: str):
        self.index = index
        self.record = record
        self.reason = reason  # e.g. "does not match Types.LONG(): expected LONG, got str 'x'"
        super().__init__(f"record {index} {_short_repr(record)} {reason}")


class MismatchError(Exception):
    """A column does not fit its declared type; the caller finds the culprit record."""


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__} with failing repr: {exc!r}>"
    if len(text) > _REPR_LIMIT:
        text = text[: _REPR_LIMIT - 3] + "..."
    return text


# ==================================================================================================
# type categories
# ==================================================================================================
# One category per way of converting a column. Scalars: (category, arrow type).
_INT_RANGES = {
    BasicType.BYTE: (-(2**7), 2**7 - 1),
    BasicType.SHORT: (-(2**15), 2**15 - 1),
    BasicType.INT: (-(2**31), 2**31 - 1),
    BasicType.LONG: (-(2**63), 2**63 - 1),
}
_BASIC_CATEGORY = {
    BasicType.BYTE: "int",
    BasicType.SHORT: "int",
    BasicType.INT: "int",
    BasicType.LONG: "int",
    BasicType.FLOAT: "float",
    BasicType.DOUBLE: "float",
    BasicType.BOOLEAN: "bool",
    BasicType.STRING: "str",
    BasicType.CHAR: "char",
    BasicType.BIG_INT: "bigint",
    BasicType.BIG_DEC: "decimal",
    BasicType.INSTANT: "instant",
}


def category_of(t: TypeInformation) -> str:
    if isinstance(t, BasicTypeInfo):
        return _BASIC_CATEGORY[t._basic_type]
    if isinstance(t, PickledBytesTypeInfo):
        return "pickled"
    if isinstance(t, (TupleTypeInfo, RowTypeInfo)):
        return "struct"
    if isinstance(t, MapTypeInfo):
        return "map"
    if isinstance(t, _ArrayTypeInfo):
        if t.to_arrow() == pa.large_binary():
            return "bytes"
        return "list"
    if isinstance(t, ListTypeInfo):
        return "list"
    if isinstance(t, DateTypeInfo):
        return "date"
    if isinstance(t, TimeTypeInfo):
        return "time"
    if isinstance(t, TimestampTypeInfo):
        return "timestamp"
    raise TypeError(f"unsupported type information {t!r}")


def element_type_of(t: TypeInformation) -> TypeInformation:
    return t.elem_type if isinstance(t, ListTypeInfo) else t._element_type  # type: ignore[attr-defined]


def _is_int(tp: type) -> bool:
    return issubclass(tp, (int, np.integer)) and not issubclass(tp, bool)


def _is_date(tp: type) -> bool:
    return issubclass(tp, datetime.date) and not issubclass(tp, datetime.datetime)


_ACCEPTS = {
    "int": _is_int,
    "float": lambda tp: _is_int(tp) or issubclass(tp, (float, np.floating)),
    "bool": lambda tp: issubclass(tp, (bool, np.bool_)),
    "str": lambda tp: issubclass(tp, str),
    "char": lambda tp: issubclass(tp, str),
    "bytes": lambda tp: issubclass(tp, (bytes, bytearray, memoryview)),
    "bigint": _is_int,
    "decimal": lambda tp: issubclass(tp, decimal.Decimal) or _is_int(tp),
    "date": _is_date,
    "time": lambda tp: issubclass(tp, datetime.time),
    "timestamp": lambda tp: issubclass(tp, datetime.datetime),
    "instant": lambda tp: issubclass(tp, (Instant, datetime.datetime)),
    "list": lambda tp: issubclass(tp, (list, tuple, np.ndarray)),
    "map": lambda tp: issubclass(tp, dict),
    "pickled": lambda tp: True,
}
_accept_cache: dict[tuple[str, type], bool] = {}


def _accepts(category: str, tp: type) -> bool:
    key = (category, tp)
    ok = _accept_cache.get(key)
    if ok is None:
        ok = tp is _NONE or _ACCEPTS[category](tp)
        _accept_cache[key] = ok
    return ok


def _struct_accepts(t: TypeInformation, v: Any) -> bool:
    if isinstance(v, (tuple, list, Row)):
        return True
    return isinstance(t, RowTypeInfo) and isinstance(v, dict)


def _struct_expectation(t: TypeInformation) -> str:
    return "a tuple, list, Row or dict" if isinstance(t, RowTypeInfo) else "a tuple, list or Row"


# ==================================================================================================
# encoding: Python values -> Arrow arrays (raise MismatchError on any problem)
# ==================================================================================================
def _gate(values: Sequence, category: str, seen: set | None = None) -> set:
    """Check the Python types present in a column; returns them."""
    types = set(map(type, values)) if seen is None else seen
    for tp in types:
        if not _accepts(category, tp):
            raise MismatchError
    return types


def pa_array(values: Sequence, arrow_type: pa.DataType) -> pa.Array:
    try:
        return pa.array(values, type=arrow_type, from_pandas=False)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise MismatchError from exc


def _dt_micros(v: datetime.datetime) -> int:
    return Instant.of_datetime(v).to_epoch_micro()


def pickle_values(values: Sequence) -> list:
    dumps = pickle.dumps
    try:
        out = [None if v is None else dumps(v, PICKLE_PROTOCOL) for v in values]
    except Exception:
        return [None if v is None else dumps_any(v) for v in values]
    if SCRIPT_MARK in b"".join(filter(None, out)):  # one scan of all, not one per record
        return [b if b is None or SCRIPT_MARK not in b else dumps_any(v) for v, b in zip(values, out)]
    return out


def dumps_any(v: Any) -> bytes:
    """``user_code.dumps_value``: pickle, or by value what a worker could not import."""
    try:
        return dumps_value(v)
    except Exception as exc:
        raise MismatchError from exc


def encode(values: Sequence, t: TypeInformation, seen: set | None = None) -> pa.Array:
    """Encode one column of Python values (None = null) as an Arrow array of ``t.to_arrow()``."""
    category = category_of(t)
    if category == "struct":
        children, mask = struct_columns(values, t, allow_none=True)
        return _struct_array(children, t, mask)
    if category == "list":
        return _encode_list(values, t, seen)
    if category == "map":
        return _encode_map(values, t, seen)
    if category == "pickled":
        return pa_array(pickle_values(values), pa.large_binary())
    _gate(values, category, seen)
    if category == "instant":
        micros = [
            None if v is None else (v.to_epoch_micro() if isinstance(v, Instant) else _dt_micros(v))
            for v in values
        ]
        return pa_array(micros, pa.int64()).cast(t.to_arrow())
    arr = pa_array(values, t.to_arrow())
    if category == "char" and len(arr) > arr.null_count:
        import pyarrow.compute as pc

        lengths = pc.utf8_length(arr)
        if pc.min(lengths).as_py() != 1 or pc.max(lengths).as_py() != 1:
            raise MismatchError
    return arr


def _struct_array(children: list[list], t: TypeInformation, mask: np.ndarray | None) -> pa.Array:
    field_types = t.get_field_types()  # type: ignore[attr-defined]
    names = t.get_field_names()  # type: ignore[attr-defined]
    arrays = [encode(col, ft) for col, ft in zip(children, field_types, strict=False)]
    fields = [ft.to_arrow_field(name) for name, ft in zip(names, field_types, strict=False)]
    if not arrays:
        raise MismatchError  # Arrow structs need at least one child to carry a length
    mask_arr = None if mask is None else pa.array(mask, type=pa.bool_())
    return pa.StructArray.from_arrays(arrays, fields=fields, mask=mask_arr)


def _row_names(t: TypeInformation) -> list[str] | None:
    """Names a Row record is matched by: a ROW's field names (``f0..fn`` if unnamed)."""
    return t.get_field_names() if isinstance(t, RowTypeInfo) else None


def _positional(v: Any, t: TypeInformation, names: list[str] | None) -> Sequence:
    """One struct value as its field values in declared order (raises MismatchError).

    A named Row is matched by name, as PyFlink's ``Row.get_fields_by_names`` does; for an unnamed
    ROW (names ``f0..fn``) a Row with other names is taken by position instead (PyFlink raises).
    """
    if isinstance(v, Row):
        fields = getattr(v, "_fields", None)
        if names is not None and fields is not None and fields != names:
            if all(name in fields for name in names):
                return [v._values[fields.index(name)] for name in names]
            if t.is_named():  # type: ignore[attr-defined]
                raise MismatchError
        return v._values
    if isinstance(v, (tuple, list)):
        return v
    if isinstance(v, dict) and isinstance(t, RowTypeInfo):
        return [v.get(name) for name in t.get_field_names()]
    raise MismatchError


def struct_columns(
    values: Sequence, t: TypeInformation, allow_none: bool
) -> tuple[list[list], np.ndarray | None]:
    """Split struct values (tuples, lists, Rows, dicts) into per-field columns."""
    field_types = t.get_field_types()  # type: ignore[attr-defined]
    arity = len(field_types)
    named = _row_names(t)
    types = set(map(type, values))
    mask = None
    if _NONE in types:
        if not allow_none:
            raise MismatchError
        mask = np.fromiter((v is None for v in values), dtype=np.bool_, count=len(values))
        filler = (None,) * arity
        values = [filler if v is None else v for v in values]
        types.discard(_NONE)
        types.add(tuple)
    if types <= {tuple, list}:
        rows: Sequence = values
    elif types == {Row}:
        rows = list(map(_get_values, values))
        if named is not None:
            fields = list(map(getattr, values, repeat("_fields"), repeat(None)))
            if fields.count(None) + fields.count(named) != len(fields):
                rows = [_positional(v, t, named) for v in values]
    else:
        rows = [_positional(v, t, named) for v in values]
    if rows and set(map(len, rows)) != {arity}:
        raise MismatchError
    columns = [list(map(itemgetter(i), rows)) for i in range(arity)]
    return columns, mask


def _offsets_and_flat(values: Sequence, category: str, seen: set | None) -> tuple:
    types = _gate(values, category, seen)
    mask = None
    if _NONE in types:
        mask = np.fromiter((v is None for v in values), dtype=np.bool_, count=len(values))
        empty: Any = {} if category == "map" else ()
        values = [empty if v is None else v for v in values]
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    mask_arr = None if mask is None else pa.array(mask, type=pa.bool_())
    return values, offsets, mask_arr


def _encode_list(values: Sequence, t: TypeInformation, seen: set | None) -> pa.Array:
    values, offsets, mask = _offsets_and_flat(values, "list", seen)
    flat = list(chain.from_iterable(values))
    elements = encode(flat, element_type_of(t))
    try:
        return pa.LargeListArray.from_arrays(
            pa.array(offsets, type=pa.int64()), elements, type=t.to_arrow(), mask=mask
        )
    except (pa.ArrowException, ValueError) as exc:
        raise MismatchError from exc


def _encode_map(values: Sequence, t: MapTypeInfo, seen: set | None) -> pa.Array:
    values, offsets, mask = _offsets_and_flat(values, "map", seen)
    keys = list(chain.from_iterable(v.keys() for v in values))
    items = list(chain.from_iterable(v.values() for v in values))
    key_arr = encode(keys, t._key_type_info)
    if key_arr.null_count:
        raise MismatchError
    item_arr = encode(items, t._value_type_info)
    if offsets[-1] > np.iinfo(np.int32).max:
        raise MismatchError
    try:
        return pa.MapArray.from_arrays(
            pa.array(offsets.astype(np.int32), type=pa.int32()),
            key_arr,
            item_arr,
            type=t.to_arrow(),
            mask=mask,
        )
    except (pa.ArrowException, ValueError) as exc:
        raise MismatchError from exc


# ==================================================================================================
# locating the culprit (slow path, only after a column failed)
# ==================================================================================================
def _describe(v: Any) -> str:
    return f"{type(v).__name__} {_short_repr(v)}"


def _problem(v: Any, t: TypeInformation) -> tuple[list[str], str] | None:
    """Why value ``v`` does not fit ``t``: (path inside the value, reason), or None if it fits."""
    if v is None:
        return None
    category = category_of(t)
    if category == "struct":
        if not _struct_accepts(t, v):
            return [], f"expected {_struct_expectation(t)}, got {_describe(v)}"
        return _struct_problem(v, t)
    if category == "pickled":
        try:
            dumps_any(v)
        except MismatchError as exc:
            return [], f"value cannot be pickled: {exc.__cause__!r}"
        return None
    expected = t._short()
    if not _accepts(category, type(v)):
        return [], f"expected {expected}, got {_describe(v)}"
    if category == "list":
        elem = element_type_of(t)
        for j, element in enumerate(v):
            found = _problem(element, elem)
            if found is not None:
                return [f"[{j}]", *found[0]], found[1]
        return None
    if category == "map":
        for key, item in v.items():
            if key is None:
                return [], f"expected {expected}, got a None key"
            found = _problem(key, t._key_type_info)  # type: ignore[attr-defined]
            if found is not None:
                return [f"[key {_short_repr(key)}]", *found[0]], found[1]
            found = _problem(item, t._value_type_info)  # type: ignore[attr-defined]
            if found is not None:
                return [f"[{_short_repr(key)}]", *found[0]], found[1]
        return None
    if category == "int":
        lo, hi = _INT_RANGES[t._basic_type]  # type: ignore[attr-defined]
        if not lo <= int(v) <= hi:
            return [], f"expected {expected}, got {_describe(v)} (out of range [{lo}, {hi}])"
        return None
    if category == "char":
        if len(v) != 1:
            return [], f"expected {expected}, got {_describe(v)} (not a single character)"
        return None
    if category == "bigint":
        if abs(int(v)) >= 10**38:
            return [], f"expected {expected}, got {_describe(v)} (more than 38 digits)"
        return None
    if category in ("decimal", "timestamp", "date", "time"):
        try:
            pa.array([v], type=t.to_arrow())
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            return [], f"expected {expected}, got {_describe(v)} ({exc})"
    return None


def _struct_problem(v: Any, t: TypeInformation) -> tuple[list[str], str] | None:
    field_types = t.get_field_types()  # type: ignore[attr-defined]
    names = t.get_field_names()  # type: ignore[attr-defined]
    named = isinstance(t, RowTypeInfo) and t.is_named()
    if isinstance(v, Row) and named and getattr(v, "_fields", None) not in (None, names):
        missing = [n for n in names if n not in v._fields]
        if missing:
            return [], f"expected fields {names}, got a Row without field {missing[0]!r}"
    try:
        values = _positional(v, t, _row_names(t))
    except MismatchError:
        return [], f"expected {_struct_expectation(t)}, got {_describe(v)}"
    if len(values) != len(field_types):
        return [], f"expected {len(field_types)} fields, got {len(values)}"
    for i, (value, field_type) in enumerate(zip(values, field_types, strict=False)):
        found = _problem(value, field_type)
        if found is not None:
            label = names[i] if named else str(i)
            return [label, *found[0]], found[1]
    return None


def _format_path(parts: list[str]) -> str:
    out = ""
    for part in parts:
        if part.startswith("["):
            out += part
        else:
            out += ("." if out else "") + part
    return out


def raise_mismatch(records: list, t: TypeInformation, kind: str, exc: BaseException) -> NoReturn:
    expr = type_expr(t)
    for i, record in enumerate(records):
        if kind in ("tuple", "row"):
            if record is None or not _struct_accepts(t, record):
                found: tuple[list[str], str] | None = (
                    [],
                    f"expected {_struct_expectation(t)}, got {_describe(record)}",
                )
            else:
                found = _struct_problem(record, t)
        else:
            found = _problem(record, t)
        if found is not None:
            path, reason = found
            where = f"field {_format_path(path)} " if path else ""
            raise RecordTypeError(i, record, f"does not match {expr}: {where}{reason}") from None
    cause = exc.__cause__ or exc
    raise TypeError(f"records do not match {expr}: {cause}") from cause
