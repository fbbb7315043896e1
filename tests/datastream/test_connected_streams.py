"""ConnectedStreams (co-map, co-flat-map, co-process, keyed co-process with shared state and
timers) and window_all, against plain-Python references, at parallelism 1, 2 and 4, under live
rescales and across a kill -9 recovery."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter

import pytest

from stretch import channels
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.common.watermark_strategy import TimestampAssigner
from stretch.datastream import (
    AllWindowFunction,
    CoFlatMapFunction,
    CoMapFunction,
    CoProcessFunction,
    KeyedCoProcessFunction,
    ProcessAllWindowFunction,
    StreamExecutionEnvironment,
)
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.state import ValueStateDescriptor
from stretch.datastream.window import TumblingEventTimeWindows

PAIR = Types.TUPLE([Types.STRING(), Types.LONG()])


class Label(CoMapFunction):
    def map1(self, value):
        return f"a{value}"

    def map2(self, value):
        return None if value % 3 == 0 else f"b{value}"  # None is dropped, as in PyFlink


class Repeat(CoFlatMapFunction):
    def flat_map1(self, value):
        yield from [value] * 2

    def flat_map2(self, value):
        return [-value]


class Sides(CoProcessFunction):
    def process_element1(self, value, ctx):
        yield "first", value

    def process_element2(self, value, ctx):
        yield "second", value


def _run(env, **streams) -> dict[str, list]:
    """Run one job whose streams each sink into a channel of their own; every channel's records."""
    for name, stream in streams.items():
        stream.sink_to(ChannelSink(name))
    client = env.execute_async(f"connected outputs {time.monotonic_ns()}")
    readers = {name: channels.open_reader(client, name) for name in streams}
    assert client.wait(60).name == "FINISHED"
    return {name: list(reader) for name, reader in readers.items()}


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_co_map_co_flat_map_and_co_process_call_each_inputs_method(parallelism):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    a = env.from_collection(list(range(20)), Types.LONG())
    b = env.from_collection(list(range(100, 110)), Types.LONG())
    got = _run(
        env,
        mapped=a.connect(b).map(Label(), Types.STRING()),
        flat=a.connect(b).flat_map(Repeat(), Types.LONG()),
        sides=a.connect(b).process(Sides(), Types.TUPLE([Types.STRING(), Types.LONG()])),
    )
    assert sorted(got["mapped"]) == sorted(
        [f"a{v}" for v in range(20)] + [f"b{v}" for v in range(100, 110) if v % 3]
    )
    assert Counter(got["flat"]) == Counter([*range(20), *range(20), *(-v for v in range(100, 110))])
    assert sorted(tuple(r) for r in got["sides"]) == sorted(
        [("first", v) for v in range(20)] + [("second", v) for v in range(100, 110)]
    )


class Totals(KeyedCoProcessFunction):
    """Per key: the sum of the first input's values and the count of the second's, in one keyed
    state shared by both inputs; reported once, by an event-time timer at the end of input."""

    def open(self, runtime_context):
        self.total = runtime_context.get_state(ValueStateDescriptor("total", Types.LONG()))
        self.seen = runtime_context.get_state(ValueStateDescriptor("seen", Types.LONG()))

    def process_element1(self, value, ctx):
        self.total.update((self.total.value() or 0) + value[1])
        ctx.timer_service().register_event_time_timer(1 << 40)

    def process_element2(self, value, ctx):
        self.seen.update((self.seen.value() or 0) + 1)
        ctx.timer_service().register_event_time_timer(1 << 40)

    def on_timer(self, timestamp, ctx):
        yield ctx.get_current_key(), self.total.value() or 0, self.seen.value() or 0


class AtIndex(TimestampAssigner):
    def extract_timestamp(self, value, record_timestamp):
        return value[1]


def _records(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(f"k{rng.randrange(23)}", i) for i in range(n)]


def _reference(records) -> list[tuple]:
    total, seen = Counter(), Counter()
    for side, (key, value) in records:
        if side == 0:
            total[key] += value
        else:
            seen[key] += 1
    return sorted((k, total[k], seen[k]) for k in set(total) | set(seen))


