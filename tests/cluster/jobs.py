"""The jobs the cluster tests run, and their plain-Python references: a running count and sum per
key (or per team, a key a selector function computes); limits per group of keys broadcast to
keyed events; steps that pace or hold a source."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path

from stretch.common import Types
from stretch.datastream import (
    BroadcastProcessFunction,
    KeyedBroadcastProcessFunction,
    KeyedProcessFunction,
    ProcessWindowFunction,
    StreamExecutionEnvironment,
)
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.state import MapStateDescriptor, ValueStateDescriptor

PAIR = Types.TUPLE([Types.STRING(), Types.LONG()])


class CountSum(KeyedProcessFunction):
    """A running count and sum per key; ``cost_us`` of work per record makes a node fall behind
    its writers (a backlog in its keyed gate)."""

    def __init__(self, cost_us: float = 0.0):
        self.cost_us = cost_us

    def open(self, runtime_context):
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.sum = runtime_context.get_state(ValueStateDescriptor("sum", Types.LONG()))

    def process_element(self, value, ctx):
        if self.cost_us:
            until = time.perf_counter() + self.cost_us / 1e6
            while time.perf_counter() < until:
                pass
        key, n = value
        c = (self.count.value() or 0) + 1
        s = (self.sum.value() or 0) + n
        self.count.update(c)
        self.sum.update(s)
        yield key, c, s


def count_sum_job(
    max_parallelism: int = 128, parallelism: int = 2, cost_us: float = 0.0
) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.set_max_parallelism(max_parallelism)
    (
        env.from_source(ChannelSource("in", PAIR, durable=False), None, "in")
        .key_by(0)
        .process(CountSum(cost_us), Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG()]))
        .name("counts")
        .sink_to(ChannelSink("out"))
    )
    return env


class Flush(KeyedProcessFunction):
    """Counts a key's records, and moves the count into ``flushed`` 20 ms after the first record
    since the last flush (a processing-time timer): once every timer fired, flushed == count."""

    def open(self, runtime_context):
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.pending = runtime_context.get_state(ValueStateDescriptor("pending", Types.LONG()))
        self.flushed = runtime_context.get_state(ValueStateDescriptor("flushed", Types.LONG()))

    def process_element(self, value, ctx):
        self.count.update((self.count.value() or 0) + 1)
        pending = self.pending.value() or 0
        if not pending:
            service = ctx.timer_service()
            service.register_processing_time_timer(service.current_processing_time() + 20)
        self.pending.update(pending + 1)
        return iter(())

    def on_timer(self, timestamp, ctx):
        self.flushed.update((self.flushed.value() or 0) + (self.pending.value() or 0))
        self.pending.update(0)
        return iter(())


def flush_job() -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.set_max_parallelism(16)
    (
        env.from_source(ChannelSource("in", PAIR, durable=False), None, "in")
        .key_by(0)
        .process(Flush())
        .name("flush")
        .sink_to(DiscardingSink())
    )
    return env


class FailsOn13(KeyedProcessFunction):
    """Passes records on, and raises on the value 13 (a bug in user code)."""

    def process_element(self, value, ctx):
        if value[1] == 13:
            raise ValueError("thirteen")
        yield value


def failing_job() -> StreamExecutionEnvironment:
    """A job whose function raises on the value 13: a job that fails on one node."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_max_parallelism(128)
    (
        env.from_source(ChannelSource("in", PAIR, durable=False), None, "in")
        .key_by(0)
        .process(FailsOn13(), PAIR)
        .sink_to(ChannelSink("out"))
    )
    return env


def reference(records) -> dict[str, tuple[int, int]]:
    count, total = defaultdict(int), defaultdict(int)
    for key, n in records:
        count[key] += 1
        total[key] += n
    return {k: (count[k], total[k]) for k in count}


# ---- broadcast state: rules (a limit per group of keys) broadcast to keyed events -----------------
RULE = Types.TUPLE([Types.STRING(), Types.LONG()])  # (group, limit)
ALERT = Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG(), Types.LONG()])
LIMITS = MapStateDescriptor("limits", Types.STRING(), Types.LONG())


def group_of(key: str) -> str:
    return f"g{int(key.rsplit('-', 1)[1]) % 4}"


