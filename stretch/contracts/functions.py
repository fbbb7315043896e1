"""User function interfaces, as in ``pyflink.datastream.functions``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Generic, TypeVar

from stretch.contracts.metrics import MetricGroup

# type parameters, as in PyFlink: ``WindowFunction[IN, OUT, KEY, W]`` and so on
IN = TypeVar("IN")
IN1 = TypeVar("IN1")
IN2 = TypeVar("IN2")
OUT = TypeVar("OUT")
KEY = TypeVar("KEY")
ACC = TypeVar("ACC")
W = TypeVar("W")
W2 = TypeVar("W2")


class TimeDomain(Enum):
    """Whether a timer fired on event time (the watermark) or on processing time (the wall clock)."""

    EVENT_TIME = 0
    PROCESSING_TIME = 1


class RuntimeContext(ABC):
    """What an operator instance knows about itself, and its keyed state."""

    @abstractmethod
    def get_task_name(self) -> str: ...

    @abstractmethod
    def get_number_of_parallel_subtasks(self) -> int: ...

    @abstractmethod
    def get_max_number_of_parallel_subtasks(self) -> int: ...

    @abstractmethod
    def get_index_of_this_subtask(self) -> int: ...

    def get_attempt_number(self) -> int:
        return 0

    def get_task_name_with_subtasks(self) -> str:
        return (
            f"{self.get_task_name()} ({self.get_index_of_this_subtask() + 1}/"
            f"{self.get_number_of_parallel_subtasks()})"
        )

    def get_job_parameter(self, key: str, default_value: str):
        return default_value

    def get_metrics_group(self) -> MetricGroup:
        """The instance's user-defined metrics, which the job's metrics endpoint exports."""
        group = self.__dict__.get("_metrics_group")
        if group is None:
            group = self.__dict__["_metrics_group"] = MetricGroup()
        return group

    @abstractmethod
    def get_state(self, state_descriptor): ...

    @abstractmethod
    def get_list_state(self, state_descriptor): ...

    @abstractmethod
    def get_map_state(self, state_descriptor): ...

    @abstractmethod
    def get_reducing_state(self, state_descriptor): ...

    @abstractmethod
    def get_aggregating_state(self, state_descriptor): ...


class Function(ABC):  # noqa: B024 - PyFlink's base class has no abstract methods either
    """Base of every user function: open/close bracket its life in one operator instance."""

    def open(self, runtime_context: RuntimeContext) -> None:  # noqa: B027
        pass

    def close(self) -> None:  # noqa: B027
        pass


class MapFunction(Function, Generic[IN, OUT]):
    """One record in, one record out (``DataStream.map``)."""

    @abstractmethod
    def map(self, value): ...


class FlatMapFunction(Function, Generic[IN, OUT]):
    """One record in, any number out: ``flat_map`` yields or returns an iterable."""

    @abstractmethod
    def flat_map(self, value): ...


class FilterFunction(Function, Generic[IN]):
    """Keeps the records for which ``filter`` returns true."""

    @abstractmethod
    def filter(self, value) -> bool: ...


class ReduceFunction(Function, Generic[IN]):
    """Combines two values of one key (or window) into one of the same type."""

    @abstractmethod
    def reduce(self, value1, value2): ...


class AggregateFunction(Function, Generic[IN, ACC, OUT]):
    """An aggregation through an accumulator: create one, add each value, merge two, read the
    result."""

    @abstractmethod
    def create_accumulator(self): ...

    @abstractmethod
    def add(self, value, accumulator): ...

    @abstractmethod
    def get_result(self, accumulator): ...

    def merge(self, acc_a, acc_b):
        raise NotImplementedError(f"{type(self).__name__} does not implement merge")


class KeySelector(Function, Generic[IN, KEY]):
    """Extracts the key a record is partitioned and its state kept by (``key_by``)."""

    @abstractmethod
    def get_key(self, value): ...


class Partitioner(Function, Generic[KEY]):
    """For ``DataStream.partition_custom``: the partition of a key among ``num_partitions``."""

    @abstractmethod
    def partition(self, key, num_partitions: int) -> int: ...


class TimerService(ABC):
    """The current times of a keyed function, and its timers (kept per key in keyed state)."""

    @abstractmethod
    def current_processing_time(self) -> int: ...

    @abstractmethod
    def current_watermark(self) -> int: ...

    @abstractmethod
    def register_processing_time_timer(self, timestamp: int) -> None: ...

    @abstractmethod
    def register_event_time_timer(self, timestamp: int) -> None: ...

    @abstractmethod
    def delete_processing_time_timer(self, timestamp: int) -> None: ...

    @abstractmethod
    def delete_event_time_timer(self, timestamp: int) -> None: ...


class ProcessFunction(Function, Generic[IN, OUT]):
    """A function of each record with access to its timestamp, timers and side outputs."""

    class Context(ABC):
        @abstractmethod
        def timer_service(self) -> TimerService: ...

        @abstractmethod
        def timestamp(self) -> int | None: ...

    @abstractmethod
    def process_element(self, value, ctx: ProcessFunction.Context): ...


class KeyedProcessFunction(Function, Generic[KEY, IN, OUT]):
    """A function over a keyed stream with keyed state; yield outputs from process_element."""

    class Context(ABC):
        @abstractmethod
        def get_current_key(self): ...

        @abstractmethod
        def timer_service(self) -> TimerService: ...

        @abstractmethod
        def timestamp(self) -> int | None: ...

    class OnTimerContext(Context):
        @abstractmethod
        def time_domain(self) -> TimeDomain: ...

    @abstractmethod
    def process_element(self, value, ctx: KeyedProcessFunction.Context): ...

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext):
        pass


class WindowFunction(Function, Generic[IN, OUT, KEY, W]):
    """Called with all of a window's elements (or its pre-aggregated result) when it fires."""

    @abstractmethod
    def apply(self, key, window, inputs): ...


