"""Windows against a plain-Python model of Flink's semantics, at several parallelisms and under rescales."""

from __future__ import annotations

import random
import threading
import time

import pytest

from stretch import channels
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import (
    AggregateFunction,
    OutputTag,
    ProcessAllWindowFunction,
    ProcessWindowFunction,
    StreamExecutionEnvironment,
    WindowFunction,
)
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.window import (
    EventTimeSessionWindows,
    SessionWindowTimeGapExtractor,
    SlidingEventTimeWindows,
    TumblingEventTimeWindows,
    TumblingProcessingTimeWindows,
)
from tests.datastream.flink_windows import by_key, run, sliding, tumbling

RECORD = Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG()])  # key, event time (ms), value
DELAY = 20


def batches_of(n_batches=30, per_batch=40, keys=7, seed=1, late_share=0.1):
    """Mostly ascending event times with some out of order and some very late records."""
    rng = random.Random(seed)
    t, out = 0, []
    for _ in range(n_batches):
        batch = []
        for _ in range(per_batch):
            t += rng.randrange(0, 4)
            ts = t - rng.randrange(0, 200) if rng.random() < late_share else t - rng.randrange(0, 15)
            batch.append((f"k{rng.randrange(keys)}", max(ts, 0), rng.randrange(100)))
        out.append(batch)
    return out


class Job:
    """A windowed job fed batch by batch through a channel, its output collected by a thread."""

    def __init__(self, build, parallelism=2, lateness_tag=None, key=None, record=RECORD, delay=DELAY):
        env = StreamExecutionEnvironment.get_execution_environment()
        env.set_parallelism(parallelism)
        strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(delay))
        strategy = strategy.with_timestamp_assigner("f1")
        keyed = env.from_source(ChannelSource("in", record), strategy, "in").key_by(key or (lambda r: r[0]))
        result = build(keyed).name("windows")
        result.sink_to(ChannelSink("out"))
        if lateness_tag is not None:
            result.get_side_output(lateness_tag).sink_to(ChannelSink("late"))
        self.client = env.execute_async("windows")
        self.writer = channels.open_writer(self.client, "in")
        self.out, self.late = [], []
        self.readers = [self._read("out", self.out)]
        if lateness_tag is not None:
            self.readers.append(self._read("late", self.late))

    def _read(self, name, into):
        reader = channels.open_reader(self.client, name)
        t = threading.Thread(target=lambda: into.extend(reader), daemon=True)
        t.start()
        return t

    def feed(self, batches, rescale_to=None):
        rng = random.Random(5)
        for b in batches:
            self.writer.write(b)
            if rescale_to and rng.random() < 0.3:
                self.client.rescale("windows", rng.choice(rescale_to))
        self.writer.end()
        for t in self.readers:
            t.join(60)
        assert self.client.wait().name == "FINISHED"
        return self


def key_of(r):
    return r[0]


def ts_of(r):
    return r[1]


class Sum(AggregateFunction):
    def create_accumulator(self):
        return (0, 0)

    def add(self, value, acc):
        return acc[0] + value[2], acc[1] + 1

    def get_result(self, acc):
        return acc

    def merge(self, a, b):
        return a[0] + b[0], a[1] + b[1]


class Describe(ProcessWindowFunction):
    def process(self, key, context, elements):
        w = context.window()
        yield key, w.start, w.end, sorted(e[2] for e in elements)


class Apply(WindowFunction):
    def apply(self, key, window, inputs):
        yield key, window.start, window.end, sum(e[2] for e in inputs)


ASSIGNERS = {
    "tumbling": (TumblingEventTimeWindows.of(Time.milliseconds(25)), dict(assign=tumbling(25))),
    "sliding": (
        SlidingEventTimeWindows.of(Time.milliseconds(30), Time.milliseconds(10)),
        dict(assign=sliding(30, 10)),
    ),
    "session": (EventTimeSessionWindows.with_gap(Time.milliseconds(6)), dict(gap_of=lambda r: 6)),
}


