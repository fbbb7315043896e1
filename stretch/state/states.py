"""The engine's implementations of PyFlink's keyed state interfaces.

Within a batch, each state holds the values of the batch's distinct keys in a Python list indexed
by the key's slot (``backend.current``), loaded in bulk from the shared-memory table when the batch
starts and written back in bulk when it ends. Shared memory is therefore authoritative at every
batch boundary, which is where ownership of a key group can change hands.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stretch.common.typeinfo import type_expr
from stretch.contracts import state as api
from stretch.state.codecs import ElementStream, fixed_dtype, value_codec
from stretch.state.type_checks import element_check, value_check

_UNSET = object()


class StateTypeError(TypeError):
    """A value the batch's write-back could not store (an int beyond its column's range, a value
    that does not pickle); ``slot`` is the batch's slot of its key, so the operator can name it.
    Values of another type never get this far: ``update()`` and ``add()`` refuse them."""

    def __init__(self, message: str, slot: int):
        super().__init__(message)
        self.slot = slot


class _Column:
    """Shared plumbing: the state's id in the operator's table and its backend."""

    def __init__(self, backend, sid: int, descriptor):
        self._b = backend
        self._table = backend.table
        self._sid = sid
        self.descriptor = descriptor


class FixedValueState(_Column, api.ValueState):
    """ValueState of a numeric or boolean type: a fixed-width column, loaded with one gather."""

    def __init__(self, backend, sid, descriptor):
        super().__init__(backend, sid, descriptor)
        self._dtype = fixed_dtype(descriptor.type_info)
        self._arrow = pa.bool_() if self._dtype == np.uint8 else pa.from_numpy_dtype(self._dtype)
        self._vals: list = []
        self._dirty = False
        check = value_check(descriptor)
        self._fast, self._check = check.fast, check.check
        # numpy converts these exactly or raises (an int out of range, a None in an int column):
        # the batch's values convert in one pass, pyarrow's checked path being the fallback
        self._direct = self._dtype.kind in "iub" or self._dtype == np.float64

    def value(self):
        return self._vals[self._b.current]

    def update(self, value) -> None:
        if type(value) is not self._fast:  # the per-record path: one comparison for the usual type
            self._check(value)
        self._vals[self._b.current] = value
        self._dirty = True

    def clear(self) -> None:
        self._vals[self._b.current] = None
        self._dirty = True

    def _load(self, kgs, rows) -> None:
        values, valid = self._table.gather(self._sid, self._dtype, kgs, rows)
        vals = values.astype(bool).tolist() if self._dtype == np.uint8 else values.tolist()
        for i in np.flatnonzero(valid == 0).tolist():
            vals[i] = None
        self._vals = vals
        self._dirty = False

    def _flush(self, kgs, rows) -> None:
        if not self._dirty:
            return
        converted = self._direct and _direct_values(self._vals, self._dtype)
        if converted:
            self._table.scatter(self._sid, self._dtype, kgs, rows, *converted)
        else:
            self._flush_checked(kgs, rows)
        self._dirty = False

    def _flush_checked(self, kgs, rows) -> None:
        """The write-back through pyarrow: it names what does not fit the declared type."""
        try:
            arr = _strict_array(self._vals, self._arrow)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
            slot = next((u for u, v in enumerate(self._vals) if not _fits(v, self._arrow)), 0)
            raise StateTypeError(
                f"state {self.descriptor.name!r} is declared {type_expr(self.descriptor.type_info)} "
                f"but was updated with {self._vals[slot]!r}: {e}",
                slot,
            ) from None
        valid = arr.is_valid().to_numpy(zero_copy_only=False).astype(np.uint8)
        values = arr.fill_null(False if self._dtype == np.uint8 else 0).to_numpy(zero_copy_only=False)
        self._table.scatter(self._sid, self._dtype, kgs, rows, values.astype(self._dtype, copy=False), valid)


def _direct_values(values: list, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray] | None:
    """A batch's values and their validity as ``dtype`` in one pass over the list, None (the
    checked path) if one does not convert: a None in an int column, an int out of range. The
    values passed ``update()``'s type check, so only a float column's None needs a look: numpy
    makes it NaN, so each NaN is checked for being a None."""
    try:
        out = np.fromiter(values, dtype, len(values))
    except (TypeError, ValueError, OverflowError):
        return None
    valid = np.ones(len(values), np.uint8)
    if dtype.kind == "f":
        for i in np.flatnonzero(np.isnan(out)).tolist():
            if values[i] is None:
                valid[i], out[i] = 0, 0.0
    return out, valid


def _strict_array(values: list, arrow_type: pa.DataType) -> pa.Array:
    """Values as the declared type, refusing what Flink refuses: floats or bools for integers,
    anything but bools for BOOLEAN (pyarrow alone would truncate 1.5 to 1)."""
    inferred = pa.array(values)
    t = inferred.type
    ok = (
        pa.types.is_null(t)
        or (pa.types.is_integer(arrow_type) and pa.types.is_integer(t))
        or (pa.types.is_floating(arrow_type) and (pa.types.is_integer(t) or pa.types.is_floating(t)))
        or (pa.types.is_boolean(arrow_type) and pa.types.is_boolean(t))
    )
    if not ok:
        raise TypeError(f"values of type {t} do not fit {arrow_type}")
    return inferred.cast(arrow_type)  # safe cast: overflows raise


def _fits(value, arrow_type) -> bool:
    try:
        _strict_array([value], arrow_type)
        return True
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        return False


class _VarCells(_Column):
    """Variable-length values (one per key), decoded lazily and written back only if changed."""

    def __init__(self, backend, sid, descriptor, codec):
        super().__init__(backend, sid, descriptor)
        self._codec = codec
        self._raw: list = []
        self._vals: list = []
        self._changed: set[int] = set()

    def _get(self, u: int):
        v = self._vals[u]
        if v is _UNSET:
            raw = self._raw[u]
            v = self._vals[u] = None if raw is None else self._codec.decode(raw)
        return v

    def _set(self, u: int, value) -> None:
        self._vals[u] = value
        self._changed.add(u)

    def _load(self, kgs, rows) -> None:
        self._raw = self._table.read_var(self._sid, kgs, rows)
        self._vals = [_UNSET] * len(self._raw)
        self._changed = set()

    def _payload(self, value):
        return None if value is None else self._codec.encode(value)

    def _flush(self, kgs, rows) -> None:
        if not self._changed:
            return
        idx = np.fromiter(sorted(self._changed), dtype=np.int64, count=len(self._changed))
        payloads = []
        for u in idx.tolist():
            try:
                payloads.append(self._payload(self._vals[u]))
            except Exception as e:  # e.g. a value that does not pickle
                raise StateTypeError(f"state {self.descriptor.name!r}: {type(e).__name__}: {e}", u) from None
        self._table.write_var(self._sid, kgs[idx], rows[idx], payloads)
        self._changed = set()


class VarValueState(_VarCells, api.ValueState):
    def __init__(self, backend, sid, descriptor, codec):
        super().__init__(backend, sid, descriptor, codec)
        check = value_check(descriptor)
        self._fast, self._check = check.fast, check.check

    def value(self):
        return self._get(self._b.current)

    def update(self, value) -> None:
        if type(value) is not self._fast:
            self._check(value)
        self._set(self._b.current, value)

    def clear(self) -> None:
        self._set(self._b.current, None)


def _value_cell(backend, sid: int, descriptor) -> FixedValueState | VarValueState:
    """A value per key stored as the descriptor's type says (fixed-width or variable-length)."""
    if fixed_dtype(descriptor.type_info) is not None:
        return FixedValueState(backend, sid, descriptor)
    return VarValueState(backend, sid, descriptor, value_codec(descriptor.type_info))