class ProcessWindowFunction(Function, Generic[IN, OUT, KEY, W]):
    """Like WindowFunction, with a context giving the window, the time and the watermark."""

    class Context(ABC, Generic[W2]):
        @abstractmethod
        def window(self): ...

        @abstractmethod
        def current_processing_time(self) -> int: ...

        @abstractmethod
        def current_watermark(self) -> int: ...

        def window_state(self):
            raise NotImplementedError("per-window state is not supported; use global_state()")

        @abstractmethod
        def global_state(self): ...

    @abstractmethod
    def process(self, key, context: ProcessWindowFunction.Context, elements): ...

    def clear(self, context: ProcessWindowFunction.Context) -> None:
        pass


class JoinFunction(Function, Generic[IN1, IN2, OUT]):
    """A window join's function: called once per pair of a window's left and right elements."""

    @abstractmethod
    def join(self, first, second): ...


class CoGroupFunction(Function, Generic[IN1, IN2, OUT]):
    """A window co-group's function: all left and all right elements of one window and key."""

    @abstractmethod
    def co_group(self, first, second): ...


class ProcessJoinFunction(Function, Generic[IN1, IN2, OUT]):
    """An interval join's function: called once per joined pair; yield its outputs."""

    class Context(ABC):
        @abstractmethod
        def get_left_timestamp(self) -> int: ...

        @abstractmethod
        def get_right_timestamp(self) -> int: ...

        @abstractmethod
        def get_timestamp(self) -> int: ...

        @abstractmethod
        def output(self, output_tag, value) -> None: ...

    @abstractmethod
    def process_element(self, left, right, ctx: ProcessJoinFunction.Context): ...


class CoMapFunction(Function, Generic[IN1, IN2, OUT]):
    """Maps each element of two connected streams: ``map1`` for the first, ``map2`` for the second."""

    @abstractmethod
    def map1(self, value): ...

    @abstractmethod
    def map2(self, value): ...


class CoFlatMapFunction(Function, Generic[IN1, IN2, OUT]):
    """``flat_map1``/``flat_map2``: any number of results per element of either connected stream."""

    @abstractmethod
    def flat_map1(self, value): ...

    @abstractmethod
    def flat_map2(self, value): ...


class CoProcessFunction(Function, Generic[IN1, IN2, OUT]):
    """Processes two connected (not keyed) streams; yields results, or ``(output_tag, value)``."""

    class Context(ABC):
        @abstractmethod
        def timer_service(self) -> TimerService: ...

        @abstractmethod
        def timestamp(self) -> int | None: ...

    @abstractmethod
    def process_element1(self, value, ctx: CoProcessFunction.Context): ...

    @abstractmethod
    def process_element2(self, value, ctx: CoProcessFunction.Context): ...


