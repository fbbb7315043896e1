"""Keyed state: PyFlink's state interfaces and descriptors (``pyflink.datastream.state``).

The interfaces are what user functions call; the engine's implementations keep every value in the
operator's shared-memory state tables (see ``stretch.state``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any

from stretch.common.time import Time
from stretch.common.typeinfo import TypeInformation, Types
from stretch.contracts.functions import AggregateFunction, ReduceFunction


# ---- state interfaces --------------------------------------------------------------------
class State(ABC):
    """State scoped to the key of the record being processed."""

    @abstractmethod
    def clear(self) -> None: ...


class ValueState(State):
    """One value per key: ``value()`` (None until set), ``update(v)``, ``clear()``."""

    @abstractmethod
    def value(self): ...

    @abstractmethod
    def update(self, value) -> None: ...


class AppendingState(State):
    """State that values are added to (``add``) and read as a whole (``get``)."""

    @abstractmethod
    def get(self): ...

    @abstractmethod
    def add(self, value) -> None: ...


class MergingState(AppendingState, ABC):
    """Appending state whose contents of several windows can be merged (session windows)."""

    pass


class ListState(MergingState):
    """A list per key: ``add``, ``add_all``, ``update`` (replace), ``get`` or iterate."""

    @abstractmethod
    def update(self, values: list) -> None: ...

    @abstractmethod
    def add_all(self, values: list) -> None: ...

    def __iter__(self):
        return iter(self.get())


class ReducingState(MergingState):
    """One value per key that each ``add`` folds in with the descriptor's reduce function."""

    pass


class AggregatingState(MergingState):
    """One accumulator per key that each ``add`` feeds through the descriptor's AggregateFunction."""

    pass


class _MapReads(State):
    """What every map-like state can be asked: the reads of ``MapState``."""

    @abstractmethod
    def get(self, key): ...

    @abstractmethod
    def contains(self, key) -> bool: ...

    @abstractmethod
    def items(self): ...

    @abstractmethod
    def keys(self): ...

    @abstractmethod
    def values(self): ...

    @abstractmethod
    def is_empty(self) -> bool: ...

    def __getitem__(self, key):
        return self.get(key)

    def __contains__(self, key):
        return self.contains(key)

    def __iter__(self):
        return iter(self.keys())


class MapState(_MapReads):
    """A dict per key: ``get``, ``put``, ``remove``, ``contains``, ``items``, ``keys``, ``values``."""

    @abstractmethod
    def put(self, key, value) -> None: ...

    @abstractmethod
    def put_all(self, dict_value) -> None: ...

    @abstractmethod
    def remove(self, key) -> None: ...

    def __setitem__(self, key, value):
        self.put(key, value)

    def __delitem__(self, key):
        self.remove(key)


class ReadOnlyBroadcastState(_MapReads):
    """A broadcast state as ``process_element`` sees it (PyFlink's ``ReadOnlyBroadcastState``):
    one map for every instance, to read but not to change."""


class BroadcastState(MapState, ReadOnlyBroadcastState):
    """A broadcast state as ``process_broadcast_element`` sees it: the same map, writable."""