@pytest.mark.parametrize("parallelism", [1, 2, 4])
@pytest.mark.parametrize("kind", sorted(ASSIGNERS))
def test_process_window_function_matches_flink(kind, parallelism):
    assigner, ref = ASSIGNERS[kind]
    batches = batches_of(seed=parallelism)
    job = Job(lambda ks: ks.window(assigner).process(Describe()), parallelism).feed(batches)
    want, _ = run(batches, key_of, ts_of, result=lambda rs: sorted(r[2] for r in rs), delay=DELAY, **ref)
    assert by_key(job.out) == by_key(want)


def test_reduce_aggregate_and_apply_match_flink():
    batches = batches_of(seed=9)
    assigner = TumblingEventTimeWindows.of(Time.milliseconds(25))
    want, _ = run(batches, key_of, ts_of, assign=tumbling(25), result=lambda rs: rs, delay=DELAY)
    jobs = {
        "reduce": Job(lambda ks: ks.window(assigner).reduce(lambda a, b: (a[0], a[1], a[2] + b[2]))),
        "aggregate": Job(lambda ks: ks.window(assigner).aggregate(Sum())),
        "apply": Job(lambda ks: ks.window(assigner).apply(Apply())),
    }
    for job in jobs.values():
        job.feed(batches)
    expect_reduce = [(k, rs[0][1], sum(r[2] for r in rs)) for k, _, _, rs in want]
    assert by_key(jobs["reduce"].out) == by_key(expect_reduce)
    assert sorted(jobs["aggregate"].out) == sorted((sum(r[2] for r in rs), len(rs)) for *_, rs in want)
    assert by_key(jobs["apply"].out) == by_key([(k, s, e, sum(r[2] for r in rs)) for k, s, e, rs in want])


def test_allowed_lateness_refires_and_side_output_gets_the_rest():
    batches = batches_of(seed=3, late_share=0.25)
    tag = OutputTag("late", RECORD)
    assigner = TumblingEventTimeWindows.of(Time.milliseconds(25))
    job = Job(
        lambda ks: ks.window(assigner).allowed_lateness(40).side_output_late_data(tag).process(Describe()),
        lateness_tag=tag,
    ).feed(batches)
    want, late = run(
        batches,
        key_of,
        ts_of,
        assign=tumbling(25),
        result=lambda rs: sorted(r[2] for r in rs),
        delay=DELAY,
        lateness=40,
    )
    assert late, "the data should have records beyond the allowed lateness"
    assert by_key(job.out) == by_key(want)
    assert sorted(job.late) == sorted(late)


class DescribeAggregate(ProcessWindowFunction):
    def process(self, key, context, elements):
        (acc,) = elements
        yield key, context.window().start, context.window().end, acc


@pytest.mark.parametrize("lateness", [0, 30])
def test_dynamic_gap_sessions_with_an_aggregate_and_a_window_function(lateness):
    batches = batches_of(seed=4, late_share=0.2)
    gap = lambda r: 3 + r[2] % 5  # noqa: E731
    assigner = EventTimeSessionWindows.with_dynamic_gap(gap)
    job = Job(
        lambda ks: ks.window(assigner).allowed_lateness(lateness).aggregate(Sum(), DescribeAggregate())
    ).feed(batches)
    totals = lambda rs: (sum(r[2] for r in rs), len(rs))  # noqa: E731
    want, late = run(batches, key_of, ts_of, result=totals, delay=DELAY, gap_of=gap, lateness=lateness)
    assert late
    assert by_key(job.out) == by_key(want)


def test_windows_under_random_rescales():
    batches = batches_of(n_batches=60, seed=8)
    assigner = SlidingEventTimeWindows.of(Time.milliseconds(30), Time.milliseconds(10))
    job = Job(lambda ks: ks.window(assigner).process(Describe()), parallelism=2).feed(
        batches, rescale_to=[1, 2, 3, 5, 8]
    )
    want, _ = run(
        batches,
        key_of,
        ts_of,
        assign=sliding(30, 10),
        result=lambda rs: sorted(r[2] for r in rs),
        delay=DELAY,
    )
    assert by_key(job.out) == by_key(want)