def _totals_job(parallelism: int, checkpointing: bool = False):
    """Both inputs split from one channel of (side, key, value) records, so that the test controls
    what arrives when; the result into an output channel."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    if checkpointing:
        env.enable_checkpointing(30)
    record = Types.TUPLE([Types.INT(), Types.STRING(), Types.LONG()])
    watermarks = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(0))
    src = env.from_source(ChannelSource("in", record), watermarks.with_timestamp_assigner(_Stamp()), "in")
    first = src.filter(lambda r: r[0] == 0).map(lambda r: (r[1], r[2]), PAIR)
    second = src.filter(lambda r: r[0] == 1).map(lambda r: (r[1], r[2]), PAIR)
    (
        first.connect(second)
        .key_by(lambda r: r[0], lambda r: r[0])
        .process(Totals(), Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG()]))
        .name("totals")
        .sink_to(ChannelSink("out"))
    )
    return env.execute_async(f"connected {parallelism} {checkpointing} {time.monotonic_ns()}")


class _Stamp(TimestampAssigner):
    def extract_timestamp(self, value, record_timestamp):
        return value[2]


def _inputs(n: int = 3000) -> list[tuple[int, tuple[str, int]]]:
    return [(i % 3 == 0, rec) for i, rec in enumerate(_records(n, 11))]


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_keyed_co_process_shares_state_and_timers_between_its_inputs(parallelism):
    inputs = _inputs()
    client = _totals_job(parallelism)
    writer = channels.open_writer(client, "in")
    for i in range(0, len(inputs), 200):
        writer.write([(int(side), k, v) for side, (k, v) in inputs[i : i + 200]])
    writer.end()
    assert client.wait(60).name == "FINISHED"
    got = sorted(tuple(r) for r in channels.open_reader(client, "out"))
    assert got == _reference([(int(s), r) for s, r in inputs])


def test_keyed_co_process_under_random_live_rescales():
    inputs = _inputs()
    client = _totals_job(2)
    writer = channels.open_writer(client, "in")
    rng = random.Random(3)
    for i in range(0, len(inputs), 100):
        writer.write([(int(side), k, v) for side, (k, v) in inputs[i : i + 100]])
        if rng.random() < 0.3:
            assert client.rescale("totals", rng.choice([1, 2, 3, 4])).state_bytes_copied == 0
    writer.end()
    assert client.wait(60).name == "FINISHED"
    got = sorted(tuple(r) for r in channels.open_reader(client, "out"))
    assert got == _reference([(int(s), r) for s, r in inputs])


def test_keyed_co_process_is_exact_across_a_kill_9_recovery():
    inputs = _inputs(6000)
    client = _totals_job(2, checkpointing=True)
    co = client._coordinator
    writer = channels.open_writer(client, "in")
    killed = threading.Event()

    def kill_one():
        time.sleep(0.3)
        busy = [w for w in co.workers.all() if w.task is not None and w.pid]
        os.kill(random.choice(busy).pid, signal.SIGKILL)
        killed.set()

    threading.Thread(target=kill_one, daemon=True).start()
    for i in range(0, len(inputs), 100):
        writer.write([(int(side), k, v) for side, (k, v) in inputs[i : i + 100]])
        time.sleep(0.01)
    writer.end()
    assert client.wait(120).name == "FINISHED"
    assert killed.is_set() and len(co.recoveries) >= 1
    got = sorted(tuple(r) for r in channels.open_reader(client, "out"))
    assert got == _reference([(int(s), r) for s, r in inputs])


def test_a_keyed_co_process_function_needs_keyed_inputs():
    env = StreamExecutionEnvironment.get_execution_environment()
    a = env.from_collection([1], Types.LONG())
    with pytest.raises(TypeError, match="needs keyed inputs"):
        a.connect(a).process(Totals())
    with pytest.raises(TypeError, match="CoMapFunction"):
        a.connect(a).map(lambda v: v)


class SumAll(ProcessAllWindowFunction):
    def process(self, context, elements):
        yield context.window().start, sum(v for _, v in elements), len(list(elements))


class CountAll(AllWindowFunction):
    def apply(self, window, inputs):
        yield window.end, len(list(inputs))


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_window_all_sees_every_element_of_a_window_in_one_instance(parallelism):
    records = _records(500, 5)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    stream = env.from_collection(records, PAIR).assign_timestamps_and_watermarks(
        WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner(AtIndex())
    )

    def windows():
        return stream.window_all(TumblingEventTimeWindows.of(Time.milliseconds(100)))

    got = _run(
        env,
        processed=windows().process(SumAll(), Types.TUPLE([Types.LONG(), Types.LONG(), Types.LONG()])),
        counted=windows().apply(CountAll(), Types.TUPLE([Types.LONG(), Types.LONG()])),
        reduced=windows().reduce(lambda a, b: ("all", a[1] + b[1])),
    )
    want_sum, want_count = Counter(), Counter()
    for _, v in records:
        want_sum[v - v % 100] += v
        want_count[v - v % 100] += 1
    assert sorted(tuple(r) for r in got["processed"]) == sorted(
        (s, want_sum[s], want_count[s]) for s in want_sum
    )
    assert sorted(tuple(r) for r in got["counted"]) == sorted((s + 100, c) for s, c in want_count.items())
    assert sorted(r[1] for r in got["reduced"]) == sorted(want_sum.values())
