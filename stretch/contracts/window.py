"""Windows and window assigners, with PyFlink's names (``pyflink.datastream.window``).

Window starts follow Flink's formula ``start = ts - (ts - offset + size) % size``; a time window
covers ``[start, end)`` and its results carry ``end - 1`` (``max_timestamp()``) as timestamp.
"""

from __future__ import annotations

from dataclasses import dataclass

from stretch.common.time import Duration, Time


def to_millis(value, what: str) -> int:
    if isinstance(value, (Time, Duration)):
        ms = value.to_milliseconds()
    elif isinstance(value, int) and not isinstance(value, bool):
        ms = value
    else:
        raise TypeError(f"{what} must be a Time, a Duration or milliseconds, got {value!r}")
    return int(ms)


def window_start(timestamp: int, offset: int, size: int) -> int:
    """Flink's TimeWindow.getWindowStartWithOffset."""
    return timestamp - (timestamp - offset + size) % size


class Window:
    """A window: the group of records a window function sees at once."""

    def max_timestamp(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True, order=True)
class TimeWindow(Window):
    start: int
    end: int

    def max_timestamp(self) -> int:
        return self.end - 1

    def intersects(self, other: TimeWindow) -> bool:
        return self.start <= other.end and self.end >= other.start

    def cover(self, other: TimeWindow) -> TimeWindow:
        return TimeWindow(min(self.start, other.start), max(self.end, other.end))

    def __repr__(self) -> str:
        return f"TimeWindow(start={self.start}, end={self.end})"


@dataclass(frozen=True, order=True)
class CountWindow(Window):
    id: int

    def max_timestamp(self) -> int:
        return 2**63 - 1


@dataclass(frozen=True)
class GlobalWindow(Window):
    def max_timestamp(self) -> int:
        return 2**63 - 1


class WindowAssigner:
    """Which windows a record belongs to; ``event_time`` says which clock drives them."""

    event_time = True
    merging = False

    def assign_windows(self, element, timestamp: int) -> list[Window]:
        raise NotImplementedError


class TumblingEventTimeWindows(WindowAssigner):
    """Fixed-size, non-overlapping event-time windows (``of(size, offset)``)."""

    def __init__(self, size: int, offset: int = 0):
        if size <= 0 or abs(offset) >= size:
            raise ValueError("TumblingWindows need size > 0 and |offset| < size")
        self.size, self.offset = size, offset

    @staticmethod
    def of(size, offset=None) -> TumblingEventTimeWindows:
        return TumblingEventTimeWindows(to_millis(size, "size"), to_millis(offset, "offset") if offset else 0)

    def assign_windows(self, element, timestamp: int) -> list[TimeWindow]:
        start = window_start(timestamp, self.offset, self.size)
        return [TimeWindow(start, start + self.size)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.size}, {self.offset})"


class SlidingEventTimeWindows(WindowAssigner):
    """Fixed-size event-time windows that start every ``slide`` (``of(size, slide, offset)``)."""

    def __init__(self, size: int, slide: int, offset: int = 0):
        if size <= 0 or slide <= 0 or abs(offset) >= slide:
            raise ValueError("SlidingWindows need size > 0, slide > 0 and |offset| < slide")
        self.size, self.slide, self.offset = size, slide, offset

    @staticmethod
    def of(size, slide, offset=None) -> SlidingEventTimeWindows:
        return SlidingEventTimeWindows(
            to_millis(size, "size"), to_millis(slide, "slide"), to_millis(offset, "offset") if offset else 0
        )

    def assign_windows(self, element, timestamp: int) -> list[TimeWindow]:
        last = window_start(timestamp, self.offset, self.slide)
        return [TimeWindow(s, s + self.size) for s in range(last, timestamp - self.size, -self.slide)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.size}, {self.slide}, {self.offset})"


