"""Built-in window aggregates: ``count``, ``sum``, ``min``, ``max``, ``mean`` of a field.

``keyed.window(assigner).aggregate([aggregates.count(), aggregates.sum("price")])`` yields one
``Row(key, window_start, window_end, count, sum_price)`` per key and window. When the stream is
keyed by a field and the windows are tumbling or sliding event-time windows without allowed
lateness, they run as numba kernels over Arrow batches (no Python object per record); otherwise
they run per record through the general window operator, with the same results.
"""

from __future__ import annotations

import builtins

from stretch.common.row import Row
from stretch.common.typeinfo import Types
from stretch.contracts.functions import AggregateFunction, WindowFunction

_OPS = ("count", "sum", "min", "max", "mean")


class BuiltinAggregate:
    """One built-in aggregate of one field (``count`` needs none); ``name`` is its output field."""

    def __init__(self, op: str, field: str | int | None = None, name: str | None = None):
        if op not in _OPS:
            raise ValueError(f"unknown aggregate {op!r}; built-ins are {', '.join(_OPS)}")
        if op != "count" and (field is None or isinstance(field, bool) or not isinstance(field, (str, int))):
            raise TypeError(f"{op}() takes a field name or position, got {field!r}")
        self.op = op
        self.field = field
        self.name = name or (op if op == "count" else f"{op}_{field}")

    def __repr__(self) -> str:
        return f"{self.op}({'' if self.field is None else repr(self.field)})"


def count(name: str | None = None) -> BuiltinAggregate:
    """The number of records (of a key and window)."""
    return BuiltinAggregate("count", None, name)


def sum(field: str | int, name: str | None = None) -> BuiltinAggregate:
    """The sum of ``field``."""
    return BuiltinAggregate("sum", field, name)


def min(field: str | int, name: str | None = None) -> BuiltinAggregate:
    """The smallest value of ``field``."""
    return BuiltinAggregate("min", field, name)


def max(field: str | int, name: str | None = None) -> BuiltinAggregate:
    """The largest value of ``field``."""
    return BuiltinAggregate("max", field, name)


def mean(field: str | int, name: str | None = None) -> BuiltinAggregate:
    """The mean of ``field``."""
    return BuiltinAggregate("mean", field, name)


def as_builtins(aggregate) -> list[BuiltinAggregate] | None:
    """The built-in aggregates asked for, or None if ``aggregate`` is something else."""
    items = aggregate if isinstance(aggregate, (list, tuple)) else [aggregate]
    if items and builtins.all(isinstance(a, BuiltinAggregate) for a in items):
        names = [a.name for a in items]
        if len(set(names)) != len(names):
            raise ValueError(f"aggregate output names must differ: {names}")
        return list(items)
    return None


def output_type(aggregates: list[BuiltinAggregate], key_type, field_type) -> Types:
    """Row(key, window_start, window_end, one field per aggregate)."""
    names = ["key", "window_start", "window_end"]
    types = [key_type or Types.PICKLED_BYTE_ARRAY(), Types.LONG(), Types.LONG()]
    for a in aggregates:
        names.append(a.name)
        if a.op == "count":
            types.append(Types.LONG())
        elif a.op == "mean":
            types.append(Types.DOUBLE())
        else:
            types.append(field_type(a.field) or Types.DOUBLE())
    return Types.ROW_NAMED(names, types)


def _field(record, field):
    """A record's field by position or name (Row names, tuple "fN" names, dict keys, attributes)."""
    if isinstance(field, int) or isinstance(record, (Row, dict)):
        return record[field]
    if isinstance(record, (tuple, list)) and field[:1] == "f" and field[1:].isdigit():
        return record[int(field[1:])]
    return getattr(record, field)


class BuiltinAggregates(AggregateFunction):
    """The built-ins as one AggregateFunction, for windows the kernels do not cover."""

    def __init__(self, aggregates: list[BuiltinAggregate]):
        self.aggregates = aggregates

    def create_accumulator(self):
        return [0] + [None] * len(self.aggregates)

    def add(self, value, accumulator):
        acc = list(accumulator)
        acc[0] += 1
        for j, a in enumerate(self.aggregates, 1):
            if a.op == "count":
                continue
            v = _field(value, a.field)
            old = acc[j]
            if old is None:
                acc[j] = v
            elif a.op in ("sum", "mean"):
                acc[j] = old + v
            elif a.op == "min":
                acc[j] = v if v < old else old
            else:
                acc[j] = v if v > old else old
        return acc

    def get_result(self, accumulator):
        n = accumulator[0]
        out = []
        for j, a in enumerate(self.aggregates, 1):
            if a.op == "count":
                out.append(n)
            elif a.op == "mean":
                out.append(accumulator[j] / n)
            else:
                out.append(accumulator[j])
        return tuple(out)

    def merge(self, a, b):
        merged = [a[0] + b[0]]
        for j, agg in enumerate(self.aggregates, 1):
            x, y = a[j], b[j]
            if x is None or y is None:
                merged.append(y if x is None else x)
            elif agg.op in ("sum", "mean"):
                merged.append(x + y)
            else:
                merged.append(builtins.min(x, y) if agg.op == "min" else builtins.max(x, y))
        return merged


class AsRow(WindowFunction):
    """Shapes a window's aggregate results as Row(key, window_start, window_end, ...)."""

    def __init__(self, aggregates: list[BuiltinAggregate]):
        self.names = ["key", "window_start", "window_end", *(a.name for a in aggregates)]

    def apply(self, key, window, inputs):
        for values in inputs:
            start = getattr(window, "start", None)
            end = getattr(window, "end", None)
            row = Row(key, start, end, *values)
            row.set_field_names(self.names)
            yield row
