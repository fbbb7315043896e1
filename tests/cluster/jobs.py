"""The jobs the cluster tests run, and their plain-Python references: a running count and sum per
key (or per team, a key a selector function computes); limits per group of keys broadcast to
keyed events."""

from __future__ import annotations

from collections import defaultdict

from stretch.common import Types
from stretch.datastream import KeyedBroadcastProcessFunction, KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.state import MapStateDescriptor, ValueStateDescriptor

PAIR = Types.TUPLE([Types.STRING(), Types.LONG()])


class CountSum(KeyedProcessFunction):
    def open(self, runtime_context):
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.sum = runtime_context.get_state(ValueStateDescriptor("sum", Types.LONG()))

    def process_element(self, value, ctx):
        key, n = value
        c = (self.count.value() or 0) + 1
        s = (self.sum.value() or 0) + n
        self.count.update(c)
        self.sum.update(s)
        yield key, c, s


def count_sum_job(max_parallelism: int = 128, parallelism: int = 2) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.set_max_parallelism(max_parallelism)
    (
        env.from_source(ChannelSource("in", PAIR, durable=False), None, "in")
        .key_by(0)
        .process(CountSum(), Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG()]))
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