class _OnValueCell:
    """A state kept as one value per key (reducing, aggregating): load and flush go to the cell."""

    def __init__(self, backend, sid, descriptor):
        self.descriptor = descriptor
        self._cell = _value_cell(backend, sid, descriptor)

    def clear(self) -> None:
        self._cell.clear()

    def _load(self, kgs, rows) -> None:
        self._cell._load(kgs, rows)

    def _flush(self, kgs, rows) -> None:
        self._cell._flush(kgs, rows)


class ReducingStateImpl(_OnValueCell, api.ReducingState):
    """The running reduction of every value added for the key (first value kept as is)."""

    def __init__(self, backend, sid, descriptor):
        super().__init__(backend, sid, descriptor)
        self._reduce = descriptor.reduce_function

    def get(self):
        return self._cell.value()

    def add(self, value) -> None:
        current = self._cell.value()
        self._cell.update(value if current is None else self._reduce(current, value))


class AggregatingStateImpl(_OnValueCell, api.AggregatingState):
    """An AggregateFunction's accumulator per key (of the descriptor's type); get() returns its result."""

    def __init__(self, backend, sid, descriptor):
        super().__init__(backend, sid, descriptor)
        self._agg = descriptor.agg_function

    def get(self):
        acc = self._cell.value()
        return None if acc is None else self._agg.get_result(acc)

    def add(self, value) -> None:
        if value is None:
            self._cell.clear()
            return
        acc = self._cell.value()
        if acc is None:
            acc = self._agg.create_accumulator()
        self._cell.update(self._agg.add(value, acc))


