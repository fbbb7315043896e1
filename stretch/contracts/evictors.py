"""Window evictors, with PyFlink's names: elements removed from a window's pane before and/or
after its function is applied (``evict_before``/``evict_after``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from stretch.contracts.window import to_millis


@dataclass
class TimestampedValue:
    """An element of a pane with its timestamp, as an evictor sees it."""

    value: Any
    timestamp: int | None

    def get_value(self):
        return self.value

    def get_timestamp(self) -> int | None:
        return self.timestamp

    def has_timestamp(self) -> bool:
        return self.timestamp is not None


class Evictor(ABC):
    """``elements`` is the pane as a list of TimestampedValue: remove from it in place."""

    class EvictorContext(ABC):
        @abstractmethod
        def get_current_processing_time(self) -> int: ...

        @abstractmethod
        def get_current_watermark(self) -> int: ...

    @abstractmethod
    def evict_before(self, elements: list, size: int, window, evictor_context) -> None: ...

    @abstractmethod
    def evict_after(self, elements: list, size: int, window, evictor_context) -> None: ...


class _BeforeOrAfter(Evictor):
    """The built-in evictors: one rule, applied before the function or (``do_evict_after``) after."""

    do_evict_after = False

    def _evict(self, elements: list, size: int) -> None:
        raise NotImplementedError

    def evict_before(self, elements, size, window, evictor_context):
        if not self.do_evict_after:
            self._evict(elements, size)

    def evict_after(self, elements, size, window, evictor_context):
        if self.do_evict_after:
            self._evict(elements, size)


class CountEvictor(_BeforeOrAfter):
    """Keeps at most ``max_count`` elements (the latest), before the function or after it."""

    def __init__(self, max_count: int, do_evict_after: bool = False):
        self.max_count, self.do_evict_after = max_count, do_evict_after

    @staticmethod
    def of(max_count: int, do_evict_after: bool = False) -> CountEvictor:
        return CountEvictor(max_count, do_evict_after)

    def _evict(self, elements: list, size: int) -> None:
        if size > self.max_count:
            del elements[: size - self.max_count]


class TimeEvictor(_BeforeOrAfter):
    """Keeps the elements within ``window_size`` of the pane's latest timestamp."""

    def __init__(self, window_size: int, do_evict_after: bool = False):
        self.window_size, self.do_evict_after = window_size, do_evict_after

    @staticmethod
    def of(window_size, do_evict_after: bool = False) -> TimeEvictor:
        return TimeEvictor(to_millis(window_size, "window size"), do_evict_after)

    def _evict(self, elements: list, size: int) -> None:
        stamps = [e.timestamp for e in elements if e.timestamp is not None]
        if not stamps:
            return
        cut = max(stamps) - self.window_size
        elements[:] = [e for e in elements if e.timestamp is None or e.timestamp > cut]


class DeltaEvictor(_BeforeOrAfter):
    """Removes the elements whose ``delta_function(element, last)`` to the pane's last element is
    at least ``threshold``."""

    def __init__(self, threshold: float, delta_function, do_evict_after: bool = False):
        self.threshold, self.delta_function, self.do_evict_after = threshold, delta_function, do_evict_after

    @staticmethod
    def of(threshold: float, delta_function, do_evict_after: bool = False) -> DeltaEvictor:
        return DeltaEvictor(threshold, delta_function, do_evict_after)

    def _evict(self, elements: list, size: int) -> None:
        if not elements:
            return
        last = elements[-1].value
        elements[:] = [e for e in elements if self.delta_function(e.value, last) < self.threshold]