class Threshold(KeyedBroadcastProcessFunction):
    """Each event reports the limit of its key's group in force and how many of the key's events
    went over their limit so far (keyed state); each rule reports itself, from the instance
    that applies it (once per node)."""

    def open(self, runtime_context):
        self.over = runtime_context.get_state(ValueStateDescriptor("over", Types.LONG()))

    def process_element(self, value, ctx):
        key, n = value
        limit = ctx.get_broadcast_state(LIMITS).get(group_of(key))
        over = (self.over.value() or 0) + (limit is not None and n > limit)
        self.over.update(over)
        yield key, n, -1 if limit is None else limit, over

    def process_broadcast_element(self, value, ctx):
        group, limit = value
        ctx.get_broadcast_state(LIMITS).put(group, limit)
        yield f"rule:{group}", limit, -1, -1


def threshold_job(max_parallelism: int = 128, parallelism: int = 2) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.set_max_parallelism(max_parallelism)
    rules = env.from_source(ChannelSource("rules", RULE, durable=False), None, "rules").broadcast(LIMITS)
    (
        env.from_source(ChannelSource("events", PAIR, durable=False), None, "events")
        .key_by(0)
        .connect(rules)
        .process(Threshold(), ALERT)
        .name("threshold")
        .sink_to(ChannelSink("out"))
    )
    return env


class ThresholdModel:
    """The reference: rules and events applied in the order the test makes the job see them."""

    def __init__(self):
        self.limits: dict[str, int] = {}
        self.over: dict[str, int] = defaultdict(int)
        self.alerts: list[tuple] = []

    def rules(self, rules) -> None:
        self.limits.update(rules)

    def events(self, events) -> None:
        for key, n in events:
            limit = self.limits.get(group_of(key))
            self.over[key] += limit is not None and n > limit
            self.alerts.append((key, n, -1 if limit is None else limit, self.over[key]))


class Limit(BroadcastProcessFunction):
    """Not keyed: each event reports the limit of its key's group in force and whether it went
    over it; each rule reports itself, from the instance that applies it (once per node)."""

    def process_element(self, value, ctx):
        key, n = value
        limit = ctx.get_broadcast_state(LIMITS).get(group_of(key))
        yield key, n, -1 if limit is None else limit, int(limit is not None and n > limit)

    def process_broadcast_element(self, value, ctx):
        group, limit = value
        ctx.get_broadcast_state(LIMITS).put(group, limit)
        yield f"rule:{group}", limit, -1, -1


def limit_job() -> StreamExecutionEnvironment:
    """Events not keyed, connected to broadcast rules: on a cluster any node takes any event."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.set_max_parallelism(128)
    rules = env.from_source(ChannelSource("rules", RULE, durable=False), None, "rules").broadcast(LIMITS)
    (
        env.from_source(ChannelSource("events", PAIR, durable=False), None, "events")
        .connect(rules)
        .process(Limit(), ALERT)
        .name("limit")
        .sink_to(ChannelSink("out"))
    )
    return env


def limit_model(limits: dict[str, int], events) -> list[tuple]:
    """The reference of ``Limit``: each event against the limits in force when it comes."""
    out = []
    for key, n in events:
        limit = limits.get(group_of(key))
        out.append((key, n, -1 if limit is None else limit, int(limit is not None and n > limit)))
    return out


class Accumulate(KeyedBroadcastProcessFunction):
    """Rules add to their group's total (applied twice or missed, a total shows it); each event
    reports its group's total."""

    def process_element(self, value, ctx):
        key, n = value
        yield key, n, ctx.get_broadcast_state(LIMITS).get(group_of(key)) or 0, -1

    def process_broadcast_element(self, value, ctx):
        group, delta = value
        totals = ctx.get_broadcast_state(LIMITS)
        totals.put(group, (totals.get(group) or 0) + delta)
        yield f"rule:{group}", delta, -1, -1


def accumulate_job() -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.set_max_parallelism(128)
    rules = env.from_source(ChannelSource("rules", RULE, durable=False), None, "rules").broadcast(LIMITS)
    (
        env.from_source(ChannelSource("events", PAIR, durable=False), None, "events")
        .key_by(0)
        .connect(rules)
        .process(Accumulate(), ALERT)
        .sink_to(ChannelSink("out"))
    )
    return env


