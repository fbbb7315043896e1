"""Window triggers, with PyFlink's names (``pyflink.datastream.window``): when a window's pane is
evaluated (FIRE) and/or emptied (PURGE).

A trigger is asked on each element of a window (``on_element``) and when a timer it registered
fires (``on_event_time``/``on_processing_time``); its timers and its partitioned state are scoped
to the key and the window, as in Flink (see ``stretch.datastream.triggered_windows``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Generic, TypeVar

from stretch.common.time import Time
from stretch.common.typeinfo import Types
from stretch.contracts.state import ReducingStateDescriptor
from stretch.contracts.window import GlobalWindows, to_millis

T = TypeVar("T")
W = TypeVar("W")


class TriggerResult(Enum):
    """What a trigger decides: continue, fire, purge, or fire and purge the window."""

    CONTINUE = (False, False)
    FIRE_AND_PURGE = (True, True)
    FIRE = (True, False)
    PURGE = (False, True)

    def is_fire(self) -> bool:
        return self.value[0]

    def is_purge(self) -> bool:
        return self.value[1]


class Trigger(ABC, Generic[T, W]):
    """Decides when a window fires (and whether it is purged), on elements, timers and merges."""

    class TriggerContext(ABC):
        @abstractmethod
        def get_current_processing_time(self) -> int: ...

        @abstractmethod
        def get_current_watermark(self) -> int: ...

        @abstractmethod
        def register_processing_time_timer(self, time: int) -> None: ...

        @abstractmethod
        def register_event_time_timer(self, time: int) -> None: ...

        @abstractmethod
        def delete_processing_time_timer(self, time: int) -> None: ...

        @abstractmethod
        def delete_event_time_timer(self, time: int) -> None: ...

        @abstractmethod
        def get_partitioned_state(self, state_descriptor): ...

        def get_metric_group(self):
            return None

    class OnMergeContext(TriggerContext):
        @abstractmethod
        def merge_partitioned_state(self, state_descriptor) -> None: ...

    @abstractmethod
    def on_element(self, element, timestamp: int, window, ctx: Trigger.TriggerContext) -> TriggerResult: ...

    @abstractmethod
    def on_processing_time(self, time: int, window, ctx: Trigger.TriggerContext) -> TriggerResult: ...

    @abstractmethod
    def on_event_time(self, time: int, window, ctx: Trigger.TriggerContext) -> TriggerResult: ...

    def can_merge(self) -> bool:
        return False

    def on_merge(self, window, ctx: Trigger.OnMergeContext) -> None:
        """Windows were merged into ``window`` (merging assigners)."""

    @abstractmethod
    def clear(self, window, ctx: Trigger.TriggerContext) -> None: ...


class EventTimeTrigger(Trigger):
    """Fires once the watermark passes the window's end (event-time windows' default)."""

    def on_element(self, element, timestamp, window, ctx):
        if window.max_timestamp() <= ctx.get_current_watermark():
            return TriggerResult.FIRE
        ctx.register_event_time_timer(window.max_timestamp())
        return TriggerResult.CONTINUE

    def on_processing_time(self, time, window, ctx):
        return TriggerResult.CONTINUE

    def on_event_time(self, time, window, ctx):
        return TriggerResult.FIRE if time == window.max_timestamp() else TriggerResult.CONTINUE

    def can_merge(self) -> bool:
        return True

    def on_merge(self, window, ctx):
        if window.max_timestamp() > ctx.get_current_watermark():
            ctx.register_event_time_timer(window.max_timestamp())

    def clear(self, window, ctx):
        ctx.delete_event_time_timer(window.max_timestamp())

    @staticmethod
    def create() -> EventTimeTrigger:
        return EventTimeTrigger()


class ProcessingTimeTrigger(Trigger):
    """Fires once the wall clock passes the window's end (processing-time windows' default)."""

    def on_element(self, element, timestamp, window, ctx):
        ctx.register_processing_time_timer(window.max_timestamp())
        return TriggerResult.CONTINUE

    def on_processing_time(self, time, window, ctx):
        return TriggerResult.FIRE

    def on_event_time(self, time, window, ctx):
        return TriggerResult.CONTINUE

    def can_merge(self) -> bool:
        return True

    def on_merge(self, window, ctx):
        if window.max_timestamp() > ctx.get_current_processing_time():
            ctx.register_processing_time_timer(window.max_timestamp())

    def clear(self, window, ctx):
        ctx.delete_processing_time_timer(window.max_timestamp())

    @staticmethod
    def create() -> ProcessingTimeTrigger:
        return ProcessingTimeTrigger()


class NeverTrigger(Trigger):
    """Never fires: GlobalWindows' default, so a global window needs a trigger of its own."""

    def on_element(self, element, timestamp, window, ctx):
        return TriggerResult.CONTINUE

    def on_processing_time(self, time, window, ctx):
        return TriggerResult.CONTINUE

    def on_event_time(self, time, window, ctx):
        return TriggerResult.CONTINUE

    def clear(self, window, ctx):
        pass


def _sum(a, b):
    return a + b


def _min(a, b):
    return min(a, b)


