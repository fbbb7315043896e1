"""ExecutionConfig (``pyflink.common.ExecutionConfig``): the job settings ``env.get_config()``
returns. Parallelism goes to the environment; the rest is kept and reported, not acted on."""

from __future__ import annotations


class ExecutionConfig:
    """PyFlink's per-job execution settings (``env.get_config()``): parallelism, watermark interval,
    job parameters."""

    def __init__(self, env=None):
        self._env = env
        self._auto_watermark_interval = 200
        self._latency_tracking_interval = 0
        self._closure_cleaner = True
        self._object_reuse = False
        self._global_job_parameters: dict[str, str] = {}
        self._task_cancellation_interval = 30000

    def get_parallelism(self) -> int:
        return self._env.get_parallelism()

    def set_parallelism(self, parallelism: int) -> ExecutionConfig:
        self._env.set_parallelism(parallelism)
        return self

    def get_max_parallelism(self) -> int:
        return self._env.get_max_parallelism()

    def set_max_parallelism(self, max_parallelism: int) -> ExecutionConfig:
        self._env.set_max_parallelism(max_parallelism)
        return self

    def set_auto_watermark_interval(self, interval: int) -> ExecutionConfig:
        self._auto_watermark_interval = int(interval)
        return self

    def get_auto_watermark_interval(self) -> int:
        return self._auto_watermark_interval

    def set_latency_tracking_interval(self, interval: int) -> ExecutionConfig:
        self._latency_tracking_interval = int(interval)
        return self

    def get_latency_tracking_interval(self) -> int:
        return self._latency_tracking_interval

    def enable_closure_cleaner(self) -> ExecutionConfig:
        self._closure_cleaner = True
        return self

    def disable_closure_cleaner(self) -> ExecutionConfig:
        self._closure_cleaner = False
        return self

    def is_closure_cleaner_enabled(self) -> bool:
        return self._closure_cleaner

    def enable_object_reuse(self) -> ExecutionConfig:
        self._object_reuse = True
        return self

    def disable_object_reuse(self) -> ExecutionConfig:
        self._object_reuse = False
        return self

    def is_object_reuse_enabled(self) -> bool:
        return self._object_reuse

    def set_task_cancellation_interval(self, interval: int) -> ExecutionConfig:
        self._task_cancellation_interval = int(interval)
        return self

    def get_task_cancellation_interval(self) -> int:
        return self._task_cancellation_interval

    def set_global_job_parameters(self, global_job_parameters_dict: dict) -> ExecutionConfig:
        self._global_job_parameters = {str(k): str(v) for k, v in global_job_parameters_dict.items()}
        return self

    def get_global_job_parameters(self) -> dict[str, str]:
        return dict(self._global_job_parameters)
