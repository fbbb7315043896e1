"""What a user function sees of its instance: runtime context, timer service, element context."""

from __future__ import annotations

import time

from stretch.common.wording import a
from stretch.contracts import state as api_state
from stretch.contracts.functions import KeyedProcessFunction, RuntimeContext, TimeDomain, TimerService
from stretch.state.backend import KeyedStateBackend
from stretch.state.timers import EVENT, PROCESSING


class InstanceRuntimeContext(RuntimeContext):
    """What a user function learns about its instance in open(): names, parallelism, state."""

    def __init__(
        self,
        task_name: str,
        index: int,
        parallelism,
        max_parallelism: int,
        backend=None,
        metrics=None,
        job_parameters: dict | None = None,
    ):
        if metrics is not None:  # the task's own group: the worker reports it (runtime.user_metrics)
            self.__dict__["_metrics_group"] = metrics
        self._job_parameters = job_parameters or {}
        self._task_name = task_name
        self._index = index
        self._parallelism = parallelism  # a callable: parallelism changes with rescales
        self._max_parallelism = max_parallelism
        self._backend = backend

    def get_task_name(self) -> str:
        return self._task_name

    def get_number_of_parallel_subtasks(self) -> int:
        return self._parallelism()

    def get_max_number_of_parallel_subtasks(self) -> int:
        return self._max_parallelism

    def get_index_of_this_subtask(self) -> int:
        return self._index

    def get_job_parameter(self, key: str, default_value: str):
        """A global job parameter (``env.get_config().set_global_job_parameters``), as in PyFlink."""
        return self._job_parameters.get(key, default_value)

    def _state(self, descriptor, cls):
        if self._backend is None:
            raise RuntimeError("This state is only accessible by functions executed on a KeyedStream.")
        if not isinstance(descriptor, cls):
            raise TypeError(f"expected {a(cls.__name__)}, got {descriptor!r}")
        return self._backend.state(descriptor)

    def get_state(self, state_descriptor):
        return self._state(state_descriptor, api_state.ValueStateDescriptor)

    def get_list_state(self, state_descriptor):
        return self._state(state_descriptor, api_state.ListStateDescriptor)

    def get_map_state(self, state_descriptor):
        return self._state(state_descriptor, api_state.MapStateDescriptor)

    def get_reducing_state(self, state_descriptor):
        return self._state(state_descriptor, api_state.ReducingStateDescriptor)

    def get_aggregating_state(self, state_descriptor):
        return self._state(state_descriptor, api_state.AggregatingStateDescriptor)


class KeyedTimerService(TimerService):
    """Timers of the current key, kept with its state; registrations apply at the batch's end."""

    __slots__ = ("_b", "_op")

    def __init__(self, backend: KeyedStateBackend, operator):
        self._b = backend
        self._op = operator

    def current_processing_time(self) -> int:
        return time.time_ns() // 1_000_000

    def current_watermark(self) -> int:
        return self._op.watermark

    def register_event_time_timer(self, timestamp: int) -> None:
        self._b.timer_op(EVENT, int(timestamp), True)

    def register_processing_time_timer(self, timestamp: int) -> None:
        self._b.timer_op(PROCESSING, int(timestamp), True)

    def delete_event_time_timer(self, timestamp: int) -> None:
        self._b.timer_op(EVENT, int(timestamp), False)

    def delete_processing_time_timer(self, timestamp: int) -> None:
        self._b.timer_op(PROCESSING, int(timestamp), False)


class KeyedContext(KeyedProcessFunction.OnTimerContext):
    """The ``ctx`` of process_element and on_timer: current key, record or timer time, timers."""

    __slots__ = ("_b", "_timers", "domain", "ts")

    def __init__(self, backend: KeyedStateBackend, timers: KeyedTimerService):
        self._b = backend
        self._timers = timers
        self.ts = None
        self.domain = TimeDomain.EVENT_TIME

    def get_current_key(self):
        return self._b.keys[self._b.current]

    def timer_service(self) -> TimerService:
        return self._timers

    def timestamp(self):
        return self.ts

    def time_domain(self) -> TimeDomain:
        return self.domain