# ---- TTL ---------------------------------------------------------------------------------
class StateTtlConfig:
    """Time-to-live of keyed state, as PyFlink's builder describes it."""

    class UpdateType(Enum):
        Disabled = 0
        OnCreateAndWrite = 1
        OnReadAndWrite = 2

    class StateVisibility(Enum):
        ReturnExpiredIfNotCleanedUp = 0
        NeverReturnExpired = 1

    class TtlTimeCharacteristic(Enum):
        ProcessingTime = 0

    def __init__(
        self, update_type, state_visibility, ttl_time_characteristic, ttl: Time, cleanup_strategies=None
    ):
        self._update_type = update_type
        self._state_visibility = state_visibility
        self._ttl_time_characteristic = ttl_time_characteristic
        self._ttl = ttl
        self._cleanup_strategies = cleanup_strategies

    @staticmethod
    def new_builder(ttl: Time) -> StateTtlConfig.Builder:
        return StateTtlConfig.Builder(ttl)

    def get_update_type(self):
        return self._update_type

    def get_state_visibility(self):
        return self._state_visibility

    def get_ttl(self) -> Time:
        return self._ttl

    def get_ttl_time_characteristic(self):
        return self._ttl_time_characteristic

    def is_enabled(self) -> bool:
        return self._update_type != StateTtlConfig.UpdateType.Disabled

    def get_cleanup_strategies(self):
        return self._cleanup_strategies

    def to_json(self) -> dict:
        return {
            "ttl_ms": self._ttl.to_milliseconds(),
            "update": self._update_type.name,
            "visibility": self._state_visibility.name,
        }

    class Builder:
        def __init__(self, ttl: Time):
            self._ttl = ttl
            self._update_type = StateTtlConfig.UpdateType.OnCreateAndWrite
            self._visibility = StateTtlConfig.StateVisibility.NeverReturnExpired
            self._characteristic = StateTtlConfig.TtlTimeCharacteristic.ProcessingTime
            self._cleanup: list = []

        def set_update_type(self, update_type):
            self._update_type = update_type
            return self

        def update_ttl_on_create_and_write(self):
            return self.set_update_type(StateTtlConfig.UpdateType.OnCreateAndWrite)

        def update_ttl_on_read_and_write(self):
            return self.set_update_type(StateTtlConfig.UpdateType.OnReadAndWrite)

        def set_state_visibility(self, state_visibility):
            self._visibility = state_visibility
            return self

        def return_expired_if_not_cleaned_up(self):
            return self.set_state_visibility(StateTtlConfig.StateVisibility.ReturnExpiredIfNotCleanedUp)

        def never_return_expired(self):
            return self.set_state_visibility(StateTtlConfig.StateVisibility.NeverReturnExpired)

        def set_ttl_time_characteristic(self, ttl_time_characteristic):
            self._characteristic = ttl_time_characteristic
            return self

        def use_processing_time(self):
            return self.set_ttl_time_characteristic(StateTtlConfig.TtlTimeCharacteristic.ProcessingTime)

        def cleanup_full_snapshot(self):
            self._cleanup.append("full_snapshot")
            return self

        def cleanup_incrementally(self, cleanup_size: int, run_cleanup_for_every_record: bool):
            self._cleanup.append(("incremental", cleanup_size, run_cleanup_for_every_record))
            return self

        def cleanup_in_rocksdb_compact_filter(
            self, query_time_after_num_entries, periodic_compaction_time=None
        ):
            self._cleanup.append(("compaction_filter", query_time_after_num_entries))
            return self

        def disable_cleanup_in_background(self):
            self._cleanup.clear()
            return self

        def set_ttl(self, ttl: Time):
            self._ttl = ttl
            return self

        def build(self) -> StateTtlConfig:
            return StateTtlConfig(
                self._update_type, self._visibility, self._characteristic, self._ttl, self._cleanup
            )


# ---- descriptors -------------------------------------------------------------------------
class StateDescriptor:
    """Names a piece of keyed state and its type; the same name always means the same state."""

    kind = ""

    def __init__(self, name: str, type_info: TypeInformation | None):
        if not isinstance(name, str) or not name:
            raise ValueError("a state descriptor needs a non-empty name")
        if type_info is not None and not isinstance(type_info, TypeInformation):
            raise TypeError(f"state {name!r}: type_info must be a Types.X() value, got {type_info!r}")
        self.name = name
        self.type_info = type_info
        self._ttl_config: StateTtlConfig | None = None

    def get_name(self) -> str:
        return self.name

    def enable_time_to_live(self, ttl_config: StateTtlConfig) -> None:
        self._ttl_config = ttl_config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.type_info!r})"


class ValueStateDescriptor(StateDescriptor):
    """Declares a ValueState: its name (unique in the function) and the type of its value."""

    kind = "value"

    def __init__(self, name: str, value_type_info: TypeInformation):
        super().__init__(name, value_type_info)


class ListStateDescriptor(StateDescriptor):
    """Declares a ListState: its name and the type of its elements."""

    kind = "list"

    def __init__(self, name: str, elem_type_info: TypeInformation):
        super().__init__(name, Types.LIST(elem_type_info))
        self.elem_type_info = elem_type_info


class MapStateDescriptor(StateDescriptor):
    """Declares a MapState: its name and the types of its keys and values."""

    kind = "map"

    def __init__(self, name: str, key_type_info: TypeInformation, value_type_info: TypeInformation):
        super().__init__(name, Types.MAP(key_type_info, value_type_info))
        self.key_type_info = key_type_info
        self.value_type_info = value_type_info


class ReducingStateDescriptor(StateDescriptor):
    """Declares a ReducingState: its name, reduce function and value type."""

    kind = "reducing"

    def __init__(self, name: str, reduce_function: Any, type_info: TypeInformation):
        super().__init__(name, type_info)
        if isinstance(reduce_function, ReduceFunction):
            self.reduce_function = reduce_function.reduce
        elif callable(reduce_function):
            self.reduce_function = reduce_function
        else:
            raise TypeError("The input must be a ReduceFunction or a callable function!")


class AggregatingStateDescriptor(StateDescriptor):
    """Declares an AggregatingState: its name, AggregateFunction and accumulator type."""

    kind = "aggregating"

    def __init__(self, name: str, agg_function: Any, state_type_info: TypeInformation):
        super().__init__(name, state_type_info)
        if not isinstance(agg_function, AggregateFunction):
            raise TypeError("The input must be a pyflink.datastream.functions.AggregateFunction!")
        self.agg_function = agg_function
