"""Timers and watermarks against a plain-Python model of Flink's semantics.

The model: records arrive in batches; after each batch a source's watermark becomes its maximum
timestamp - delay - 1; an operator's watermark is the minimum over its producers; whenever it
advances, every timer at or below it fires, per key in timestamp order, exactly once (timers a
timer registers fire in the same advance if already due); at the end the watermark goes to the
maximum.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from stretch import channels
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment, TimeDomain
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.state import StateTtlConfig, ValueStateDescriptor
from tests.datastream.flink_windows import MIN, by_key

RECORD = Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG()])  # key, event time (ms), value
DELAY = 5


def timer_of(ts: int, v: int) -> int:
    return (ts // 10 + 1) * 10 + v % 3


class Timers(KeyedProcessFunction):
    """Registers a timer per record, deletes some, and chains a follow-up timer from some timers."""

    def process_element(self, value, ctx):
        _, ts, v = value
        timers = ctx.timer_service()
        timers.register_event_time_timer(timer_of(ts, v))
        if v % 4 == 0:
            timers.delete_event_time_timer(timer_of(ts, v) - 1)

    def on_timer(self, timestamp, ctx):
        assert ctx.time_domain() == TimeDomain.EVENT_TIME
        assert ctx.timer_service().current_watermark() >= timestamp
        if timestamp % 10 == 2:
            ctx.timer_service().register_event_time_timer(timestamp + 3)
            ctx.timer_service().delete_event_time_timer(timestamp + 8)
        yield ctx.get_current_key(), timestamp


def model(batches, delay=DELAY):
    """(key, timestamp) fired, in firing order per key."""
    timers: dict = {}  # key -> set of timestamps
    fired = []
    wm = max_ts = MIN

    def advance(new_wm):
        for k, pending in timers.items():
            while pending and min(pending) <= new_wm:
                t = min(pending)
                pending.discard(t)
                fired.append((k, t))
                if t % 10 == 2:
                    pending.add(t + 3)
                    pending.discard(t + 8)

    for batch in batches:
        for k, ts, v in batch:
            max_ts = max(max_ts, ts)
            pending = timers.setdefault(k, set())
            pending.add(timer_of(ts, v))
            if v % 4 == 0:
                pending.discard(timer_of(ts, v) - 1)
        new_wm = max_ts - delay - 1
        if new_wm > wm:
            advance(new_wm)
            wm = new_wm
    advance(2**63 - 1)
    return fired


def batches_of(seed, n_batches=40, per_batch=30, keys=6):
    rng = random.Random(seed)
    t, out = 0, []
    for _ in range(n_batches):
        batch = []
        for _ in range(per_batch):
            t += rng.randrange(0, 3)
            batch.append((f"k{rng.randrange(keys)}", max(0, t - rng.randrange(0, 12)), rng.randrange(1000)))
        out.append(batch)
    return out


def strategy(delay=DELAY):
    return WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(delay)).with_timestamp_assigner(
        "f1"
    )


def collect(client, name):
    """Read a channel into a list on a thread; returns the list and the thread."""
    out: list = []
    reader = channels.open_reader(client, name)
    t = threading.Thread(target=lambda: out.extend(reader), daemon=True)
    t.start()
    return out, t


def run_timers(batches, parallelism, rescale_to=None):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.from_source(ChannelSource("in", RECORD), strategy(), "in").key_by(lambda r: r[0]).process(
        Timers()
    ).name("timers").sink_to(ChannelSink("out"))
    client = env.execute_async("timers")
    writer = channels.open_writer(client, "in")
    out, reader = collect(client, "out")
    rng = random.Random(11)
    for b in batches:
        writer.write(b)
        if rescale_to and rng.random() < 0.3:
            client.rescale("timers", rng.choice(rescale_to))
    writer.end()
    reader.join(60)
    assert client.wait().name == "FINISHED"
    return out


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_event_timers_fire_once_in_order_with_deletes(parallelism):
    batches = batches_of(parallelism)
    out = run_timers(batches, parallelism)
    want = model(batches)
    assert len(want) > 200
    assert by_key(out) == by_key(want)


def test_event_timers_under_random_live_rescales():
    batches = batches_of(7, n_batches=80)
    out = run_timers(batches, 2, rescale_to=[1, 2, 3, 4, 6])
    assert by_key(out) == by_key(model(batches))


class ProcessingTimers(KeyedProcessFunction):
    """Registers two processing-time timers per key and deletes one of them."""

    def process_element(self, value, ctx):
        now = ctx.timer_service().current_processing_time()
        ctx.timer_service().register_processing_time_timer(now + 30)
        ctx.timer_service().register_processing_time_timer(now + 40)
        ctx.timer_service().delete_processing_time_timer(now + 40)
        yield "registered", value[0], now + 30

    def on_timer(self, timestamp, ctx):
        yield (
            "fired",
            ctx.get_current_key(),
            timestamp,
            ctx.time_domain() == TimeDomain.PROCESSING_TIME,
            ctx.timer_service().current_processing_time() >= timestamp,
        )


def test_processing_time_timers_fire_once_after_their_time_and_deletes_hold():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.from_source(ChannelSource("in", RECORD), None, "in").key_by(lambda r: r[0]).process(
        ProcessingTimers()
    ).sink_to(ChannelSink("out"))
    client = env.execute_async("processing timers")
    writer = channels.open_writer(client, "in")
    out, reader = collect(client, "out")
    for i in range(5):
        writer.write([(f"k{i}-{j}", 0, 0) for j in range(4)])
        time.sleep(0.01)
    deadline = time.monotonic() + 10
    while sum(1 for o in out if o[0] == "fired") < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)  # a deleted or duplicate timer would fire by now
    writer.end()
    reader.join(30)
    client.wait()
    registered = sorted((k, t) for kind, k, t in (o for o in out if o[0] == "registered"))
    fired = [o for o in out if o[0] == "fired"]
    assert sorted((k, t) for _, k, t, _, _ in fired) == registered
    assert all(domain_ok and late_enough for *_, domain_ok, late_enough in fired)


class SeesWatermark(KeyedProcessFunction):
    def process_element(self, value, ctx):
        yield value[0], value[1], ctx.timer_service().current_watermark()


def _two_sources(idleness_ms=None):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    slow = strategy(0)
    if idleness_ms is not None:
        slow = slow.with_idleness(Duration.of_millis(idleness_ms))
    a = env.from_source(ChannelSource("a", RECORD), strategy(0), "a")
    b = env.from_source(ChannelSource("b", RECORD), slow, "b")
    a.union(b).key_by(lambda r: r[0]).process(SeesWatermark()).sink_to(ChannelSink("out"))
    client = env.execute_async("two sources")
    return client, channels.open_writer(client, "a"), channels.open_writer(client, "b")


def _wait_for(out, n, timeout=10):
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(out) >= n


def test_watermark_is_the_minimum_over_producers():
    client, a, b = _two_sources()
    out, reader = collect(client, "out")
    a.write([("x", 1000, 0)])
    _wait_for(out, 1)
    a.write([("x", 1001, 0)])  # b has said nothing: it holds the watermark at the minimum
    _wait_for(out, 2)
    b.write([("y", 100, 0)])
    _wait_for(out, 3)
    a.write([("x", 1002, 0)])
    _wait_for(out, 4)
    a.end()
    b.end()
    reader.join(30)
    client.wait()
    assert [w for *_, w in out] == [MIN, MIN, MIN, 99]


def test_an_idle_source_does_not_hold_the_watermark_back():
    client, a, b = _two_sources(idleness_ms=50)
    out, reader = collect(client, "out")
    b.write([("y", 10, 0)])
    _wait_for(out, 1)
    a.write([("x", 1000, 0)])
    _wait_for(out, 2)
    time.sleep(0.4)  # b says nothing for longer than its idleness timeout
    a.write([("x", 1001, 0)])
    _wait_for(out, 3)
    b.write([("y", 20, 0)])  # b is active again: the watermark cannot go back, but waits for b
    _wait_for(out, 4)
    a.end()
    b.end()
    reader.join(30)
    client.wait()
    assert [w for *_, w in out] == [MIN, MIN, 999, 1000]  # without idleness: [MIN, MIN, 9, 9]


class Remembers(KeyedProcessFunction):
    """Counts records per key in a value state with a 300 ms TTL."""

    def open(self, runtime_context):
        desc = ValueStateDescriptor("count", Types.LONG())
        desc.enable_time_to_live(StateTtlConfig.new_builder(Time.milliseconds(300)).build())
        self.count = runtime_context.get_state(desc)

    def process_element(self, value, ctx):
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        yield value[0], n


def test_state_ttl_expires_in_a_running_job_across_a_rescale():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    env.from_source(ChannelSource("in", RECORD), None, "in").key_by(lambda r: r[0]).process(Remembers()).name(
        "ttl"
    ).sink_to(ChannelSink("out"))
    client = env.execute_async("ttl")
    writer = channels.open_writer(client, "in")
    out, reader = collect(client, "out")
    keys = [f"k{i}" for i in range(8)]
    writer.write([(k, 0, 0) for k in keys])
    writer.write([(k, 0, 0) for k in keys])
    _wait_for(out, 16)
    client.rescale("ttl", 3)
    time.sleep(0.6)  # longer than the TTL
    writer.write([(k, 0, 0) for k in keys])
    writer.end()
    reader.join(30)
    client.wait()
    assert sorted(out) == sorted([(k, 1) for k in keys] + [(k, 2) for k in keys] + [(k, 1) for k in keys])