class KeyedCoProcessFunction(Function, Generic[KEY, IN1, IN2, OUT]):
    """Processes two connected keyed streams: both inputs of a key share its keyed state and timers."""

    class Context(ABC):
        @abstractmethod
        def get_current_key(self): ...

        @abstractmethod
        def timer_service(self) -> TimerService: ...

        @abstractmethod
        def timestamp(self) -> int | None: ...

    class OnTimerContext(Context):
        @abstractmethod
        def time_domain(self) -> TimeDomain: ...

    @abstractmethod
    def process_element1(self, value, ctx: KeyedCoProcessFunction.Context): ...

    @abstractmethod
    def process_element2(self, value, ctx: KeyedCoProcessFunction.Context): ...

    def on_timer(self, timestamp: int, ctx: KeyedCoProcessFunction.OnTimerContext):
        """A timer registered by either input fired."""


class BaseBroadcastProcessFunction(Function):
    """What both broadcast process functions share: their contexts' broadcast state and time."""

    class BaseContext(ABC):
        @abstractmethod
        def timestamp(self) -> int | None: ...

        @abstractmethod
        def current_processing_time(self) -> int: ...

        @abstractmethod
        def current_watermark(self) -> int: ...

    class ReadOnlyContext(BaseContext):
        @abstractmethod
        def get_broadcast_state(self, state_descriptor):
            """The ReadOnlyBroadcastState of a MapStateDescriptor given to ``broadcast()``."""

    class Context(BaseContext):
        @abstractmethod
        def get_broadcast_state(self, state_descriptor):
            """The (writable) BroadcastState of a MapStateDescriptor given to ``broadcast()``."""


class BroadcastProcessFunction(BaseBroadcastProcessFunction, Generic[IN1, IN2, OUT]):
    """Processes a (non-keyed) stream connected to a BroadcastStream: ``process_element`` reads the
    broadcast state, ``process_broadcast_element`` may change it. Both yield results."""

    class ReadOnlyContext(BaseBroadcastProcessFunction.ReadOnlyContext, ABC):
        pass

    class Context(BaseBroadcastProcessFunction.Context, ABC):
        pass

    @abstractmethod
    def process_element(self, value, ctx: BroadcastProcessFunction.ReadOnlyContext): ...

    @abstractmethod
    def process_broadcast_element(self, value, ctx: BroadcastProcessFunction.Context): ...


class KeyedBroadcastProcessFunction(BaseBroadcastProcessFunction, Generic[KEY, IN1, IN2, OUT]):
    """Processes a KeyedStream connected to a BroadcastStream: keyed state and timers for the keyed
    input (``process_element``, ``on_timer``), and the broadcast state both read and (from the
    broadcast input, ``process_broadcast_element``) change."""

    class ReadOnlyContext(BaseBroadcastProcessFunction.ReadOnlyContext, ABC):
        @abstractmethod
        def timer_service(self) -> TimerService: ...

        @abstractmethod
        def get_current_key(self): ...

    class Context(BaseBroadcastProcessFunction.Context, ABC):
        pass

    class OnTimerContext(ReadOnlyContext, ABC):
        @abstractmethod
        def time_domain(self) -> TimeDomain: ...

    @abstractmethod
    def process_element(self, value, ctx: KeyedBroadcastProcessFunction.ReadOnlyContext): ...

    @abstractmethod
    def process_broadcast_element(self, value, ctx: KeyedBroadcastProcessFunction.Context): ...

    def on_timer(self, timestamp: int, ctx: KeyedBroadcastProcessFunction.OnTimerContext):
        """A timer the keyed input registered fired."""


class AllWindowFunction(Function, Generic[IN, OUT, W]):
    """The window function of a non-keyed (``window_all``) window: every element of it at once."""

    @abstractmethod
    def apply(self, window, inputs): ...


class ProcessAllWindowFunction(Function, Generic[IN, OUT, W]):
    """``window_all``'s process function: the window's elements with a context (its window)."""

    class Context(ABC, Generic[W2]):
        @abstractmethod
        def window(self): ...

        @abstractmethod
        def current_processing_time(self) -> int: ...

        @abstractmethod
        def current_watermark(self) -> int: ...

    @abstractmethod
    def process(self, context: ProcessAllWindowFunction.Context, elements): ...
