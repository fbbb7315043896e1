"""Elasticity policies: when a keyed operator should run more or fewer instances.

The job's controller measures each keyed operator every interval (how busy its instances were,
how many records they processed, how deep their gate is) and asks the policy for a parallelism.
Two policies ship, and any object with ``decide(load) -> int`` works:

- ``ThresholdPolicy``: STRETCH's (IEEE TPDS 2022) thresholds on the instances' busy fraction:
  above ``high`` add instances, below ``low`` remove some, in both cases aiming at ``target``,
  with hysteresis and a memory of the capacity each parallelism measured.
- ``TrendPolicy``: IBM Streams 4.2's elastic width: while the operator is overloaded, widen it
  and keep the new width only if throughput measurably improved; otherwise go back and stay there
  until the load changes; narrow it one step at a time while it is underloaded.

Between intervals the controller also looks, every tenth of one, at the half interval that just
went by (a sliding window): when the operator was overloaded all through it, a policy's
``react(load)`` may widen it at once instead of waiting for its next intervals. A rescale takes
milliseconds and moves no state, so a scale-up that proves unneeded costs little; scale-downs
still wait for the window.

Both judge smoothed measurements (``LoadHistory``): single intervals are noisy, since busy time
and records are counted when a batch ends, so one interval may hold one batch more or less than
the next.

Enable it with ``env.enable_elasticity(policy, min_parallelism, max_parallelism, ...)``.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OperatorLoad:
    """One interval's measurements of one keyed operator."""

    operator: str
    parallelism: int
    # fraction of the interval each instance spent processing; counted when a batch ends, so an
    # interval in which a long batch begun earlier ended may show a little over 1
    busy: tuple[float, ...]
    throughput: float  # records processed per second over the interval
    backlog: int  # gate entries written but not yet read by the slowest instance
    backlog_growth: int  # change of the backlog over the interval
    min_parallelism: int
    max_parallelism: int
    backlog_capacity: int = 0  # entries the gate holds (0: not known)
    backlog_rising: bool = False  # the backlog grew at each sample of the window, never fell

    @property
    def mean_busy(self) -> float:
        return sum(self.busy) / len(self.busy) if self.busy else 0.0

    @property
    def congested(self) -> bool:
        """This interval alone: the instances were busy more than 90 % of it (the policies judge
        several intervals instead, see ``LoadHistory``)."""
        return self.mean_busy > 0.9

    def clamp(self, parallelism: int) -> int:
        return max(self.min_parallelism, min(self.max_parallelism, parallelism))

    def falling_behind(self, high: float) -> bool:
        """This window alone: the busiest instance above ``high`` while the backlog rose all
        through it, grew to at least half the gate, or grew by a quarter of it: more input than
        the instances take (however large the gate, a backlog that only rises says so)."""
        quarter = max(self.backlog_capacity // 4, 1)
        return max(self.busy, default=0.0) > high and (
            self.backlog_rising
            or self.backlog_growth >= quarter
            or (self.backlog_growth > 0 and self.backlog >= 2 * quarter)
        )


@dataclass
class LoadHistory:
    """What a policy remembers of one operator: the last ``window`` intervals at the current
    parallelism (reset when it changes) and the capacity each parallelism measured.

    - ``busy``: the mean busy fraction over the window; ``throughput``: the median throughput;
      ``mean_throughput``: the mean over up to four windows (steadier, for a baseline).
    - ``overloaded(high)``: the busiest instance's mean busy fraction (``peak_busy``) above
      ``high`` while the backlog did not shrink over the window (busy but catching up, as after
      a start or a rescale, is not overloaded; instances read one shared gate, so the busiest
      one holds the others back when keys are uneven, and a full gate stops growing), or the
      backlog grew in each of the last ``backlog_intervals`` intervals (so by at least that
      many entries): the instances cannot keep up even if their busy fraction says otherwise
      (time spent outside the functions is not counted as busy).
    - capacity of a parallelism: the records per second it would process fully utilized,
      throughput / utilization (busy, or 1.0 while the backlog grows although busy is lower),
      smoothed over the windows measured at that parallelism, and only from windows at least
      half utilized, where it means something (not as a backlog runs dry). A measurement is
      forgotten ``memory`` intervals after it was last updated: the machine's load changes too.
    - ``predicted_busy(q)``: the busy fraction parallelism ``q`` would show under the current
      load: the larger of the linear estimate (utilization x current parallelism / q) and, if
      ``q`` measured a capacity, throughput / that capacity. Scaling is at best linear, so the
      larger is the better estimate; the linear one is the less noisy.
    """

    window: int = 2
    backlog_intervals: int = 3
    memory: int = 300
    parallelism: int = 0
    intervals: int = 0  # observed so far, at every parallelism
    _busy: deque = field(default_factory=deque, repr=False)
    _peak: deque = field(default_factory=deque, repr=False)  # the busiest instance's fraction
    _throughput: deque = field(default_factory=deque, repr=False)
    _long: deque = field(default_factory=deque, repr=False)  # throughput, up to 4 windows
    _growth: deque = field(default_factory=deque, repr=False)
    _growing: int = 0  # consecutive intervals in which the backlog grew
    _capacity: dict = field(default_factory=dict, repr=False)  # parallelism -> (records/s, interval)

    def observe(self, load: OperatorLoad) -> None:
        self.intervals += 1
        if load.parallelism != self.parallelism:
            self.parallelism = load.parallelism
            for d in (self._busy, self._peak, self._throughput, self._growth, self._long):
                d.clear()
        self._long.append(load.throughput)
        if len(self._long) > 4 * self.window:
            self._long.popleft()
        for d, x in (
            (self._busy, load.mean_busy),
            (self._peak, max(load.busy, default=0.0)),
            (self._throughput, load.throughput),
            (self._growth, load.backlog_growth),
        ):
            d.append(x)
            if len(d) > self.window:
                d.popleft()
        self._growing = self._growing + 1 if load.backlog_growth > 0 else 0
        if self.settled and self.utilization >= 0.5:
            now = self.throughput / self.utilization
            before = self.measured(self.parallelism)
            self._capacity[self.parallelism] = (now if before is None else (now + before) / 2, self.intervals)

    @property
    def settled(self) -> bool:
        """A full window at the current parallelism: enough to judge it."""
        return len(self._busy) >= self.window

    @property
    def busy(self) -> float:
        return sum(self._busy) / len(self._busy) if self._busy else 0.0

    @property
    def throughput(self) -> float:
        return statistics.median(self._throughput) if self._throughput else 0.0

    @property
    def mean_throughput(self) -> tuple[float, int]:
        """The mean throughput over up to four windows at the current parallelism, and over how
        many intervals."""
        return (sum(self._long) / len(self._long) if self._long else 0.0), len(self._long)

    @property
    def backlog_overloaded(self) -> bool:
        return self._growing >= self.backlog_intervals

    @property
    def peak_busy(self) -> float:
        return sum(self._peak) / len(self._peak) if self._peak else 0.0

    def overloaded(self, high: float) -> bool:
        return (self.peak_busy > high and sum(self._growth) >= 0) or self.backlog_overloaded

    @property
    def utilization(self) -> float:
        return max(self.busy, 1.0) if self.backlog_overloaded else self.busy

    def measured(self, parallelism: int) -> float | None:
        """The capacity that parallelism measured, if remembered."""
        c = self._capacity.get(parallelism)
        if c is None or self.intervals - c[1] > self.memory:
            return None
        return c[0]

    def predicted_busy(self, parallelism: int) -> float:
        linear = self.utilization * self.parallelism / parallelism
        c = self.measured(parallelism) if parallelism != self.parallelism else None
        return max(linear, self.throughput / c) if c else linear

    def no_better(self, parallelism: int, min_gain: float) -> int | None:
        """The narrowest narrower parallelism that measured a capacity within ``min_gain`` of
        this one's (None if this one measured better than every narrower one, or is unmeasured)."""
        c = self.measured(parallelism)
        if c is None:
            return None
        for narrower in range(1, parallelism):
            m = self.measured(narrower)
            if m is not None and c < m * (1 + min_gain):
                return narrower
        return None

    def ceiling(self, max_parallelism: int, min_gain: float) -> int:
        """The widest parallelism worth using: below the narrowest that measured no better than
        a narrower one."""
        for p in sorted(self._capacity):
            if p <= max_parallelism and self.no_better(p, min_gain) is not None:
                return p - 1
        return max_parallelism


class ElasticityPolicy:
    """Decides an operator's parallelism from its load; subclasses implement ``decide``."""

    def decide(self, load: OperatorLoad) -> int:
        raise NotImplementedError

    def react(self, load: OperatorLoad) -> int | None:
        """An early decision on the interval that just went by, asked between intervals when it
        looks overloaded; None (the default) waits for ``decide``. ``load`` is not a new interval
        of the policy's history (it overlaps the previous one)."""
        return None


@dataclass
class ThresholdPolicy(ElasticityPolicy):
    """STRETCH's thresholds, with hysteresis and a memory of measured capacity.

    Every rule is judged on ``LoadHistory``'s window (no decision before a full window at the
    current parallelism) and its ``predicted_busy`` of another parallelism ``q``; a change is
    made only if the prediction stays inside the band [``low``, ``high``], so that the opposite
    rule does not undo it:

    1. The current parallelism measured no more capacity (by ``min_gain``) than a narrower one:
       go back to that one, loaded or not; it processes as much (on two cores, a third or fourth
       CPU-bound instance adds nothing). Rule 2 then stays below that parallelism until the
       measurement is forgotten (``LoadHistory.memory`` intervals).
    2. Overloaded (``LoadHistory.overloaded``: the busiest instance above ``high``, not
       catching up): the smallest wider ``q`` predicted at most ``target`` busy, but never up to
       a parallelism that measured no better than a narrower one, and only to a ``q`` predicted
       at least ``low`` busy: one that rule 3 would remove again is not added.
    3. Underloaded (mean busy below ``low``, the backlog not growing): the smallest narrower
       ``q`` predicted at most ``target`` busy; none: stay. So an instance is removed only if the
       remaining ones stay well below ``high``, and rule 2 does not add it back.
    4. Otherwise stay.
    """

    high: float = 0.9
    low: float = 0.45
    target: float = 0.7
    min_gain: float = 0.10  # a wider parallelism must measure this much more capacity to be used
    history: LoadHistory = field(default_factory=LoadHistory, repr=False)
    _ceiling: tuple[int, int] | None = field(
        default=None, init=False, repr=False
    )  # (narrowest parallelism that measured no better, interval when it did)

    def react(self, load: OperatorLoad) -> int | None:
        """Falling behind all through the last interval (``OperatorLoad.falling_behind``): the
        fewest instances predicted at most ``target`` busy from this window alone (its busy
        fraction taken as 1: there is more input than it took), below a parallelism that
        measured no better than a narrower one."""
        if not load.falling_behind(self.high):
            return None
        p = load.parallelism
        limit = (
            load.max_parallelism if self._ceiling is None else min(self._ceiling[0] - 1, load.max_parallelism)
        )
        q = next((q for q in range(p + 1, limit + 1) if p / q <= self.target), limit)
        return load.clamp(q) if q > p else None

    def decide(self, load: OperatorLoad) -> int:
        h = self.history
        h.observe(load)
        p = load.parallelism
        if not h.settled:
            return p
        if self._ceiling is not None and h.intervals - self._ceiling[1] > h.memory:
            self._ceiling = None  # measured long ago: the machine may have changed
        narrower = h.no_better(p, self.min_gain)
        if narrower is not None:  # rule 1
            ceiling = p if self._ceiling is None else min(p, self._ceiling[0])
            self._ceiling = (ceiling, h.intervals)
            return load.clamp(narrower)
        limit = (
            load.max_parallelism if self._ceiling is None else min(self._ceiling[0] - 1, load.max_parallelism)
        )
        if h.overloaded(self.high):  # rule 2
            wider = list(range(p + 1, limit + 1))
            if not wider:
                return p
            q = next((q for q in wider if h.predicted_busy(q) <= self.target), wider[-1])
            while q > p and h.predicted_busy(q) < self.low:
                q -= 1
            return load.clamp(q)
        if h.busy < self.low and load.backlog_growth <= 0:  # rule 3
            q = next((q for q in range(load.min_parallelism, p) if h.predicted_busy(q) <= self.target), p)
            return load.clamp(q)
        return p


@dataclass
class TrendPolicy(ElasticityPolicy):
    """IBM Streams 4.2's trend policy: widen only while it measurably pays, back off when not.

    Every rule, judged on ``LoadHistory``'s window (median throughput, mean busy; no decision
    before a full window at the current parallelism):

    1. After a widening: keep it if the throughput rose by ``min_gain``; otherwise go back and
       remember the wider parallelism as a ceiling.
    2. Back at the narrower width, once its throughput settled (the mean over four windows is
       the baseline), the ceiling is forgotten when the window's median stays more than
       ``load_change`` from that baseline for two windows' worth of consecutive intervals: a new
       load level. The noise of single intervals (±40 % on a busy machine: records and busy
       time are counted when batches end) does not reach that.
    3. Overloaded (``LoadHistory.overloaded``: the busiest instance above ``high``, not
       catching up) and one more instance is below the ceiling and predicted at least ``low``
       busy: widen by one.
    4. Underloaded (mean busy below ``low``) and one instance fewer is predicted at most
       ``target`` busy: narrow by one. Otherwise stay.
    """

    min_gain: float = 0.10  # a wider level must improve throughput by this much to be kept
    high: float = 0.9
    low: float = 0.45  # below this mean busy fraction the operator is narrowed one step
    target: float = 0.7  # ... if the remaining instances would be busy at most this much
    load_change: float = 0.5  # relative change of the smoothed throughput that counts as a new load
    history: LoadHistory = field(default_factory=LoadHistory, repr=False)
    _trial: tuple[int, float] | None = field(
        default=None, init=False, repr=False
    )  # (previous width, its throughput)
    _ceiling: int | None = field(default=None, init=False, repr=False)  # width that did not pay
    _baseline: float | None = field(default=None, init=False, repr=False)
    _changed: int = field(default=0, init=False, repr=False)  # consecutive intervals off the baseline

    def decide(self, load: OperatorLoad) -> int:
        h = self.history
        h.observe(load)
        p = load.parallelism
        if not h.settled:
            return p
        throughput = h.throughput
        if self._trial is not None:  # rule 1: judge the last widening
            previous, before = self._trial
            self._trial = None
            if p > previous and throughput < before * (1 + self.min_gain):
                self._ceiling, self._baseline, self._changed = p, None, 0
                return load.clamp(previous)
        if self._ceiling is not None:  # rule 2
            mean, n = h.mean_throughput
            if self._baseline is None:
                if n >= 4 * h.window:
                    self._baseline = mean
            elif abs(throughput - self._baseline) > self.load_change * self._baseline:
                self._changed += 1
                if self._changed >= 2 * h.window:  # the load changed: widening may pay again
                    self._ceiling = self._baseline = None
            else:
                self._changed = 0
        overloaded = h.overloaded(self.high)
        if (
            overloaded
            and (self._ceiling is None or p + 1 < self._ceiling)
            and load.clamp(p + 1) > p
            and h.predicted_busy(p + 1) >= self.low
        ):  # rule 3
            self._trial = (p, throughput)
            return p + 1
        if (
            not overloaded
            and h.busy < self.low
            and p > load.min_parallelism
            and h.predicted_busy(p - 1) <= self.target
        ):  # rule 4
            return load.clamp(p - 1)
        return p
