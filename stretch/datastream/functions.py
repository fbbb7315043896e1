"""User function interfaces (PyFlink: ``pyflink.datastream.functions``).

The definitions live in ``stretch.contracts.functions``, below the engine that calls them."""

from stretch.contracts.functions import (
    AggregateFunction,
    CoGroupFunction,
    FilterFunction,
    FlatMapFunction,
    Function,
    JoinFunction,
    KeyedProcessFunction,
    KeySelector,
    MapFunction,
    Partitioner,
    ProcessFunction,
    ProcessJoinFunction,
    ProcessWindowFunction,
    ReduceFunction,
    RuntimeContext,
    TimeDomain,
    TimerService,
    WindowFunction,
)

__all__ = [
    "AggregateFunction",
    "CoGroupFunction",
    "FilterFunction",
    "FlatMapFunction",
    "Function",
    "JoinFunction",
    "KeySelector",
    "KeyedProcessFunction",
    "MapFunction",
    "Partitioner",
    "ProcessFunction",
    "ProcessJoinFunction",
    "ProcessWindowFunction",
    "ReduceFunction",
    "RuntimeContext",
    "TimeDomain",
    "TimerService",
    "WindowFunction",
]
