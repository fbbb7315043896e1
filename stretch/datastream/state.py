"""Keyed state interfaces and descriptors (PyFlink: ``pyflink.datastream.state``).

The definitions live in ``stretch.contracts.state``, below the engine that calls them."""

from stretch.contracts.state import (
    AggregatingState,
    AggregatingStateDescriptor,
    AppendingState,
    BroadcastState,
    ListState,
    ListStateDescriptor,
    MapState,
    MapStateDescriptor,
    MergingState,
    ReadOnlyBroadcastState,
    ReducingState,
    ReducingStateDescriptor,
    State,
    StateDescriptor,
    StateTtlConfig,
    ValueState,
    ValueStateDescriptor,
)

__all__ = [
    "AggregatingState",
    "AggregatingStateDescriptor",
    "AppendingState",
    "BroadcastState",
    "ListState",
    "ListStateDescriptor",
    "MapState",
    "MapStateDescriptor",
    "MergingState",
    "ReadOnlyBroadcastState",
    "ReducingState",
    "ReducingStateDescriptor",
    "State",
    "StateDescriptor",
    "StateTtlConfig",
    "ValueState",
    "ValueStateDescriptor",
]
