"""Custom triggers, evictors and GlobalWindows against plain-Python references, at parallelism
1, 2 and 4, under live rescales and across a kill -9 recovery."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import defaultdict

import pytest

from stretch import channels
from stretch.common import Time, Types, WatermarkStrategy
from stretch.common.watermark_strategy import TimestampAssigner
from stretch.contracts.triggers import NeverTrigger
from stretch.datastream import ProcessWindowFunction, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.window import (
    ContinuousEventTimeTrigger,
    CountEvictor,
    CountTrigger,
    DeltaEvictor,
    EventTimeSessionWindows,
    GlobalWindows,
    PurgingTrigger,
    TimeEvictor,
    TumblingEventTimeWindows,
)

PAIR = Types.TUPLE([Types.STRING(), Types.LONG()])


class AtValue(TimestampAssigner):
    def extract_timestamp(self, value, record_timestamp):
        return value[1]


def _records(n: int, keys: int = 7, seed: int = 1) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(f"k{rng.randrange(keys)}", i) for i in range(n)]


class Elements(ProcessWindowFunction):
    def process(self, key, context, elements):
        yield key, [v for _, v in elements]


def _run(build, records, parallelism=2, rescale=False, kill=False):
    """The job ``build(stream)`` over ``records`` fed through a channel (in order), its results."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    if kill:
        env.enable_checkpointing(30)
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner(AtValue())
    stream = env.from_source(ChannelSource("in", PAIR), strategy, "in")
    build(stream).name("windows").sink_to(ChannelSink("out"))
    client = env.execute_async(f"triggers {time.monotonic_ns()}")
    co = client._coordinator
    writer = channels.open_writer(client, "in")
    rng = random.Random(4)
    killer = None
    if kill:

        def kill_one():
            time.sleep(0.3)
            busy = [w for w in co.workers.all() if w.task is not None and w.pid]
            os.kill(random.choice(busy).pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_one)
        killer.start()
    for i in range(0, len(records), 50):
        writer.write(records[i : i + 50])
        if rescale and rng.random() < 0.3:
            assert client.rescale("windows", rng.choice([1, 2, 3, 4])).state_bytes_copied == 0
        if kill:
            time.sleep(0.01)
    writer.end()
    assert client.wait(120).name == "FINISHED"
    if killer is not None:
        killer.join()
        assert len(co.recoveries) >= 1
    return [tuple(r) for r in channels.open_reader(client, "out")]


def _groups_of(records, n: int) -> list[tuple]:
    """Per key, the sum of each full group of ``n`` of its elements (a purging count trigger)."""
    seen, out = defaultdict(list), []
    for k, v in records:
        seen[k].append(v)
        if len(seen[k]) == n:
            out.append((k, sum(seen[k])))
            seen[k] = []
    return sorted(out)


def _sum_per_key(stream):
    return stream.key_by(lambda r: r[0]).window(GlobalWindows.create())


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_global_windows_fire_by_a_count_trigger_and_purge_with_a_purging_one(parallelism):
    records = _records(700)

    def build(stream):
        return (
            _sum_per_key(stream)
            .trigger(PurgingTrigger.of(CountTrigger.of(3)))
            .reduce(lambda a, b: (a[0], a[1] + b[1]))
        )

    assert sorted(_run(build, records, parallelism)) == _groups_of(records, 3)


def test_a_count_trigger_without_purging_fires_running_totals():
    records = _records(300)
    want, totals, counts = [], defaultdict(int), defaultdict(int)
    for k, v in records:
        totals[k] += v
        counts[k] += 1
        if counts[k] % 4 == 0:
            want.append((k, totals[k]))

    def build(stream):
        return _sum_per_key(stream).trigger(CountTrigger.of(4)).reduce(lambda a, b: (a[0], a[1] + b[1]))

    assert sorted(_run(build, records)) == sorted(want)


def test_a_global_window_without_a_trigger_never_fires():
    def build(stream):
        return _sum_per_key(stream).reduce(lambda a, b: (a[0], a[1] + b[1]))

    assert _run(build, _records(100)) == []


def test_count_and_delta_evictors_thin_the_pane_before_the_function():
    records = _records(400, keys=3, seed=7)
    want_count, want_delta, panes = [], [], defaultdict(list)
    fired = defaultdict(int)
    delta_panes = defaultdict(list)
    for k, v in records:
        panes[k].append(v)
        delta_panes[k].append(v)
        fired[k] += 1
        if fired[k] % 5 == 0:
            panes[k] = panes[k][-2:]  # CountEvictor(2): the last two, kept for the next firing
            want_count.append((k, list(panes[k])))
            last = delta_panes[k][-1]
            delta_panes[k] = [x for x in delta_panes[k] if abs(x - last) < 40]
            want_delta.append((k, list(delta_panes[k])))

    def counted(stream):
        return (
            _sum_per_key(stream).trigger(CountTrigger.of(5)).evictor(CountEvictor.of(2)).process(Elements())
        )

    def delta(stream):
        return (
            _sum_per_key(stream)
            .trigger(CountTrigger.of(5))
            .evictor(DeltaEvictor.of(40, lambda a, b: abs(a[1] - b[1])))
            .process(Elements())
        )

    assert sorted((k, list(v)) for k, v in _run(counted, records)) == sorted(want_count)
    assert sorted((k, list(v)) for k, v in _run(delta, records)) == sorted(want_delta)


