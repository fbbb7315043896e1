"""Built-in window aggregates (vectorized and per record) against the plain-Python Flink model."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from stretch import channels
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import OutputTag, StreamExecutionEnvironment
from stretch.datastream import aggregates as A
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.connectors.datagen import DataGeneratorSource, RateLimiterStrategy
from stretch.datastream.window import SlidingEventTimeWindows, TumblingEventTimeWindows
from tests.datastream.flink_windows import run, sliding, tumbling
from tests.datastream.test_windows import Job
from tests.runtime.worker_kills import finish_after_a_kill

ALL = [A.count(), A.sum("f2"), A.min("f2"), A.max("f2"), A.mean("f2")]
INT_RECORD = Types.TUPLE([Types.LONG(), Types.LONG(), Types.LONG()])
INT_NAMES = ["f0", "f1", "f2"]


def summary(records):
    vals = [r[2] for r in records]
    return len(vals), sum(vals), min(vals), max(vals), sum(vals) / len(vals)


def expected(batches, assign, delay=20, lateness=0, key=lambda r: r[0]):
    fired, late = run(
        batches, key, lambda r: r[1], assign=assign, result=summary, delay=delay, lateness=lateness
    )
    return sorted((k, s, e, *res) for k, s, e, res in fired), late


def batches_of(seed, n_batches=30, per_batch=50, keys=9, late_share=0.1, int_keys=False, spread=200):
    rng = random.Random(seed)
    t, out = 0, []
    for _ in range(n_batches):
        batch = []
        for _ in range(per_batch):
            t += rng.randrange(0, 4)
            ts = t - rng.randrange(0, spread) if rng.random() < late_share else t - rng.randrange(0, 15)
            k = rng.randrange(keys)
            batch.append((k if int_keys else f"k{k}", max(ts, 0), rng.randrange(-50, 100)))
        out.append(batch)
    return out


def rows(out):
    return sorted(tuple(r) for r in out)


ASSIGNERS = {
    "tumbling": (TumblingEventTimeWindows.of(Time.milliseconds(25)), tumbling(25)),
    "sliding": (SlidingEventTimeWindows.of(Time.milliseconds(30), Time.milliseconds(10)), sliding(30, 10)),
}


@pytest.mark.parametrize("parallelism", [1, 2, 4])
@pytest.mark.parametrize("kind", sorted(ASSIGNERS))
def test_vectorized_aggregates_match_flink_with_late_data(kind, parallelism):
    assigner, assign = ASSIGNERS[kind]
    batches = batches_of(parallelism)
    tag = OutputTag("late", Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG()]))
    job = Job(
        lambda ks: ks.window(assigner).side_output_late_data(tag).aggregate(ALL),
        parallelism,
        lateness_tag=tag,
        key="f0",
    ).feed(batches)
    want, late = expected(batches, assign)
    assert late
    assert rows(job.out) == want
    assert sorted(job.late) == sorted(late)
    (operator,) = job.client.describe()["operators"]
    assert operator["kind"] == "vector_window"


def test_vectorized_and_per_record_paths_agree_under_random_rescales():
    batches = batches_of(5, n_batches=60, int_keys=True)
    assigner = SlidingEventTimeWindows.of(Time.milliseconds(30), Time.milliseconds(10))
    vector = Job(lambda ks: ks.window(assigner).aggregate(ALL), 2, key="f0", record=INT_RECORD)
    vector.feed(batches, rescale_to=[1, 2, 3, 5])
    per_record = Job(lambda ks: ks.window(assigner).aggregate(ALL), 2, record=INT_RECORD).feed(batches)
    want, _ = expected(batches, sliding(30, 10))
    assert rows(vector.out) == want
    assert rows(per_record.out) == want


def test_rings_grow_for_many_open_windows_per_key():
    # 1 ms slides over 40 ms windows and records up to 200 ms late: far more open windows per key
    # than the initial ring holds
    batches = batches_of(6, n_batches=15, keys=3, late_share=0.3)
    assigner = SlidingEventTimeWindows.of(Time.milliseconds(40), Time.milliseconds(1))
    job = Job(lambda ks: ks.window(assigner).aggregate([A.count(), A.sum("f2")]), 2, key="f0", delay=300)
    job.feed(batches)
    fired, _ = run(
        batches,
        lambda r: r[0],
        lambda r: r[1],
        assign=sliding(40, 1),
        delay=300,
        result=lambda rs: (len(rs), sum(r[2] for r in rs)),
    )
    assert rows(job.out) == sorted((k, s, e, *res) for k, s, e, res in fired)


def test_sparse_event_times_and_no_watermark_until_the_end():
    rng = random.Random(3)
    data = [
        (rng.randrange(4), rng.choice([0, 10**6, 10**9, 10**12]) + rng.randrange(50), rng.random())
        for _ in range(300)
    ]
    data.sort(key=lambda r: r[1])  # monotonous: nothing is late however the input is cut into batches
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    stream = env.from_collection(data, Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()]))
    stream = stream.assign_timestamps_and_watermarks(
        WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("f1")
    )
    out = stream.key_by("f0").window(TumblingEventTimeWindows.of(Time.milliseconds(20))).aggregate(ALL)
    got = out.execute_and_collect(limit=10**6)
    want, _ = expected([data], tumbling(20))
    assert len(got) == len(want)
    for g, w in zip(rows(got), want):
        assert g[:4] == w[:4] and g[4:] == pytest.approx(w[4:])


def test_shortcuts_and_names():
    data = [(i % 3, i, i * 2) for i in range(60)]
    env = StreamExecutionEnvironment.get_execution_environment()
    stream = env.from_collection(data, INT_RECORD).assign_timestamps_and_watermarks(
        WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("f1")
    )
    windowed = stream.key_by("f0").window(TumblingEventTimeWindows.of(Time.milliseconds(10)))
    counts = windowed.count().execute_and_collect(limit=1000)
    assert sorted((r.key, r.window_start, r.count) for r in counts) == sorted(
        {
            (k, s, sum(1 for x in data if x[0] == k and s <= x[1] < s + 10))
            for k in range(3)
            for s in range(0, 60, 10)
        }
    )
    env = StreamExecutionEnvironment.get_execution_environment()
    stream = env.from_collection(data, INT_RECORD).assign_timestamps_and_watermarks(
        WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("f1")
    )
    named = stream.key_by("f0").window(TumblingEventTimeWindows.of(Time.milliseconds(10)))
    out = named.aggregate([A.sum("f2", name="total")]).execute_and_collect(limit=1000)
    assert {r.as_dict()["total"] for r in out} == {
        sum(x[2] for x in data if x[0] == k and s <= x[1] < s + 10)
        for k in range(3)
        for s in range(0, 60, 10)
    }


def test_built_ins_reject_non_numbers_and_duplicate_names():
    with pytest.raises(ValueError, match="differ"):
        A.as_builtins([A.sum("f1"), A.sum("f1")])
    env = StreamExecutionEnvironment.get_execution_environment()
    stream = env.from_collection([("a", 1, "x")], Types.TUPLE([Types.STRING(), Types.LONG(), Types.STRING()]))
    stream = stream.assign_timestamps_and_watermarks(
        WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("f1")
    )
    out = stream.key_by("f0").window(TumblingEventTimeWindows.of(Time.milliseconds(10))).sum("f2")
    with pytest.raises(Exception, match="needs a number field"):
        out.execute_and_collect(limit=10)


FIRING = {
    # many keys, each in few windows: a watermark fires a few keys among thousands
    "sparse": {"keys": 3000, "late_share": 0.05},
    # few keys, each in every window: a watermark fires nearly every key
    "dense": {"keys": 4, "late_share": 0.1},
}
SIZES = {
    "tumbling-7": (TumblingEventTimeWindows.of(Time.milliseconds(7)), tumbling(7)),
    "tumbling-100": (TumblingEventTimeWindows.of(Time.milliseconds(100)), tumbling(100)),
    "sliding-30-10": (
        SlidingEventTimeWindows.of(Time.milliseconds(30), Time.milliseconds(10)),
        sliding(30, 10),
    ),
}


@pytest.mark.parametrize("parallelism", [1, 2])
@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("firing", sorted(FIRING))
def test_sparse_and_dense_firing_match_flink(firing, size, parallelism):
    assigner, assign = SIZES[size]
    batches = batches_of(parallelism, n_batches=12, per_batch=150, int_keys=True, **FIRING[firing])
    tag = OutputTag("late", Types.TUPLE([Types.LONG(), Types.LONG(), Types.LONG()]))
    job = Job(
        lambda ks: ks.window(assigner).side_output_late_data(tag).aggregate(ALL),
        parallelism,
        lateness_tag=tag,
        key="f0",
        record=INT_RECORD,
    ).feed(batches)
    want, late = expected(batches, assign)
    assert rows(job.out) == want
    assert sorted(job.late) == sorted(late)


def test_key_groups_holding_thousands_of_keys_under_random_rescales():
    # two key groups: each gains keys by the thousand while its windows are open, so its index
    # grows wider under them; ownership moves between instances meanwhile
    batches = batches_of(8, n_batches=30, per_batch=200, keys=5000, int_keys=True)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.set_max_parallelism(2)
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(20)).with_timestamp_assigner(
        "f1"
    )
    assigner = SlidingEventTimeWindows.of(Time.milliseconds(30), Time.milliseconds(10))
    stream = env.from_source(ChannelSource("in", INT_RECORD), strategy, "in").key_by("f0").window(assigner)
    stream.aggregate(ALL).name("windows").sink_to(ChannelSink("out"))
    client = env.execute_async("wide index")
    writer, reader = channels.open_writer(client, "in"), channels.open_reader(client, "out")
    rng = random.Random(8)
    for b in batches:
        writer.write(b)
        if rng.random() < 0.3:
            client.rescale("windows", rng.choice([1, 2]))
    writer.end()
    got = rows(reader)
    assert client.wait().name == "FINISHED"
    want, _ = expected(batches, sliding(30, 10))
    assert got == want


def test_vectorized_windows_are_exact_across_a_worker_killed_at_random():
    rng = random.Random(11)
    n, keys = 30_000, 997

    def batch(i, count):
        idx = np.arange(i, i + count, dtype=np.int64)
        # keys spread so windows fire sparsely; one record in 16 is 40 ms late
        ts = idx - np.where(idx % 16 == 0, 40, 0)
        return pa.record_batch(
            [pa.array(idx * 7919 % keys), pa.array(np.maximum(ts, 0)), pa.array(idx)], INT_NAMES
        )

    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(50)
    src = DataGeneratorSource(
        batch_function=batch,
        count=n,
        rate_limiter_strategy=RateLimiterStrategy.per_second(60_000),
        batch_rows=500,
        type_info=INT_RECORD,
    )
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(50)).with_timestamp_assigner(
        "f1"
    )
    windows = TumblingEventTimeWindows.of(Time.milliseconds(20))
    stream = env.from_source(src, strategy, "events").key_by("f0").window(windows)
    stream.aggregate([A.count(), A.sum("f2")]).name("windows").sink_to(ChannelSink("out"))
    client = env.execute_async(f"vector-ckpt-{rng.randrange(1 << 40):x}")
    finish_after_a_kill(client, rng, after=(0.15, 0.3), stage="windows")  # an instance of the windows
    assert len(client._coordinator.recoveries) == 1
    got = sorted(tuple(r) for r in channels.open_reader(client, "out"))
    want: dict = {}
    for b in (batch(i, 500) for i in range(0, n, 500)):
        for k, t, v in zip(*(c.to_pylist() for c in b.columns)):
            c, s = want.get((k, t // 20), (0, 0))
            want[(k, t // 20)] = (c + 1, s + v)
    assert got == sorted((k, w * 20, w * 20 + 20, c, s) for (k, w), (c, s) in want.items())