# ---- sources read at a pace, or held where a test wants a node change to come -----------------
class Paced:
    """A pair, unchanged, after a pause at every ``every``-th record: the source's reader goes at
    a pace that node changes overlap (it runs where the source is read: the driver or a node)."""

    def __init__(self, every: int, pause: float):
        self.every, self.pause, self.seen = every, pause, 0

    def __call__(self, record):
        self.seen += 1
        if self.seen % self.every == 0:
            time.sleep(self.pause)
        return record


class Held(Paced):
    """Paced, and at the ``holds``' record counts it waits until ``go(hold)`` says so: the reader
    stops there until the test has begun a node change, so the change comes mid-source."""

    def __init__(self, every: int, pause: float, holds: list[int]):
        super().__init__(every, pause)
        self.holds = holds
        self.waiting: int | None = None

    def go(self, hold: int) -> bool:
        raise NotImplementedError

    def __call__(self, record):
        if self.seen + 1 in self.holds:
            self.waiting = self.holds.index(self.seen + 1)
            while not self.go(self.waiting):
                time.sleep(0.01)
            self.waiting = None
        return super().__call__(record)


class HeldByEvents(Held):
    """Held in the driver's process (a collection's reader): ``events[i]`` lets hold ``i`` pass."""

    def __init__(self, every: int, pause: float, holds: list[int]):
        super().__init__(every, pause, holds)
        self.events = [threading.Event() for _ in holds]

    def go(self, hold: int) -> bool:
        return self.events[hold].is_set()


class HeldByFiles(Held):
    """Held in the nodes' processes (their readers of files): file ``go-<i>`` lets hold ``i`` pass."""

    def __init__(self, every: int, pause: float, holds: list[int], directory: Path):
        super().__init__(every, pause, holds)
        self.directory = directory

    def go(self, hold: int) -> bool:
        return (self.directory / f"go-{hold}").exists()


def parse(line: str) -> tuple[str, int]:
    key, value = line.split(",")
    return key, int(value)


# ---- a key selector function: users in teams of ten --------------------------------------------
TEAM = Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG()])


def team_of(record) -> str:
    """users 0..299 in teams of ten: the key is not a field of the record."""
    return f"team-{int(record[0].rsplit('-', 1)[1]) // 10}"


class TeamCountSum(KeyedProcessFunction):
    def open(self, runtime_context):
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.sum = runtime_context.get_state(ValueStateDescriptor("sum", Types.LONG()))

    def process_element(self, value, ctx):
        if value[1] == 1000:
            raise AssertionError("a refused write reached the job")
        c, s = (self.count.value() or 0) + 1, (self.sum.value() or 0) + value[1]
        self.count.update(c)
        self.sum.update(s)
        yield ctx.get_current_key(), c, s


def team_job() -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    (
        env.from_source(ChannelSource("in", PAIR, durable=False), None, "in")
        .key_by(lambda r: f"team-{int(r[0].rsplit('-', 1)[1]) // 10}")  # team_of, as a lambda
        .process(TeamCountSum(), TEAM)
        .name("teams")
        .sink_to(ChannelSink("out"))
    )
    return env


class UserTotal(KeyedProcessFunction):
    """Per user: the running total, sent on keyed by the click's region."""

    def open(self, runtime_context):
        self.total = runtime_context.get_state(ValueStateDescriptor("total", Types.LONG()))

    def process_element(self, value, ctx):
        total = (self.total.value() or 0) + value[2]
        self.total.update(total)
        yield value[1], value[0], total


class RegionSequence(KeyedProcessFunction):
    """Per region: numbers each row it gets 1, 2, ... (a row taken twice or lost shows)."""

    def open(self, runtime_context):
        self.n = runtime_context.get_state(ValueStateDescriptor("n", Types.LONG()))

    def process_element(self, value, ctx):
        n = (self.n.value() or 0) + 1
        self.n.update(n)
        yield value[0], n, value[1], value[2]


class RegionWindow(ProcessWindowFunction):
    """Per region and window: its start, how many rows, the sum of their users' totals."""

    def process(self, key, context, elements):
        elements = list(elements)
        yield key, context.window().start, len(elements), sum(e[2] for e in elements)
