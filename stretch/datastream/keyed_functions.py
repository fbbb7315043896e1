"""Built-in keyed functions: how map/filter/reduce/sum/min/max on a KeyedStream behave, as in PyFlink.

PyFlink runs these as KeyedProcessFunctions over keyed state, and so does stretch (per record);
rolling sum/min/max on numeric Arrow fields take a vectorized path instead (see
``stretch.runtime.operators.AggregateOperator``), with the same results.
"""

from __future__ import annotations

import copy

from stretch.common.row import Row
from stretch.common.typeinfo import Types
from stretch.contracts.functions import (
    FilterFunction,
    FlatMapFunction,
    Function,
    KeyedProcessFunction,
    KeySelector,
    MapFunction,
    ReduceFunction,
)
from stretch.contracts.state import ValueStateDescriptor
from stretch.datastream.wrapping import Wrapping, replaced

END_OF_INPUT = 2**63 - 1  # Flink's Long.MAX_VALUE: the watermark that ends a bounded input


class _Delegating(Wrapping, KeyedProcessFunction):
    """A keyed map/flat_map/filter: the user function wrapped in a KeyedProcessFunction."""

    what = "process_element"  # what errors and dead letters say failed: the user's function


class KeyedMap(_Delegating):
    what = "map function"
    accepts = (MapFunction,)

    def open(self, runtime_context) -> None:
        super().open(runtime_context)
        self._call = getattr(self.fn, "map", self.fn)

    def process_element(self, value, ctx):
        yield self._call(value)


class KeyedFlatMap(_Delegating):
    what = "flat_map function"
    accepts = (FlatMapFunction,)

    def open(self, runtime_context) -> None:
        super().open(runtime_context)
        self._call = getattr(self.fn, "flat_map", self.fn)

    def process_element(self, value, ctx):
        result = self._call(value)
        if result is not None:
            yield from result


class KeyedFilter(_Delegating):
    what = "filter function"
    accepts = (FilterFunction,)

    def open(self, runtime_context) -> None:
        super().open(runtime_context)
        self._call = getattr(self.fn, "filter", self.fn)

    def process_element(self, value, ctx):
        if self._call(value):
            yield value


class RollingReduce(KeyedProcessFunction):
    """One output per input: the reduction of the key's records so far (the first as is).

    In BATCH execution mode (``batch``) it is not rolling, as in Flink: each key yields only its
    final reduction, from an event-time timer at the end of input (the bounded input's last
    watermark fires it).
    """

    what = "reduce function"

    def __init__(self, reduce_fn, batch: bool = False):
        self.fn = reduce_fn  # a ReduceFunction (opened and closed with the operator) or a callable
        self.batch = batch

    def _with_user_function(self, new) -> RollingReduce:
        return replaced(self, "fn", new, (ReduceFunction,))

    def in_batch_mode(self) -> RollingReduce:
        twin = copy.copy(self)
        twin.batch = True
        return twin

    def open(self, runtime_context) -> None:
        self.state = runtime_context.get_state(ValueStateDescriptor("_reduce", Types.PICKLED_BYTE_ARRAY()))
        self.reduce_fn = getattr(self.fn, "reduce", self.fn) if isinstance(self.fn, Function) else self.fn
        if isinstance(self.fn, Function):
            self.fn.open(runtime_context)

    def close(self) -> None:
        if isinstance(self.fn, Function):
            self.fn.close()

    def process_element(self, value, ctx):
        current = self.state.value()
        result = value if current is None else self.reduce_fn(current, value)
        self.state.update(result)
        if not self.batch:
            yield result
        elif current is None:
            ctx.timer_service().register_event_time_timer(END_OF_INPUT)

    def on_timer(self, timestamp: int, ctx):
        result = self.state.value()
        if result is not None:
            yield result


def _get(value, field):
    if isinstance(value, Row) and isinstance(field, str):
        return value[field]
    if isinstance(value, (tuple, list, Row)):
        if isinstance(field, str):
            raise TypeError(f"field {field!r} given by name, but the records are {type(value).__name__}s")
        return value[field]
    if field != 0:
        raise TypeError(f"records are plain values ({type(value).__name__}); the position must be 0")
    return value


def _set(value, field, new):
    """A copy of the record with one field replaced (outputs already emitted must not change)."""
    if isinstance(value, Row):
        out = copy.copy(value)
        out._values = list(value._values)
        out[field] = new
        return out
    if isinstance(value, tuple):
        return (*value[:field], new, *value[field + 1 :])
    if isinstance(value, list):
        out = list(value)
        out[field] = new
        return out
    return new


_COMBINE = {"sum": lambda a, b: a + b, "min": min, "max": max}


class RollingAggregate(RollingReduce):
    """PyFlink's sum/min/max: the fields aggregate, every other field keeps the first record's value."""

    def __init__(self, op: str, fields: list):
        self.fields = fields
        combine = _COMBINE[op]

        def reduce_fn(acc, value):
            for f in fields:
                acc = _set(acc, f, combine(_get(acc, f), _get(value, f)))
            return acc

        super().__init__(reduce_fn)

    def _with_user_function(self, op: str) -> RollingAggregate:
        """Another built-in over the same fields (the state is one record either way)."""
        twin = RollingAggregate(op, self.fields)
        twin.batch = self.batch
        return twin


def by_reducer(kind: str, field):
    """min_by/max_by: keep the record with the smallest/largest field (the earlier one on ties)."""
    if kind == "min_by":
        return lambda a, b: b if _get(b, field) < _get(a, field) else a
    return lambda a, b: b if _get(b, field) > _get(a, field) else a


class KeyAndValue(MapFunction):
    """A KeyedStream's records as Flink's PyFlink carries them: ``Row(f0=key, f1=value)``."""

    def __init__(self, selector=None, field=None):
        self.selector, self.field = selector, field

    def map(self, value):
        if self.selector is None:
            key = _get(value, self.field)
        elif isinstance(self.selector, KeySelector):
            key = self.selector.get_key(value)
        else:
            key = self.selector(value)
        return Row(f0=key, f1=value)


class Project(MapFunction):
    """DataStream.project: the chosen fields of a tuple, in the chosen order."""

    def __init__(self, fields: list[int]):
        self.fields = fields

    def map(self, value):
        return tuple(value[i] for i in self.fields)
