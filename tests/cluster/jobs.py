"""The job the cluster tests run, and its plain-Python reference: a running count and sum per key."""

from __future__ import annotations

from collections import defaultdict

from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.state import ValueStateDescriptor

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


def reference(records) -> dict[str, tuple[int, int]]:
    count, total = defaultdict(int), defaultdict(int)
    for key, n in records:
        count[key] += 1
        total[key] += n
    return {k: (count[k], total[k]) for k in count}