class CountTrigger(Trigger):
    """Fires (without purging) each time the window's pane reaches ``count`` more elements."""

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"CountTrigger needs a count of at least 1, got {count}")
        self.count = count
        self.state_desc = ReducingStateDescriptor("count", _sum, Types.LONG())

    @staticmethod
    def of(count: int) -> CountTrigger:
        return CountTrigger(count)

    def on_element(self, element, timestamp, window, ctx):
        state = ctx.get_partitioned_state(self.state_desc)
        state.add(1)
        if state.get() >= self.count:
            state.clear()
            return TriggerResult.FIRE
        return TriggerResult.CONTINUE

    def on_processing_time(self, time, window, ctx):
        return TriggerResult.CONTINUE

    def on_event_time(self, time, window, ctx):
        return TriggerResult.CONTINUE

    def can_merge(self) -> bool:
        return True

    def on_merge(self, window, ctx):
        ctx.merge_partitioned_state(self.state_desc)

    def clear(self, window, ctx):
        ctx.get_partitioned_state(self.state_desc).clear()


class PurgingTrigger(Trigger):
    """Another trigger, with each FIRE turned into FIRE_AND_PURGE."""

    def __init__(self, nested_trigger: Trigger):
        self.nested_trigger = nested_trigger

    @staticmethod
    def of(nested_trigger: Trigger) -> PurgingTrigger:
        return PurgingTrigger(nested_trigger)

    @staticmethod
    def _purging(result: TriggerResult) -> TriggerResult:
        return TriggerResult.FIRE_AND_PURGE if result.is_fire() else result

    def on_element(self, element, timestamp, window, ctx):
        return self._purging(self.nested_trigger.on_element(element, timestamp, window, ctx))

    def on_processing_time(self, time, window, ctx):
        return self._purging(self.nested_trigger.on_processing_time(time, window, ctx))

    def on_event_time(self, time, window, ctx):
        return self._purging(self.nested_trigger.on_event_time(time, window, ctx))

    def can_merge(self) -> bool:
        return self.nested_trigger.can_merge()

    def on_merge(self, window, ctx):
        self.nested_trigger.on_merge(window, ctx)

    def clear(self, window, ctx):
        self.nested_trigger.clear(window, ctx)


class ContinuousEventTimeTrigger(Trigger):
    """Fires every ``interval`` of event time while the window is open, and at its end."""

    def __init__(self, interval: int):
        self.interval = interval
        self.state_desc = ReducingStateDescriptor("fire-time", _min, Types.LONG())

    @staticmethod
    def of(interval: Time) -> ContinuousEventTimeTrigger:
        return ContinuousEventTimeTrigger(to_millis(interval, "interval"))

    def on_element(self, element, timestamp, window, ctx):
        if window.max_timestamp() <= ctx.get_current_watermark():
            return TriggerResult.FIRE
        ctx.register_event_time_timer(window.max_timestamp())
        state = ctx.get_partitioned_state(self.state_desc)
        if state.get() is None:
            self._next(timestamp - timestamp % self.interval, window, ctx, state)
        return TriggerResult.CONTINUE

    def on_processing_time(self, time, window, ctx):
        return TriggerResult.CONTINUE

    def on_event_time(self, time, window, ctx):
        if time == window.max_timestamp():
            return TriggerResult.FIRE
        state = ctx.get_partitioned_state(self.state_desc)
        if state.get() == time:
            state.clear()
            self._next(time, window, ctx, state)
            return TriggerResult.FIRE
        return TriggerResult.CONTINUE

    def _next(self, time: int, window, ctx, state) -> None:
        at = min(time + self.interval, window.max_timestamp())
        state.add(at)
        ctx.register_event_time_timer(at)

    def can_merge(self) -> bool:
        return True

    def on_merge(self, window, ctx):
        ctx.merge_partitioned_state(self.state_desc)
        at = ctx.get_partitioned_state(self.state_desc).get()
        if at is not None:
            ctx.register_event_time_timer(at)

    def clear(self, window, ctx):
        state = ctx.get_partitioned_state(self.state_desc)
        if state.get() is not None:
            ctx.delete_event_time_timer(state.get())
            state.clear()


class ContinuousProcessingTimeTrigger(Trigger):
    """Fires every ``interval`` of processing time while the window is open, and at its end."""

    def __init__(self, interval: int):
        self.interval = interval
        self.state_desc = ReducingStateDescriptor("fire-time", _min, Types.LONG())

    @staticmethod
    def of(interval: Time) -> ContinuousProcessingTimeTrigger:
        return ContinuousProcessingTimeTrigger(to_millis(interval, "interval"))

    def on_element(self, element, timestamp, window, ctx):
        state = ctx.get_partitioned_state(self.state_desc)
        if state.get() is None:
            now = ctx.get_current_processing_time()
            at = min(now - now % self.interval + self.interval, window.max_timestamp())
            state.add(at)
            ctx.register_processing_time_timer(at)
        return TriggerResult.CONTINUE

    def on_processing_time(self, time, window, ctx):
        state = ctx.get_partitioned_state(self.state_desc)
        if state.get() == time:
            state.clear()
            at = min(time + self.interval, window.max_timestamp())
            state.add(at)
            ctx.register_processing_time_timer(at)
            return TriggerResult.FIRE
        return TriggerResult.CONTINUE

    def on_event_time(self, time, window, ctx):
        return TriggerResult.CONTINUE

    def can_merge(self) -> bool:
        return True

    def on_merge(self, window, ctx):
        ctx.merge_partitioned_state(self.state_desc)

    def clear(self, window, ctx):
        state = ctx.get_partitioned_state(self.state_desc)
        if state.get() is not None:
            ctx.delete_processing_time_timer(state.get())
            state.clear()


def default_trigger(assigner) -> Trigger:
    """What fires an assigner's windows when no trigger is set."""
    if isinstance(assigner, GlobalWindows):
        return NeverTrigger()
    return EventTimeTrigger() if assigner.event_time else ProcessingTimeTrigger()
