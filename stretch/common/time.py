"""``Time``, ``Duration`` and ``Instant`` as in PyFlink (``pyflink.common.time``).

PyFlink's ``Duration`` wraps ``java.time.Duration``; here it is a plain value of whole
nanoseconds with the same factory methods and Java's conversions (``to_millis`` floors, as
``Duration.toMillis`` does). ``Time`` is the older millisecond interval used by window
assigners; both have ``to_milliseconds()`` so window code can take either.
"""

from __future__ import annotations

import datetime
import functools
import numbers
from typing import Any

__all__ = ["Duration", "Instant", "Time"]

_NANOS_PER_MILLI = 1_000_000
_NANOS_PER_SECOND = 1_000_000_000
_SECONDS_PER_UNIT = {"days": 86_400, "hours": 3_600, "minutes": 60, "seconds": 1}


def _whole(value: Any, scale: int, what: str) -> int:
    """``value * scale`` as an int; floats are accepted if the result is whole."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value) * scale
    value = float(value)
    scaled = round(value * scale)
    if abs(scaled - value * scale) > 1e-6 * max(1.0, abs(value * scale)):
        raise ValueError(f"{what}={value!r} is not a whole number of the smallest unit")
    return scaled


@functools.total_ordering
class Time:
    """A time interval in milliseconds (PyFlink: ``pyflink.common.time.Time``)."""

    __slots__ = ("_milliseconds",)

    def __init__(self, milliseconds: int):
        self._milliseconds = _whole(milliseconds, 1, "milliseconds")

    def to_milliseconds(self) -> int:
        return self._milliseconds

    @staticmethod
    def milliseconds(milliseconds: int) -> Time:
        return Time(milliseconds)

    @staticmethod
    def seconds(seconds: int) -> Time:
        return Time(_whole(seconds, 1000, "seconds"))

    @staticmethod
    def minutes(minutes: int) -> Time:
        return Time(_whole(minutes, 60_000, "minutes"))

    @staticmethod
    def hours(hours: int) -> Time:
        return Time(_whole(hours, 3_600_000, "hours"))

    @staticmethod
    def days(days: int) -> Time:
        return Time(_whole(days, 86_400_000, "days"))

    def to_duration(self) -> Duration:
        return Duration.of_millis(self._milliseconds)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Time) and self._milliseconds == other._milliseconds

    def __lt__(self, other: Time) -> bool:
        if not isinstance(other, Time):
            return NotImplemented
        return self._milliseconds < other._milliseconds

    def __hash__(self) -> int:
        return hash(("Time", self._milliseconds))

    def __repr__(self) -> str:
        return f"Time.milliseconds({self._milliseconds})"

    def __str__(self) -> str:
        return f"{self._milliseconds} ms"


@functools.total_ordering
class Duration:
    """An amount of time such as '34.5 seconds', held as whole nanoseconds
    (PyFlink: ``pyflink.common.time.Duration``, Java: ``java.time.Duration``)."""

    __slots__ = ("_nanos",)

    def __init__(self, nanos: int = 0):
        self._nanos = _whole(nanos, 1, "nanos")

    @staticmethod
    def of_days(days: int) -> Duration:
        return Duration(_whole(days, 86_400 * _NANOS_PER_SECOND, "days"))

    @staticmethod
    def of_hours(hours: int) -> Duration:
        return Duration(_whole(hours, 3_600 * _NANOS_PER_SECOND, "hours"))

    @staticmethod
    def of_minutes(minutes: int) -> Duration:
        return Duration(_whole(minutes, 60 * _NANOS_PER_SECOND, "minutes"))

    @staticmethod
    def of_seconds(seconds: int) -> Duration:
        return Duration(_whole(seconds, _NANOS_PER_SECOND, "seconds"))

    @staticmethod
    def of_millis(millis: int) -> Duration:
        return Duration(_whole(millis, _NANOS_PER_MILLI, "millis"))

    @staticmethod
    def of_nanos(nanos: int) -> Duration:
        return Duration(nanos)

    @staticmethod
    def from_timedelta(delta: datetime.timedelta) -> Duration:
        micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
        return Duration(micros * 1000)

    # Java's accessors: seconds is the floor, nano in [0, 1e9).
    def get_seconds(self) -> int:
        return self._nanos // _NANOS_PER_SECOND

    def get_nano(self) -> int:
        return self._nanos % _NANOS_PER_SECOND

    def to_nanos(self) -> int:
        return self._nanos

    def to_millis(self) -> int:
        return self._nanos // _NANOS_PER_MILLI

    def to_milliseconds(self) -> int:
        """Same as :meth:`to_millis`; lets window code treat ``Time`` and ``Duration`` alike."""
        return self._nanos // _NANOS_PER_MILLI

    def _to_unit(self, unit: str) -> int:
        # Java: toSeconds() is getSeconds(); toMinutes()/toHours()/toDays() divide the seconds
        # truncating toward zero.
        seconds = self.get_seconds()
        per = _SECONDS_PER_UNIT[unit]
        return seconds // per if seconds >= 0 else -((-seconds) // per)

    def to_seconds(self) -> int:
        return self.get_seconds()

    def to_minutes(self) -> int:
        return self._to_unit("minutes")

    def to_hours(self) -> int:
        return self._to_unit("hours")

    def to_days(self) -> int:
        return self._to_unit("days")

    def to_timedelta(self) -> datetime.timedelta:
        return datetime.timedelta(microseconds=self._nanos // 1000)

    def is_zero(self) -> bool:
        return self._nanos == 0

    def is_negative(self) -> bool:
        return self._nanos < 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Duration) and self._nanos == other._nanos

    def __lt__(self, other: Duration) -> bool:
        if not isinstance(other, Duration):
            return NotImplemented
        return self._nanos < other._nanos

    def __hash__(self) -> int:
        return hash(("Duration", self._nanos))

    def __repr__(self) -> str:
        n = self._nanos
        for name, per in (
            ("of_days", 86_400 * _NANOS_PER_SECOND),
            ("of_hours", 3_600 * _NANOS_PER_SECOND),
            ("of_minutes", 60 * _NANOS_PER_SECOND),
            ("of_seconds", _NANOS_PER_SECOND),
            ("of_millis", _NANOS_PER_MILLI),
        ):
            if n % per == 0 and n != 0:
                return f"Duration.{name}({n // per})"
        return f"Duration.of_nanos({n})"


class Instant:
    """A point on the time line: seconds since the epoch and nanoseconds in [0, 1e9)
    (PyFlink: ``pyflink.common.time.Instant``). Values of ``Types.INSTANT()``."""

    __slots__ = ("nanos", "seconds")

    def __init__(self, seconds: int, nanos: int):
        self.seconds = seconds
        self.nanos = nanos

    def to_epoch_milli(self) -> int:
        return self.seconds * 1000 + self.nanos // _NANOS_PER_MILLI

    def to_epoch_micro(self) -> int:
        return self.seconds * 1_000_000 + self.nanos // 1000

    @staticmethod
    def of_epoch_milli(epoch_milli: int) -> Instant:
        secs, millis = divmod(epoch_milli, 1000)
        return Instant(secs, millis * _NANOS_PER_MILLI)

    @staticmethod
    def of_epoch_micro(epoch_micro: int) -> Instant:
        secs, micros = divmod(epoch_micro, 1_000_000)
        return Instant(secs, micros * 1000)

    @staticmethod
    def of_datetime(dt: datetime.datetime) -> Instant:
        """An aware datetime's instant (a naive one is taken as UTC)."""
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=datetime.timezone.utc)
        delta = dt - _EPOCH
        micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
        return Instant.of_epoch_micro(micros)

    def to_datetime(self) -> datetime.datetime:
        """The instant as an aware UTC datetime (microsecond precision)."""
        return _EPOCH + datetime.timedelta(microseconds=self.to_epoch_micro())

    def __eq__(self, other: object) -> bool:
        return (
            self.__class__ == other.__class__
            and self.seconds == other.seconds  # type: ignore[attr-defined]
            and self.nanos == other.nanos  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        return hash(("Instant", self.seconds, self.nanos))

    def __reduce__(self):
        return Instant, (self.seconds, self.nanos)

    def __repr__(self) -> str:
        return f"Instant<{self.seconds}, {self.nanos}>"


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