def test_count_windows():
    records = [(f"k{i % 3}", i, i) for i in range(100)]
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    ks = env.from_collection(records, RECORD).key_by(lambda r: r[0])
    tumbling_out = (
        ks.count_window(4).reduce(lambda a, b: (a[0], a[1], a[2] + b[2])).execute_and_collect(limit=1000)
    )
    env = StreamExecutionEnvironment.get_execution_environment()
    ks = env.from_collection(records, RECORD).key_by(lambda r: r[0])
    sliding_out = (
        ks.count_window(4, 2)
        .apply(lambda key, window, rs: [sum(r[2] for r in rs)])
        .execute_and_collect(limit=1000)
    )
    want_t, want_s = [], []
    for k in ("k0", "k1", "k2"):
        vals = [r[2] for r in records if r[0] == k]
        firsts = [r for r in records if r[0] == k]
        want_t += [(k, firsts[i][1], sum(vals[i : i + 4])) for i in range(0, len(vals) - 3, 4)]
        # PyFlink's count_window(4, 2): full windows only, the first at the 4th record
        want_s += [sum(vals[i - 3 : i + 1]) for i in range(3, len(vals), 2)]
    assert sorted(tumbling_out) == sorted(want_t)
    assert sorted(sliding_out) == sorted(want_s)


class SumAll(ProcessAllWindowFunction):
    def process(self, context, elements):
        yield sum(r[2] for r in elements)


def test_count_window_all():
    """PyFlink's DataStream.count_window_all: count windows of the whole stream, at one instance."""
    records = [(f"k{i % 3}", i, i * i) for i in range(23)]
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    ds = env.from_collection(records, RECORD)
    tumbling_out = ds.count_window_all(5).reduce(lambda a, b: (a[0], a[1], a[2] + b[2]))
    sliding_out = ds.count_window_all(4, 2).process(SumAll(), Types.LONG())
    with (
        tumbling_out.map(lambda r: ("t", r[2]))
        .union(sliding_out.map(lambda n: ("s", n)))
        .execute_and_collect() as out
    ):
        got = sorted(out)
    vals = [r[2] for r in records]
    want = [("t", sum(vals[i : i + 5])) for i in range(0, len(vals) - 4, 5)]  # full windows only
    want += [("s", sum(vals[i - 3 : i + 1])) for i in range(3, len(vals), 2)]  # as count_window(4, 2)
    assert got == sorted(want)


def test_processing_time_windows_put_every_record_in_one_window():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    keyed = env.from_source(ChannelSource("in", RECORD), None, "in").key_by(lambda r: r[0])
    keyed.window(TumblingProcessingTimeWindows.of(Time.milliseconds(50))).process(Describe()).sink_to(
        ChannelSink("out")
    )
    client = env.execute_async("processing time")
    writer = channels.open_writer(client, "in")
    out = []
    reader = channels.open_reader(client, "out")
    t = threading.Thread(target=lambda: out.extend(reader), daemon=True)
    t.start()
    sent = []
    for i in range(20):
        batch = [(f"k{j % 3}", 0, i * 10 + j) for j in range(10)]
        writer.write(batch)
        sent += batch
        time.sleep(0.02)
    time.sleep(0.2)  # let the last windows close by the clock
    writer.end()
    t.join(30)
    client.wait()
    assert sorted(v for *_, vals in out for v in vals) == sorted(r[2] for r in sent)
    assert all(e - s == 50 for _, s, e, _ in out)
    assert len(out) >= 6  # the records spread over several windows


class GapOfValue(SessionWindowTimeGapExtractor):
    def extract(self, element):
        return 3 + element[2] % 5


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_dynamic_gap_from_a_session_window_time_gap_extractor(parallelism):
    batches = batches_of(n_batches=12, seed=6, late_share=0.0)
    assigner = EventTimeSessionWindows.with_dynamic_gap(GapOfValue())
    job = Job(lambda ks: ks.window(assigner).process(Describe()), parallelism=parallelism).feed(batches)
    want, _ = run(
        batches,
        key_of,
        ts_of,
        result=lambda rs: sorted(r[2] for r in rs),
        delay=DELAY,
        gap_of=GapOfValue().extract,
    )
    assert by_key(job.out) == by_key(want)
