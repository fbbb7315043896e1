"""How a job runs, in PyFlink's names: execution mode, time characteristic, slot sharing groups and
state backends (``pyflink.datastream.execution_mode`` and friends).

Only ``RuntimeExecutionMode`` changes results (BATCH: rolling reductions emit each key's final
value only). The others are accepted so that PyFlink programs run unchanged: stretch has one time
model (event time where records carry timestamps, processing time for processing-time windows),
one kind of slot (a worker process) and one state backend (keyed state in shared memory,
snapshotted to the job's state directory).
"""

from __future__ import annotations

from enum import Enum


class RuntimeExecutionMode(Enum):
    """STREAMING (the default), BATCH or AUTOMATIC, with Flink's meanings (``env.set_runtime_mode``)."""

    STREAMING = 0
    BATCH = 1
    AUTOMATIC = 2


class TimeCharacteristic(Enum):
    """PyFlink's time characteristic (deprecated there), accepted for ported programs: records with
    timestamps are on event time, processing-time windows and timers on the wall clock."""

    ProcessingTime = 0
    IngestionTime = 1
    EventTime = 2


class SlotSharingGroup:
    """A named group with a resource spec; recorded on the operator, not acted on."""

    def __init__(self, name: str, cpu_cores: float | None = None, memory_mb: dict | None = None):
        self._name = name
        self._cpu_cores = cpu_cores
        self._memory_mb = dict(memory_mb or {})

    def get_name(self) -> str:
        return self._name

    def get_cpu_cores(self) -> float | None:
        return self._cpu_cores

    def get_task_heap_memory(self):
        return self._memory_mb.get("task_heap")

    def get_task_off_heap_memory(self):
        return self._memory_mb.get("task_off_heap")

    def get_managed_memory(self):
        return self._memory_mb.get("managed")

    def __eq__(self, other) -> bool:
        return isinstance(other, SlotSharingGroup) and (
            self._name,
            self._cpu_cores,
            self._memory_mb,
        ) == (other._name, other._cpu_cores, other._memory_mb)

    def __hash__(self) -> int:
        return hash(self._name)

    def __repr__(self) -> str:
        return f"SlotSharingGroup({self._name!r})"

    @staticmethod
    def builder(name: str) -> SlotSharingGroup.Builder:
        return SlotSharingGroup.Builder(name)

    class Builder:
        def __init__(self, name: str):
            self._name, self._cpu, self._mem = name, None, {}

        def set_cpu_cores(self, cpu_cores: float) -> SlotSharingGroup.Builder:
            self._cpu = cpu_cores
            return self

        def set_task_heap_memory_mb(self, mb: int) -> SlotSharingGroup.Builder:
            self._mem["task_heap"] = mb
            return self

        def set_task_off_heap_memory_mb(self, mb: int) -> SlotSharingGroup.Builder:
            self._mem["task_off_heap"] = mb
            return self

        def set_managed_memory_mb(self, mb: int) -> SlotSharingGroup.Builder:
            self._mem["managed"] = mb
            return self

        def build(self) -> SlotSharingGroup:
            return SlotSharingGroup(self._name, self._cpu, self._mem)


class StateBackend:
    """Base of PyFlink's state backends. Every one of them selects the same thing in stretch:
    keyed state in shared memory, snapshotted at checkpoints."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class HashMapStateBackend(StateBackend):
    """PyFlink's heap state backend; like every backend, it selects stretch's shared-memory keyed state."""

    pass


class EmbeddedRocksDBStateBackend(StateBackend):
    """PyFlink's RocksDB state backend; like every backend, it selects stretch's shared-memory keyed
    state."""

    pass


class MemoryStateBackend(StateBackend):
    pass


class FsStateBackend(StateBackend):
    pass


class RocksDBStateBackend(StateBackend):
    pass
