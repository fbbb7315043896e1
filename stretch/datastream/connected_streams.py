"""Two streams connected into one operator (PyFlink's ``ConnectedStreams``).

As for the joins (``stretch.datastream.two_inputs``), the two inputs become one tagged stream: each
element is ``(0, value)`` or ``(1, value)``, in one gate, so every instance sees both inputs of its
key groups in one order. Keyed (both inputs keyed, or ``key_by(selector1, selector2)``), the
operator is a keyed process function whose state and timers both inputs of a key share, so it
rescales live, is checkpointed and recovers as any keyed operator does. ``map``/``flat_map`` run
through ``process``, as in PyFlink.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stretch.common.typeinfo import TypeInformation
from stretch.contracts.functions import (
    CoFlatMapFunction,
    CoMapFunction,
    CoProcessFunction,
    KeyedCoProcessFunction,
    KeyedProcessFunction,
    ProcessFunction,
)
from stretch.datastream.two_inputs import LEFT, UnionKey, selector_of, union_tagged
from stretch.datastream.wrapping import Wrapping, replaced

if TYPE_CHECKING:
    from stretch.datastream.data_stream import DataStream


class ConnectedStreams:
    """Two streams connected for one co-function (``connect``): ``map``, ``flat_map`` or ``process``
    over both; keyed on both sides, the function keeps keyed state and timers for both."""

    def __init__(self, stream1: DataStream, stream2: DataStream):
        self.stream1, self.stream2 = stream1, stream2

    def _is_keyed_stream(self) -> bool:
        return self.stream1._is_keyed and self.stream2._is_keyed

    def key_by(
        self, key_selector1, key_selector2, key_type: TypeInformation | None = None
    ) -> ConnectedStreams:
        """Key each input by its own selector; both must give keys of one kind."""
        return ConnectedStreams(
            self.stream1._values().key_by(key_selector1, key_type),
            self.stream2._values().key_by(key_selector2, key_type),
        )

    def map(self, func: CoMapFunction, output_type: TypeInformation | None = None) -> DataStream:
        """``map1`` for each element of the first input, ``map2`` for the second; one result each."""
        if not isinstance(func, CoMapFunction):
            raise TypeError("The input function must be a CoMapFunction!")
        return self._process(_CoMap(func), output_type, "Co-Map")

    def flat_map(self, func: CoFlatMapFunction, output_type: TypeInformation | None = None) -> DataStream:
        """``flat_map1``/``flat_map2``: any number of results per element."""
        if not isinstance(func, CoFlatMapFunction):
            raise TypeError("The input must be a CoFlatMapFunction!")
        return self._process(_CoFlatMap(func), output_type, "Co-Flat Map")

    def process(self, func, output_type: TypeInformation | None = None) -> DataStream:
        """A CoProcessFunction, or (inputs keyed) a KeyedCoProcessFunction."""
        if not isinstance(func, (CoProcessFunction, KeyedCoProcessFunction)):
            raise TypeError("The input must be a CoProcessFunction or KeyedCoProcessFunction!")
        if isinstance(func, KeyedCoProcessFunction) and not self._is_keyed_stream():
            raise TypeError(
                "a KeyedCoProcessFunction needs keyed inputs: connect two KeyedStreams, or key_by(k1, k2)"
            )
        name = "Keyed Co-Process" if self._is_keyed_stream() else "Co-Process"
        return self._process(func, output_type, name)

    def _process(self, func, output_type, name: str) -> DataStream:
        tagged = union_tagged(self.stream1, self.stream2)
        if self._is_keyed_stream():
            keyed = tagged.key_by(UnionKey(selector_of(self.stream1), selector_of(self.stream2)))
            return keyed.process(_Keyed(func), output_type).name(name)
        return tagged.process(_Unkeyed(func), output_type).name(name)


class _CoMap(Wrapping, CoProcessFunction, KeyedCoProcessFunction):
    """A CoMapFunction as a (keyed) co-process function; a None result is dropped, as in PyFlink."""

    accepts, callables = (CoMapFunction,), False

    def process_element1(self, value, ctx):
        result = self.fn.map1(value)
        return () if result is None else (result,)

    def process_element2(self, value, ctx):
        result = self.fn.map2(value)
        return () if result is None else (result,)


class _CoFlatMap(Wrapping, CoProcessFunction, KeyedCoProcessFunction):
    accepts, callables = (CoFlatMapFunction,), False

    def process_element1(self, value, ctx):
        return self.fn.flat_map1(value) or ()

    def process_element2(self, value, ctx):
        return self.fn.flat_map2(value) or ()


class _Dispatch(Wrapping):
    """Hands a tagged element to the co-function's method for its input."""

    what = "process_element1"  # named in errors: which input's method raised

    def _with_user_function(self, new):
        inner = getattr(self.fn, "_with_user_function", None)  # a co-map or co-flat-map adapter
        if inner is not None:
            return replaced(self, "fn", inner(new), (object,))
        return replaced(self, "fn", new, (KeyedCoProcessFunction, CoProcessFunction), callables=False)

    def process_element(self, value, ctx):
        side, element = value
        if side == LEFT:
            self.what = "process_element1"
            return self.fn.process_element1(element, ctx)
        self.what = "process_element2"
        return self.fn.process_element2(element, ctx)


class _Keyed(_Dispatch, KeyedProcessFunction):
    def on_timer(self, timestamp: int, ctx):
        self.what = "on_timer"
        return self.fn.on_timer(timestamp, ctx)


class _Unkeyed(_Dispatch, ProcessFunction):
    pass