class SessionWindowTimeGapExtractor:
    """A session's gap per record, for ``with_dynamic_gap`` (PyFlink's interface)."""

    def extract(self, element) -> int:
        raise NotImplementedError


class EventTimeSessionWindows(WindowAssigner):
    """Sessions: a record opens ``[ts, ts + gap)``; overlapping sessions of a key merge."""

    merging = True

    def __init__(self, gap: int | None = None, extractor=None):
        if gap is not None and gap <= 0:
            raise ValueError("a session gap must be positive")
        self.gap, self.extractor = gap, extractor

    @staticmethod
    def with_gap(size) -> EventTimeSessionWindows:
        return EventTimeSessionWindows(to_millis(size, "gap"))

    @staticmethod
    def with_dynamic_gap(extractor) -> EventTimeSessionWindows:
        """``extractor.extract(element)`` (or a callable) gives each record's gap in ms."""
        return EventTimeSessionWindows(None, extractor)

    def gap_of(self, element) -> int:
        if self.extractor is None:
            return self.gap
        fn = getattr(self.extractor, "extract", self.extractor)
        gap = int(fn(element))
        if gap <= 0:
            raise ValueError(f"a session gap must be positive, the gap extractor gave {gap} for {element!r}")
        return gap

    def assign_windows(self, element, timestamp: int) -> list[TimeWindow]:
        return [TimeWindow(timestamp, timestamp + self.gap_of(element))]


class TumblingProcessingTimeWindows(TumblingEventTimeWindows):
    """Fixed-size, non-overlapping windows of the wall clock."""

    event_time = False

    @staticmethod
    def of(size, offset=None) -> TumblingProcessingTimeWindows:
        return TumblingProcessingTimeWindows(
            to_millis(size, "size"), to_millis(offset, "offset") if offset else 0
        )


class SlidingProcessingTimeWindows(SlidingEventTimeWindows):
    """Fixed-size windows of the wall clock that start every ``slide``."""

    event_time = False

    @staticmethod
    def of(size, slide, offset=None) -> SlidingProcessingTimeWindows:
        return SlidingProcessingTimeWindows(
            to_millis(size, "size"), to_millis(slide, "slide"), to_millis(offset, "offset") if offset else 0
        )


class ProcessingTimeSessionWindows(EventTimeSessionWindows):
    """Windows of the wall clock that close after a gap without records of their key."""

    event_time = False

    @staticmethod
    def with_gap(size) -> ProcessingTimeSessionWindows:
        return ProcessingTimeSessionWindows(to_millis(size, "gap"))

    @staticmethod
    def with_dynamic_gap(extractor) -> ProcessingTimeSessionWindows:
        return ProcessingTimeSessionWindows(None, extractor)


class CountTumblingWindowAssigner(WindowAssigner):
    """Every ``size`` records of a key form a window (fires and clears when full)."""

    event_time = False

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError("a count window needs a positive size")
        self.size = size

    @staticmethod
    def of(window_size: int) -> CountTumblingWindowAssigner:
        return CountTumblingWindowAssigner(window_size)


class CountSlidingWindowAssigner(WindowAssigner):
    """The last ``size`` records of a key, every ``slide`` records."""

    event_time = False

    def __init__(self, size: int, slide: int):
        if size <= 0 or slide <= 0:
            raise ValueError("a count window needs a positive size and slide")
        self.size, self.slide = size, slide

    @staticmethod
    def of(window_size: int, window_slide: int) -> CountSlidingWindowAssigner:
        return CountSlidingWindowAssigner(window_size, window_slide)


class GlobalWindows(WindowAssigner):
    """All of a key's elements in one window that never ends: it fires only by a trigger set with
    ``WindowedStream.trigger`` (its default trigger never fires), as in Flink."""

    event_time = False

    def assign_windows(self, element, timestamp: int) -> list[Window]:
        return [GlobalWindow()]

    @staticmethod
    def create() -> GlobalWindows:
        return GlobalWindows()
