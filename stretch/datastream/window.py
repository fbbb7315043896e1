"""Windows and window assigners (PyFlink: ``pyflink.datastream.window``).

The definitions live in ``stretch.contracts.window``, below the engine that calls them."""

from stretch.contracts.window import (
    CountSlidingWindowAssigner,
    CountTumblingWindowAssigner,
    CountWindow,
    EventTimeSessionWindows,
    GlobalWindow,
    ProcessingTimeSessionWindows,
    SessionWindowTimeGapExtractor,
    SlidingEventTimeWindows,
    SlidingProcessingTimeWindows,
    TimeWindow,
    TumblingEventTimeWindows,
    TumblingProcessingTimeWindows,
    Window,
    WindowAssigner,
)

__all__ = [
    "CountSlidingWindowAssigner",
    "CountTumblingWindowAssigner",
    "CountWindow",
    "EventTimeSessionWindows",
    "GlobalWindow",
    "ProcessingTimeSessionWindows",
    "SessionWindowTimeGapExtractor",
    "SlidingEventTimeWindows",
    "SlidingProcessingTimeWindows",
    "TimeWindow",
    "TumblingEventTimeWindows",
    "TumblingProcessingTimeWindows",
    "Window",
    "WindowAssigner",
]