def test_a_time_evictor_keeps_the_end_of_each_event_time_window():
    records = _records(600, keys=4, seed=3)
    panes = defaultdict(list)
    for k, v in records:
        panes[(k, v - v % 100)].append(v)
    want = sorted((k, sorted(x for x in vs if x > max(vs) - 30)) for (k, _), vs in panes.items())

    def build(stream):
        return (
            stream.key_by(lambda r: r[0])
            .window(TumblingEventTimeWindows.of(Time.milliseconds(100)))
            .evictor(TimeEvictor.of(Time.milliseconds(30)))
            .process(Elements())
        )

    assert sorted((k, sorted(v)) for k, v in _run(build, records)) == want


def test_a_continuous_event_time_trigger_fires_early_and_at_the_window_end():
    records = _records(1000, keys=3, seed=9)
    totals = defaultdict(int)
    for k, v in records:
        totals[(k, v - v % 500)] += v

    class Sum(ProcessWindowFunction):
        def process(self, key, context, elements):
            yield key, context.window().start, sum(v for _, v in elements)

    def build(stream):
        return (
            stream.key_by(lambda r: r[0])
            .window(TumblingEventTimeWindows.of(Time.milliseconds(500)))
            .trigger(ContinuousEventTimeTrigger.of(Time.milliseconds(100)))
            .process(Sum())
        )

    got = _run(build, records)
    per_window = defaultdict(list)
    for k, start, s in got:
        per_window[(k, start)].append(s)
    assert {w: max(sums) for w, sums in per_window.items()} == totals  # the last firing: the whole window
    assert all(sums == sorted(sums) for sums in per_window.values())  # early firings: growing panes
    assert sum(len(s) for s in per_window.values()) > len(totals)  # and there were early firings


def test_triggered_windows_under_live_rescales_and_across_a_kill_9_recovery():
    records = _records(3000)

    def build(stream):
        return (
            _sum_per_key(stream)
            .trigger(PurgingTrigger.of(CountTrigger.of(3)))
            .reduce(lambda a, b: (a[0], a[1] + b[1]))
        )

    assert sorted(_run(build, records, rescale=True)) == _groups_of(records, 3)
    assert sorted(_run(build, records, kill=True)) == _groups_of(records, 3)


def _count_fired_sessions(records, gap: int, n: int) -> list[tuple]:
    """Flink's session windows with a CountTrigger(n), all records in before the watermark moves:
    a record's window absorbs the key's sessions it overlaps (their counts add up), and a session
    fires its elements so far whenever its count reaches n (the count then starts again)."""
    sessions, fired = defaultdict(list), []
    for key, ts in records:
        start, end, count, elements = ts, ts + gap, 0, []
        for s in [s for s in sessions[key] if s[0] <= ts + gap and s[1] >= ts]:
            sessions[key].remove(s)
            start, end, count, elements = min(start, s[0]), max(end, s[1]), count + s[2], elements + s[3]
        elements, count = [*elements, ts], count + 1
        if count >= n:
            fired.append((key, start, end, tuple(sorted(elements))))
            count = 0
        sessions[key].append((start, end, count, elements))
    return sorted(fired)


@pytest.mark.parametrize("parallelism", [1, 2])
def test_session_windows_with_a_count_trigger_merge_their_counts(parallelism):
    rng = random.Random(3)
    records = [(f"k{rng.randrange(3)}", rng.randrange(400)) for _ in range(300)]  # out of order

    class Elements(ProcessWindowFunction):
        def process(self, key, context, elements):
            yield key, context.window().start, context.window().end, tuple(sorted(v for _, v in elements))

    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner(AtValue())
    windows = (
        env.from_collection(records, PAIR).assign_timestamps_and_watermarks(strategy).key_by(lambda r: r[0])
    )
    fired = windows.window(EventTimeSessionWindows.with_gap(Time.milliseconds(6))).trigger(CountTrigger.of(4))
    got = sorted(fired.process(Elements()).execute_and_collect())
    assert got == _count_fired_sessions(records, 6, 4)
    assert any(len(e) > 4 for *_, e in got)  # a session fired again later, with what it had kept


def test_session_windows_refuse_a_trigger_that_cannot_merge():
    env = StreamExecutionEnvironment.get_execution_environment()
    keyed = env.from_collection([("a", 1)], PAIR).key_by(lambda r: r[0])
    with pytest.raises(ValueError, match=r"cannot \(its can_merge\(\) is False\)"):
        keyed.window(EventTimeSessionWindows.with_gap(Time.milliseconds(5))).trigger(NeverTrigger()).reduce(
            lambda a, b: a
        )


def test_count_windows_refuse_a_custom_trigger():
    env = StreamExecutionEnvironment.get_execution_environment()
    keyed = env.from_collection([("a", 1)], PAIR).key_by(lambda r: r[0])
    with pytest.raises(ValueError, match="count windows keep their own firing"):
        keyed.count_window(3).trigger(CountTrigger.of(2)).reduce(lambda a, b: a)
