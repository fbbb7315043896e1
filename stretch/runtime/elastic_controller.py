"""The elasticity controller: measures keyed operators each interval and rescales them live; between
intervals it watches the last half interval (a sliding window) for an operator falling behind."""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from stretch.elasticity import ElasticityPolicy, OperatorLoad, ThresholdPolicy
from stretch.runtime import control_block as cbk


@dataclass
class ElasticityConfig:
    """What ``env.enable_elasticity`` asked for."""

    policy: ElasticityPolicy = field(default_factory=ThresholdPolicy)
    min_parallelism: int = 1
    max_parallelism: int = 8
    interval_ms: int = 1000
    cooldown_ms: int = 3000
    operators: list[str] | None = None  # None: every keyed operator


class ElasticController(threading.Thread):
    """One thread in the job's process; each operator gets its own copy of the policy."""

    def __init__(self, coordinator, config: ElasticityConfig):
        super().__init__(name="stretch-elasticity", daemon=True)
        self.coordinator = coordinator
        self.config = config
        self.stop = threading.Event()
        stages = [s for s in coordinator.plan.stages if s.kind == "keyed"]
        if config.operators is not None:
            stages = [s for s in stages if s.name in config.operators]
        self.stages = stages
        self.policies = {s.id: copy.deepcopy(config.policy) for s in stages}
        self.decisions: list[dict] = []

    def _snapshot(self, stage) -> tuple[float, int, list[int], int]:
        c = self.coordinator
        op = c.resources.keyed_index[stage.id]
        p = c.parallelism_of(stage.id)
        inst = c.control.instances(op)[:p]
        return (
            time.monotonic(),
            p,
            [int(x) for x in inst[:, cbk.I_BUSY_NS]] + [int(inst[:, cbk.I_RECORDS_IN].sum())],
            c.gates[stage.input_gate].depth(),
        )

    def _load(self, stage, before, now, rising: bool = False) -> OperatorLoad:
        """The operator's measurements between two snapshots (of one parallelism); ``rising``:
        the backlog rose at each snapshot between them."""
        dt = now[0] - before[0]
        # not clamped at 1: busy time is counted when a batch ends, so an interval may hold
        # a little of the previous one's, which the next interval then lacks
        busy = tuple(max((a - b) / (dt * 1e9), 0.0) for a, b in zip(now[2][:-1], before[2][:-1]))
        return OperatorLoad(
            operator=stage.name,
            parallelism=now[1],
            busy=busy,
            throughput=(now[2][-1] - before[2][-1]) / dt,
            backlog=now[3],
            backlog_growth=now[3] - before[3],
            min_parallelism=self.config.min_parallelism,
            max_parallelism=min(self.config.max_parallelism, stage.max_parallelism),
            backlog_capacity=self.coordinator.gates[stage.input_gate].slot_capacity,
            backlog_rising=rising,
        )

    def run(self) -> None:
        """Every interval, the policy decides on the interval's load; every tenth of one between,
        it may react to the half interval that just went by (a sliding window) if it was
        overloaded. Half an interval is enough to tell: a backlog that rose at each of its five
        samples, with the instances busy, is no noise of batches ending."""
        interval = self.config.interval_ms / 1000
        tick = min(max(interval / 10, 0.01), 0.1)
        span = interval / 2  # the sliding window's
        last = {s.id: self._snapshot(s) for s in self.stages}  # where the current interval began
        recent = {s.id: deque([last[s.id]]) for s in self.stages}  # the last interval's snapshots
        quiet_until = {s.id: 0.0 for s in self.stages}
        while not self.stop.wait(tick):
            if self.coordinator.done:
                return
            for stage in self.stages:
                now = self._snapshot(stage)
                window = recent[stage.id]
                window.append(now)
                while len(window) > 2 and now[0] - window[1][0] >= span:
                    window.popleft()
                quiet = now[0] < quiet_until[stage.id]
                if now[0] - last[stage.id][0] >= interval:
                    before, last[stage.id] = last[stage.id], now
                    if quiet or now[1] != before[1]:
                        continue  # cooling down, or a rescale happened inside the interval
                    policy, load = self.policies[stage.id], self._load(stage, before, now)
                    target, early = load.clamp(int(policy.decide(load))), False
                elif not quiet and now[0] - window[0][0] >= span and all(s[1] == now[1] for s in window):
                    depths = [s[3] for s in window]
                    rising = all(b > a for a, b in itertools.pairwise(depths))
                    load = self._load(stage, window[0], now, rising)
                    target = self.policies[stage.id].react(load)
                    if target is None:
                        continue
                    target, early = load.clamp(int(target)), True
                else:
                    continue
                if target == load.parallelism:
                    continue
                decided = time.monotonic()
                try:
                    report = self.coordinator.rescale(stage.name, target)
                except (RuntimeError, ValueError):
                    return  # the job is ending
                # early: on a sliding window between two intervals (ElasticityPolicy.react)
                self.decisions.append({"load": load, "report": report, "at": decided, "early": early})
                quiet_until[stage.id] = time.monotonic() + self.config.cooldown_ms / 1000
                last[stage.id] = self._snapshot(stage)
                recent[stage.id] = deque([last[stage.id]])