class MapStateImpl(_VarCells, api.MapState):
    """A dict per key, loaded on first touch in a batch and rewritten if modified."""

    def __init__(self, backend, sid, descriptor):
        super().__init__(backend, sid, descriptor, value_codec(None))

    def _map(self) -> dict:
        u = self._b.current
        m = self._get(u)
        if m is None:
            m = self._vals[u] = {}
        return m

    def _touch(self) -> dict:
        u = self._b.current
        m = self._map()
        self._changed.add(u)
        return m

    def _payload(self, value):
        return self._codec.encode(value) if value else None

    def get(self, key):
        return self._map().get(key)

    def put(self, key, value) -> None:
        self._touch()[key] = value

    def put_all(self, dict_value) -> None:
        self._touch().update(dict_value)

    def remove(self, key) -> None:
        m = self._map()
        if key in m:
            del self._touch()[key]

    def contains(self, key) -> bool:
        return key in self._map()

    def items(self):
        return list(self._map().items())

    def keys(self):
        return list(self._map().keys())

    def values(self):
        return list(self._map().values())

    def is_empty(self) -> bool:
        return not self._map()

    def clear(self) -> None:
        self._set(self._b.current, {})


class ListStateImpl(_Column, api.ListState):
    """A list per key; add() never reads the stored list, and only new elements are written back."""

    def __init__(self, backend, sid, descriptor):
        super().__init__(backend, sid, descriptor)
        self._stream = ElementStream(descriptor.elem_type_info)
        check = element_check(descriptor)
        self._fast, self._check = check.fast, check.check
        self._raw: list = []
        self._lists: list = []  # None: not loaded; else the whole list
        self._base: list = []  # length already stored, for loaded lists
        self._added: dict[int, list] = {}  # appends to lists not loaded
        self._replaced: set[int] = set()

    def _load(self, kgs, rows) -> None:
        self._raw = self._table.read_var(self._sid, kgs, rows)
        n = len(self._raw)
        self._lists = [None] * n
        self._base = [0] * n
        self._added = {}
        self._replaced = set()

    def _full(self, u: int) -> list:
        lst = self._lists[u]
        if lst is None:
            raw = self._raw[u]
            lst = self._stream.decode(raw) if raw else []
            self._base[u] = len(lst)
            pending = self._added.pop(u, None)
            if pending:
                lst.extend(pending)
            self._lists[u] = lst
        return lst

    def get(self):
        return self._full(self._b.current)

    def add(self, value) -> None:
        if type(value) is not self._fast:
            self._check(value)
        u = self._b.current
        lst = self._lists[u]
        if lst is not None:
            lst.append(value)
        else:
            self._added.setdefault(u, []).append(value)

    def add_all(self, values) -> None:
        for v in values:
            self.add(v)

    def update(self, values) -> None:
        values = list(values) if values is not None else []
        fast, check = self._fast, self._check
        for v in values:
            if type(v) is not fast:
                check(v)
        u = self._b.current
        self._lists[u] = values
        self._added.pop(u, None)  # appends made earlier in the batch are replaced too
        self._replaced.add(u)

    def clear(self) -> None:
        self.update([])

    def _flush(self, kgs, rows) -> None:
        writes: dict[int, tuple[bytes | None, bool]] = {}
        for u in self._replaced:
            lst = self._lists[u]
            writes[u] = (self._encode(u, lst) if lst else None, False)
        for u, lst in enumerate(self._lists):
            if lst is not None and u not in self._replaced and len(lst) > self._base[u]:
                writes[u] = (self._encode(u, lst[self._base[u] :]), True)
        for u, pending in self._added.items():
            writes[u] = (self._encode(u, pending), True)
        if not writes:
            return
        idx = np.fromiter(sorted(writes), dtype=np.int64, count=len(writes))
        payloads = [writes[u][0] for u in idx.tolist()]
        appends = np.fromiter((writes[u][1] for u in idx.tolist()), dtype=np.bool_, count=len(idx))
        self._table.write_var(self._sid, kgs[idx], rows[idx], payloads, appends)

    def _encode(self, u: int, elements: list) -> bytes:
        try:
            return self._stream.encode(elements)
        except Exception as e:  # an int beyond the column's range, an element that does not pickle
            raise StateTypeError(
                f"list state {self.descriptor.name!r} holds elements of "
                f"{type_expr(self.descriptor.elem_type_info)}: {type(e).__name__}: {e}",
                u,
            ) from None


def make_state(backend, sid: int, descriptor):
    """The implementation object for a descriptor."""
    kind = descriptor.kind
    if kind == "value":
        return _value_cell(backend, sid, descriptor)
    if kind == "list":
        return ListStateImpl(backend, sid, descriptor)
    if kind == "map":
        return MapStateImpl(backend, sid, descriptor)
    if kind == "reducing":
        return ReducingStateImpl(backend, sid, descriptor)
    if kind == "aggregating":
        return AggregatingStateImpl(backend, sid, descriptor)
    raise TypeError(f"unknown state descriptor {descriptor!r}")
