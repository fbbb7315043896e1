"""Elasticity policies: when a keyed operator should run more or fewer instances.

The job's controller measures each keyed operator every interval (how busy its instances were,
how many records they processed, how deep their gate is) and asks the policy for a parallelism.
Two policies ship, and any object with ``decide(load) -> int`` works:

- ``ThresholdPolicy``: STRETCH's (IEEE TPDS 2022) thresholds on the instances' busy fraction:
  above ``high`` add instances, below ``low`` remove some, in both cases aiming at ``target``.
- ``TrendPolicy``: IBM Streams 4.2's elastic width: while the operator is congested, widen it and
  keep the new width only if throughput measurably improved; otherwise go back and stay there
  until the load changes; narrow it one step at a time while it is not congested.

Enable it with ``env.enable_elasticity(policy, min_parallelism, max_parallelism, ...)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OperatorLoad:
    """One interval's measurements of one keyed operator."""

    operator: str
    parallelism: int
    busy: tuple[float, ...]  # fraction of the interval each instance spent processing (0..1)
    throughput: float  # records processed per second over the interval
    backlog: int  # gate entries written but not yet read by the slowest instance
    backlog_growth: int  # change of the backlog over the interval
    min_parallelism: int
    max_parallelism: int

    @property
    def mean_busy(self) -> float:
        return sum(self.busy) / len(self.busy) if self.busy else 0.0

    @property
    def congested(self) -> bool:
        """The operator cannot keep up: its instances are saturated or its input queue grows."""
        return self.mean_busy > 0.9 or (self.backlog_growth > 0 and self.mean_busy > 0.7)

    def clamp(self, parallelism: int) -> int:
        return max(self.min_parallelism, min(self.max_parallelism, parallelism))


class ElasticityPolicy:
    """Decides an operator's parallelism from its load; subclasses implement ``decide``."""

    def decide(self, load: OperatorLoad) -> int:
        raise NotImplementedError


@dataclass
class ThresholdPolicy(ElasticityPolicy):
    """STRETCH's thresholds: scale so the mean busy fraction returns to ``target``."""

    high: float = 0.9
    low: float = 0.45
    target: float = 0.7

    def decide(self, load: OperatorLoad) -> int:
        p, busy = load.parallelism, load.mean_busy
        needed = math.ceil(p * busy / self.target - 1e-9)
        if busy > self.high or load.congested:
            return load.clamp(max(needed, p + 1))
        if busy < self.low:
            return load.clamp(min(max(needed, 1), p - 1))
        return p


@dataclass
class TrendPolicy(ElasticityPolicy):
    """IBM Streams 4.2's trend policy: widen only while it measurably pays, back off when not."""

    min_gain: float = 0.10  # a wider level must improve throughput by this much to be kept
    low: float = 0.45  # below this mean busy fraction the operator is narrowed one step
    load_change: float = 0.25  # relative throughput change that counts as a new load level
    _trial: tuple[int, float] | None = field(
        default=None, init=False, repr=False
    )  # (previous width, its throughput)
    _ceiling: int | None = field(default=None, init=False, repr=False)  # width that did not pay
    _baseline: float | None = field(default=None, init=False, repr=False)

    def decide(self, load: OperatorLoad) -> int:
        p = load.parallelism
        if self._trial is not None:  # judge the last widening
            previous, before = self._trial
            self._trial = None
            if load.throughput < before * (1 + self.min_gain):
                self._ceiling = p
                self._baseline = before
                return load.clamp(previous)
        changed = self._baseline and abs(load.throughput - self._baseline) > self.load_change * self._baseline
        if self._ceiling is not None and changed:
            self._ceiling = None  # the load changed: widening may pay again
        if load.congested and (self._ceiling is None or p + 1 < self._ceiling):
            self._trial = (p, load.throughput)
            return load.clamp(p + 1)
        if not load.congested and load.mean_busy < self.low:
            return load.clamp(p - 1)
        return p
