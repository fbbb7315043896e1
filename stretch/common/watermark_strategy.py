"""``WatermarkStrategy`` and ``TimestampAssigner`` (PyFlink: ``pyflink.common.watermark_strategy``).

Plain data holders; the engine reads them when it builds a source's watermark generator:
``kind`` (``"monotonous"``, ``"bounded"`` or ``"none"``), ``max_out_of_orderness``,
``timestamp_assigner``, ``idle_timeout`` and ``alignment``.

As in PyFlink, :meth:`WatermarkStrategy.with_timestamp_assigner` sets the assigner on the strategy
itself and returns it, while ``with_idleness`` and ``with_watermark_alignment`` return a new
strategy. Unlike PyFlink (whose new strategy wraps a fresh Java object and so drops a timestamp
assigner set earlier), the new strategy keeps the assigner.
"""

from __future__ import annotations

import abc
import copy
from typing import Any

from stretch.common.time import Duration

__all__ = ["TimestampAssigner", "WatermarkStrategy"]


class TimestampAssigner(abc.ABC):
    """Extracts event timestamps (epoch milliseconds) from records."""

    @abc.abstractmethod
    def extract_timestamp(self, value: Any, record_timestamp: int) -> int:
        """The event timestamp of ``value`` in epoch milliseconds; ``record_timestamp`` is the
        timestamp the record already has (negative if it has none)."""


def _require_duration(value: Any, what: str) -> Duration:
    if not isinstance(value, Duration):
        raise TypeError(f"{what} must be a Duration, got {type(value).__name__} {value!r}")
    if value.is_negative():
        raise ValueError(f"{what} must not be negative, got {value!r}")
    return value


class WatermarkStrategy:
    """How a source derives event timestamps and watermarks. Build one with the static factories.

    * ``for_monotonous_timestamps()``: watermark = max timestamp seen - 1 ms;
    * ``for_bounded_out_of_orderness(d)``: watermark = max timestamp seen - d - 1 ms;
    * ``no_watermarks()``: no watermarks (event time never advances).
    """

    def __init__(self, kind: str, max_out_of_orderness: Duration | None = None):
        if kind not in ("monotonous", "bounded", "none"):
            raise ValueError(f"unknown watermark strategy kind {kind!r}")
        self.kind = kind
        self.max_out_of_orderness = max_out_of_orderness
        self._timestamp_assigner: TimestampAssigner | None = None
        self.idle_timeout: Duration | None = None
        self.alignment: tuple[str, Duration, Duration | None] | None = None

    @property
    def timestamp_assigner(self) -> TimestampAssigner | None:
        return self._timestamp_assigner

    @staticmethod
    def for_monotonous_timestamps() -> WatermarkStrategy:
        return WatermarkStrategy("monotonous", Duration.of_millis(0))

    @staticmethod
    def for_bounded_out_of_orderness(max_out_of_orderness: Duration) -> WatermarkStrategy:
        return WatermarkStrategy("bounded", _require_duration(max_out_of_orderness, "max_out_of_orderness"))

    @staticmethod
    def no_watermarks() -> WatermarkStrategy:
        return WatermarkStrategy("none")

    def with_timestamp_assigner(self, timestamp_assigner: TimestampAssigner) -> WatermarkStrategy:
        """Read event timestamps with ``timestamp_assigner`` (anything with
        ``extract_timestamp(value, record_timestamp)``, or, beyond PyFlink, the name of a field that
        holds them). Sets it on this strategy and returns it."""
        if not isinstance(timestamp_assigner, str) and not callable(
            getattr(timestamp_assigner, "extract_timestamp", None)
        ):
            raise TypeError(
                "timestamp_assigner must have extract_timestamp(value, record_timestamp), "
                f"got {timestamp_assigner!r}"
            )
        self._timestamp_assigner = timestamp_assigner
        return self

    def with_idleness(self, idle_timeout: Duration) -> WatermarkStrategy:
        """A new strategy that marks an input idle after ``idle_timeout`` without records."""
        new = copy.copy(self)
        new.idle_timeout = _require_duration(idle_timeout, "idle_timeout")
        return new

    def with_watermark_alignment(
        self,
        watermark_group: str,
        max_allowed_watermark_drift: Duration,
        update_interval: Duration | None = None,
    ) -> WatermarkStrategy:
        """A new strategy with watermark alignment recorded (nothing to align on one node)."""
        new = copy.copy(self)
        new.alignment = (
            watermark_group,
            _require_duration(max_allowed_watermark_drift, "max_allowed_watermark_drift"),
            update_interval,
        )
        return new

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WatermarkStrategy) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((self.kind, self.max_out_of_orderness, self.idle_timeout))

    def __repr__(self) -> str:
        parts = [self.kind]
        if self.kind == "bounded":
            parts.append(f"max_out_of_orderness={self.max_out_of_orderness!r}")
        if self._timestamp_assigner is not None:
            parts.append(f"timestamp_assigner={self._timestamp_assigner!r}")
        if self.idle_timeout is not None:
            parts.append(f"idle_timeout={self.idle_timeout!r}")
        return f"WatermarkStrategy({', '.join(parts)})"
