"""User-defined metrics (PyFlink's ``pyflink.metrics``): what ``RuntimeContext.get_metrics_group()``
gives a function.

They count within the instance, where the function can read them (``get_count()``); every second
the instance's worker reports them to the job, whose metrics endpoint (``enable_metrics``,
``stretch metrics``) exports them as Flink's Prometheus reporter does: a group's name becomes part of
the metric's name, a key/value group (``add_group(key, value)``) a label.
"""

from __future__ import annotations

from collections.abc import Callable


class Counter:
    """A count that goes up and down."""

    def __init__(self):
        self._count = 0

    def inc(self, n: int = 1) -> None:
        self._count += n

    def dec(self, n: int = 1) -> None:
        self._count -= n

    def get_count(self) -> int:
        return self._count


class Meter:
    """Events and how many there were; ``time_span_in_seconds`` is the span a rate would cover."""

    def __init__(self, time_span_in_seconds: int = 60):
        self.time_span_in_seconds = time_span_in_seconds
        self._count = 0

    def mark_event(self, value: int = 1) -> None:
        self._count += value

    def get_count(self) -> int:
        return self._count


class Distribution:
    """Values whose count, sum, minimum and maximum are kept."""

    def __init__(self):
        self.count, self.sum, self.min, self.max = 0, 0, None, None

    def update(self, value: int) -> None:
        self.count += 1
        self.sum += value
        self.min = value if self.min is None else min(self.min, value)
        self.max = value if self.max is None else max(self.max, value)


class MetricGroup:
    """A named group of metrics; asking twice for one name gives the same metric."""

    def __init__(self, name: str = "", value: str | None = None):
        self.name = name
        self.value = value  # a key/value group's value (its name is the key)
        self._groups: dict[tuple, MetricGroup] = {}
        self._metrics: dict[str, object] = {}

    def add_group(self, name: str, extra: str | None = None) -> MetricGroup:
        """A subgroup; with ``extra``, a key/value group (``name`` the key, ``extra`` the value)."""
        return self._groups.setdefault((name, extra), MetricGroup(name, extra))

    def _metric(self, name: str, make):
        if name not in self._metrics:
            self._metrics[name] = make()
        return self._metrics[name]

    def counter(self, name: str) -> Counter:
        return self._metric(name, Counter)

    def gauge(self, name: str, obj: Callable[[], int]) -> Callable[[], int]:
        self._metrics[name] = obj
        return obj

    def meter(self, name: str, time_span_in_seconds: int = 60) -> Meter:
        return self._metric(name, lambda: Meter(time_span_in_seconds))

    def distribution(self, name: str) -> Distribution:
        return self._metric(name, Distribution)
