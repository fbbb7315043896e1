"""Checkpoint settings with PyFlink's names (``pyflink.datastream.CheckpointConfig``).

A PyFlink program's usual checkpoint setup runs unchanged; each setting means what it means in
Flink. Where stretch differs, the method's docstring says so.
"""

from __future__ import annotations

from enum import Enum

from stretch.runtime.checkpointing import CheckpointSettings


class CheckpointingMode(Enum):
    """Flink's two modes. stretch's barriers are placed by the coordinator and need no alignment
    buffers, so both give exactly once; at-least-once is accepted for programs that ask for it."""

    EXACTLY_ONCE = 0
    AT_LEAST_ONCE = 1


class ExternalizedCheckpointRetention(Enum):
    """What a cancelled job does with its checkpoints. They always stay when a job fails or its
    process dies, so that it can be restored; stretch keeps them on cancellation by default."""

    DELETE_ON_CANCELLATION = 0
    RETAIN_ON_CANCELLATION = 1
    NO_EXTERNALIZED_CHECKPOINTS = 2  # as DELETE_ON_CANCELLATION: a dead process's job needs them


class CheckpointConfig:
    """``env.get_checkpoint_config()``: the checkpoint settings of the jobs an environment submits."""

    DEFAULT_MODE = CheckpointingMode.EXACTLY_ONCE
    DEFAULT_TIMEOUT = 10 * 60 * 1000
    DEFAULT_MIN_PAUSE_BETWEEN_CHECKPOINTS = 0
    DEFAULT_MAX_CONCURRENT_CHECKPOINTS = 1

    def __init__(self, engine_config):
        self._engine = engine_config
        self._mode = self.DEFAULT_MODE
        self._max_concurrent = self.DEFAULT_MAX_CONCURRENT_CHECKPOINTS

    @property
    def _settings(self) -> CheckpointSettings:
        return self._engine.checkpoint

    def is_checkpointing_enabled(self) -> bool:
        return self._engine.checkpointing

    def get_checkpointing_mode(self) -> CheckpointingMode:
        return self._mode

    def set_checkpointing_mode(self, checkpointing_mode: CheckpointingMode) -> CheckpointConfig:
        if not isinstance(checkpointing_mode, CheckpointingMode):
            raise TypeError(f"expected a CheckpointingMode, got {checkpointing_mode!r}")
        self._mode = checkpointing_mode
        return self

    def get_checkpoint_interval(self) -> int:
        """The interval in ms; -1 when checkpoints are taken only on demand (or not at all)."""
        interval = self._settings.interval_ms
        return -1 if interval is None else interval

    def set_checkpoint_interval(self, checkpoint_interval: int) -> CheckpointConfig:
        """As in Flink, a positive interval also turns checkpointing on."""
        self._settings.interval_ms = _positive_ms("checkpoint_interval", checkpoint_interval)
        self._engine.checkpointing = True
        return self

    def get_checkpoint_timeout(self) -> int:
        return self._settings.timeout_ms

    def set_checkpoint_timeout(self, checkpoint_timeout: int) -> CheckpointConfig:
        self._settings.timeout_ms = _positive_ms("checkpoint_timeout", checkpoint_timeout)
        return self

    def get_min_pause_between_checkpoints(self) -> int:
        return self._settings.min_pause_ms

    def set_min_pause_between_checkpoints(self, min_pause_between_checkpoints: int) -> CheckpointConfig:
        if not _is_int(min_pause_between_checkpoints) or min_pause_between_checkpoints < 0:
            raise ValueError(
                f"min_pause_between_checkpoints must be an int >= 0, got {min_pause_between_checkpoints!r}"
            )
        self._settings.min_pause_ms = min_pause_between_checkpoints
        return self

    def get_max_concurrent_checkpoints(self) -> int:
        return self._max_concurrent

    def set_max_concurrent_checkpoints(self, max_concurrent_checkpoints: int) -> CheckpointConfig:
        """A limit: stretch takes one checkpoint at a time, which is within any limit >= 1."""
        if not _is_int(max_concurrent_checkpoints) or max_concurrent_checkpoints < 1:
            raise ValueError(
                f"max_concurrent_checkpoints must be an int >= 1, got {max_concurrent_checkpoints!r}"
            )
        self._max_concurrent = max_concurrent_checkpoints
        return self

    def get_tolerable_checkpoint_failure_number(self) -> int:
        """-1 when any number is tolerated (stretch's default; see the setter)."""
        tolerable = self._settings.tolerable_failures
        return -1 if tolerable is None else tolerable

    def set_tolerable_checkpoint_failure_number(
        self, tolerable_checkpoint_failure_number: int
    ) -> CheckpointConfig:
        """How many checkpoints in a row may fail before the job fails (with an error naming the
        last failure). Unlike Flink, whose default is 0, stretch by default only counts failed
        checkpoints (see ``stretch status`` and the metrics) and goes on: a job without a recent
        checkpoint loses nothing, it only replays more after a crash."""
        n = tolerable_checkpoint_failure_number
        if not _is_int(n) or n < 0:
            raise ValueError(f"tolerable_checkpoint_failure_number must be an int >= 0, got {n!r}")
        self._settings.tolerable_failures = n
        return self

    def set_externalized_checkpoint_retention(
        self, retention: ExternalizedCheckpointRetention
    ) -> CheckpointConfig:
        if not isinstance(retention, ExternalizedCheckpointRetention):
            raise TypeError(f"expected an ExternalizedCheckpointRetention, got {retention!r}")
        self._settings.delete_on_cancel = (
            retention is not ExternalizedCheckpointRetention.RETAIN_ON_CANCELLATION
        )
        return self

    def get_externalized_checkpoint_retention(self) -> ExternalizedCheckpointRetention:
        if self._settings.delete_on_cancel:
            return ExternalizedCheckpointRetention.DELETE_ON_CANCELLATION
        return ExternalizedCheckpointRetention.RETAIN_ON_CANCELLATION

    def is_externalized_checkpoints_enabled(self) -> bool:
        return not self._settings.delete_on_cancel


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_ms(name: str, value) -> int:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int (milliseconds), got {value!r}")
    return value
