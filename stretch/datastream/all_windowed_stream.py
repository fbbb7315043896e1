"""Windows over a whole stream (PyFlink's ``window_all`` and ``AllWindowedStream``).

As Flink does, every element goes to one operator instance: the stream is keyed by one constant
key and windowed at parallelism 1, and the all-window functions are the keyed window functions
without the key. The window's state is then keyed state like any other (checkpointed, recovered).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stretch.common.typeinfo import TypeInformation
from stretch.contracts.functions import (
    AllWindowFunction,
    KeySelector,
    ProcessAllWindowFunction,
    ProcessWindowFunction,
    WindowFunction,
)
from stretch.datastream.wrapping import Wrapping

if TYPE_CHECKING:
    from stretch.datastream.data_stream import DataStream


class AllWindowedStream:
    """All records of a stream in windows, without a key (``window_all``): the windows of one key,
    so one instance does the work."""

    def __init__(self, stream: DataStream, window_assigner):
        self._windowed = stream.key_by(_Everything()).window(window_assigner)

    def allowed_lateness(self, time_ms: int) -> AllWindowedStream:
        self._windowed.allowed_lateness(time_ms)
        return self

    def side_output_late_data(self, output_tag) -> AllWindowedStream:
        self._windowed.side_output_late_data(output_tag)
        return self

    def trigger(self, trigger) -> AllWindowedStream:
        self._windowed.trigger(trigger)
        return self

    def evictor(self, evictor) -> AllWindowedStream:
        self._windowed.evictor(evictor)
        return self

    def reduce(self, reduce_function, window_function=None, output_type: TypeInformation | None = None):
        """Each window's elements reduced to one (then handed to ``window_function`` if given)."""
        return self._one(self._windowed.reduce(reduce_function, _keyless(window_function), output_type))

    def aggregate(self, aggregate_function, window_function=None, accumulator_type=None, output_type=None):
        """An AggregateFunction per window (then ``window_function`` if given)."""
        return self._one(
            self._windowed.aggregate(
                aggregate_function, _keyless(window_function), accumulator_type, output_type
            )
        )

    def process(self, process_all_window_function: ProcessAllWindowFunction, output_type=None):
        """A ProcessAllWindowFunction of each window's elements."""
        if not isinstance(process_all_window_function, ProcessAllWindowFunction):
            raise TypeError("process() needs a ProcessAllWindowFunction")
        return self._one(self._windowed.process(_keyless(process_all_window_function), output_type))

    def apply(self, all_window_function: AllWindowFunction, output_type=None):
        """An AllWindowFunction of each window's elements."""
        return self._one(self._windowed.apply(_keyless(all_window_function), output_type))

    @staticmethod
    def _one(stream):
        return stream.set_parallelism(1).name("AllWindow")


class _Everything(KeySelector):
    """The one key of a window_all: every element has it."""

    def get_key(self, value):
        return 0


def _keyless(fn):
    """An all-window function as the keyed window function it runs as."""
    if fn is None:
        return None
    if isinstance(fn, ProcessAllWindowFunction):
        return _ProcessAll(fn)
    if isinstance(fn, AllWindowFunction):
        return _ApplyAll(fn)
    raise TypeError(f"expected an AllWindowFunction or a ProcessAllWindowFunction, got {fn!r}")


class _ProcessAll(Wrapping, ProcessWindowFunction):
    def process(self, key, context, elements):
        return self.fn.process(context, elements)


class _ApplyAll(Wrapping, WindowFunction):
    def apply(self, key, window, inputs):
        return self.fn.apply(window, inputs)
