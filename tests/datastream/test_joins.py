"""Window joins, co-groups, interval joins and band joins against plain-Python models of Flink's
semantics (tests/datastream/flink_joins.py), at several parallelisms and under live rescales."""

from __future__ import annotations

import pickle
import random
import threading
import time

import pytest

from stretch import channels
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import (
    CoGroupFunction,
    JoinFunction,
    KeyedProcessFunction,
    OutputTag,
    ProcessJoinFunction,
    StreamExecutionEnvironment,
)
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.window import (
    EventTimeSessionWindows,
    SlidingEventTimeWindows,
    TumblingEventTimeWindows,
)
from tests.datastream import flink_joins as model
from tests.datastream.flink_windows import by_key, sliding, tumbling

RECORD = Types.TUPLE([Types.LONG(), Types.STRING(), Types.LONG(), Types.LONG()])  # side, key, ms, value
DELAY = 20


def batches_of(n_batches=30, per_batch=40, keys=5, seed=1, late_share=0.1):
    """Both sides mixed, mostly ascending event times, some out of order and some very late."""
    rng = random.Random(seed)
    t, out = 0, []
    for _ in range(n_batches):
        batch = []
        for _ in range(per_batch):
            t += rng.randrange(0, 4)
            ts = t - rng.randrange(0, 200) if rng.random() < late_share else t - rng.randrange(0, 15)
            batch.append((rng.randrange(2), f"k{rng.randrange(keys)}", max(ts, 0), rng.randrange(100)))
        out.append(batch)
    return out


def strategy(delay=DELAY):
    return WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(delay)).with_timestamp_assigner(
        "f2"
    )


def collect(client, name):
    out: list = []
    reader = channels.open_reader(client, name)
    t = threading.Thread(target=lambda: out.extend(reader), daemon=True)
    t.start()
    return out, t


class Job:
    """Both join inputs split from one channel (so the gate order is the input order), the
    result collected by a thread; ``late`` side outputs each into a list of their own."""

    def __init__(self, build, parallelism=2, late=(), then=None):
        env = StreamExecutionEnvironment.get_execution_environment()
        env.set_parallelism(parallelism)
        src = env.from_source(ChannelSource("in", RECORD), strategy(), "in")
        left = src.filter(lambda r: r[0] == 0)
        right = src.filter(lambda r: r[0] == 1)
        joined = build(left, right).name("join")
        (then(joined) if then else joined).sink_to(ChannelSink("out"))
        for i, tag in enumerate(late):
            joined.get_side_output(tag).sink_to(ChannelSink(f"late{i}"))
        self.client = env.execute_async("joins")
        self.writer = channels.open_writer(self.client, "in")
        self.out, reader = collect(self.client, "out")
        self.readers = [reader]
        self.late = []
        for i in range(len(late)):
            records, reader = collect(self.client, f"late{i}")
            self.late.append(records)
            self.readers.append(reader)

    def feed(self, batches, rescale_to=None, seed=5):
        rng = random.Random(seed)
        for b in batches:
            self.writer.write(b)
            if rescale_to and rng.random() < 0.3:
                report = self.client.rescale("join", rng.choice(rescale_to))
                assert report.state_bytes_copied == 0
        return self.finish()

    def finish(self):
        self.writer.end()
        for t in self.readers:
            t.join(60)
        assert self.client.wait().name == "FINISHED"
        return self


class Stamp(KeyedProcessFunction):
    """Passes results on with their record timestamp."""

    def process_element(self, value, ctx):
        yield value, ctx.timestamp()


def stamped(stream):
    return stream.key_by(repr).process(Stamp())


# ---- window join and co-group ------------------------------------------------------------------
class Pair(JoinFunction):
    def join(self, first, second):
        return first[1], first[3], second[3], first[2], second[2]


def pair(a, b):
    return a[1], a[3], b[3], a[2], b[2]


ASSIGNERS = {
    "tumbling": (TumblingEventTimeWindows.of(Time.milliseconds(25)), dict(assign=tumbling(25))),
    "sliding": (
        SlidingEventTimeWindows.of(Time.milliseconds(30), Time.milliseconds(10)),
        dict(assign=sliding(30, 10)),
    ),
    "session": (EventTimeSessionWindows.with_gap(Time.milliseconds(4)), dict(gap_of=lambda r: 4)),
}


def join_outputs(fired, ordered):
    """The model's outputs per key: in order, or (where the engine may permute a merged session's
    elements) sorted."""
    out = by_key([o for *_, outs in fired for o in outs])
    return out if ordered else {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("parallelism", [1, 2, 4])
@pytest.mark.parametrize("kind", sorted(ASSIGNERS))
def test_window_join_matches_flink(kind, parallelism):
    assigner, ref = ASSIGNERS[kind]
    batches = batches_of(seed=parallelism)
    fn = Pair() if parallelism % 2 else pair  # a JoinFunction or a plain callable
    job = Job(
        lambda a, b: a.join(b).where(lambda r: r[1]).equal_to(lambda r: r[1]).window(assigner).apply(fn),
        parallelism,
    ).feed(batches)
    want = model.window_join(batches, pair, DELAY, **ref)
    assert sum(len(outs) for *_, outs in want) > 100
    ordered = kind != "session"
    got = by_key(job.out) if ordered else {k: sorted(v) for k, v in by_key(job.out).items()}
    assert got == join_outputs(want, ordered)


def test_window_join_under_random_live_rescales():
    batches = batches_of(n_batches=60, seed=8)
    assigner = SlidingEventTimeWindows.of(Time.milliseconds(30), Time.milliseconds(10))
    job = Job(
        lambda a, b: a.join(b).where(lambda r: r[1]).equal_to(lambda r: r[1]).window(assigner).apply(pair)
    ).feed(batches, rescale_to=[1, 2, 3, 5, 8])
    assert by_key(job.out) == join_outputs(
        model.window_join(batches, pair, DELAY, assign=sliding(30, 10)), True
    )


def test_window_join_with_allowed_lateness_and_fields_as_keys():
    batches = batches_of(seed=6, late_share=0.25)
    assigner = TumblingEventTimeWindows.of(Time.milliseconds(25))
    job = Job(
        lambda a, b: a.join(b).where(1).equal_to("f1").window(assigner).allowed_lateness(40).apply(pair)
    ).feed(batches)
    want = model.window_join(batches, pair, DELAY, lateness=40, assign=tumbling(25))
    assert by_key(job.out) == join_outputs(want, True)


class Sides(CoGroupFunction):
    def co_group(self, first, second):
        key = (first or second)[0][1]
        yield key, sorted(r[3] for r in first), sorted(r[3] for r in second)


@pytest.mark.parametrize("kind", sorted(ASSIGNERS))
def test_co_group_matches_flink_with_window_timestamps(kind):
    assigner, ref = ASSIGNERS[kind]
    batches = batches_of(seed=11)
    job = Job(
        lambda a, b: (
            a.co_group(b).where(lambda r: r[1]).equal_to(lambda r: r[1]).window(assigner).apply(Sides())
        ),
        parallelism=3,
        then=stamped,
    ).feed(batches)
    fired = model.co_group(batches, Sides().co_group, DELAY, **ref)
    assert any(not outs[0][1] for *_, outs in fired) and any(not outs[0][2] for *_, outs in fired)
    want = [(o, end - 1) for _, _, end, outs in fired for o in outs]  # Flink: the window's max timestamp
    assert sorted(job.out) == sorted(want)


def test_window_join_of_two_sources():
    """Two sources: their interleaving in the gate varies, the result does not (nothing is late)."""
    batches = batches_of(seed=12, late_share=0)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    a = env.from_source(ChannelSource("a", RECORD), strategy(), "a")
    b = env.from_source(ChannelSource("b", RECORD), strategy(), "b")
    assigner = TumblingEventTimeWindows.of(Time.milliseconds(25))
    a.join(b).where(lambda r: r[1]).equal_to(lambda r: r[1]).window(assigner).apply(pair).sink_to(
        ChannelSink("out")
    )
    client = env.execute_async("two sources")
    writers = {side: channels.open_writer(client, name) for side, name in ((0, "a"), (1, "b"))}
    out, reader = collect(client, "out")
    for batch in batches:
        for side, w in writers.items():
            w.write([r for r in batch if r[0] == side])
    for w in writers.values():
        w.end()
    reader.join(60)
    assert client.wait().name == "FINISHED"
    want = model.window_join(batches, pair, 10**9, assign=tumbling(25))  # the same windows, all complete
    assert by_key(out) == join_outputs(want, True)


# ---- interval join -----------------------------------------------------------------------------
class Interval(ProcessJoinFunction):
    def process_element(self, left, right, ctx):
        yield left, right, ctx.get_left_timestamp(), ctx.get_right_timestamp(), ctx.get_timestamp()


LEFT_LATE = OutputTag("left-late", RECORD)
RIGHT_LATE = OutputTag("right-late", RECORD)


def interval(lower, upper, exclusive=False):
    def build(a, b):
        joined = a.key_by(lambda r: r[1]).interval_join(b.key_by(lambda r: r[1])).between(lower, upper)
        if exclusive:
            joined = joined.lower_bound_exclusive().upper_bound_exclusive()
        joined = joined.side_output_left_late_data(LEFT_LATE).side_output_right_late_data(RIGHT_LATE)
        return joined.process(Interval())

    return build


def interval_want(batches, lower, upper):
    pairs, late_left, late_right = model.interval_join(batches, lower, upper, DELAY)
    return sorted((a, b, a[2], b[2], ts) for a, b, ts in pairs), sorted(late_left), sorted(late_right)


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_interval_join_matches_flink_with_late_elements(parallelism):
    batches = batches_of(seed=20 + parallelism, late_share=0.15)
    job = Job(interval(-7, 12), parallelism, late=(LEFT_LATE, RIGHT_LATE)).feed(batches)
    want, late_left, late_right = interval_want(batches, -7, 12)
    assert len(want) > 300 and late_left and late_right
    assert sorted(job.out) == want
    assert sorted(job.late[0]) == late_left
    assert sorted(job.late[1]) == late_right


def test_interval_join_exclusive_bounds_and_output_timestamps():
    batches = batches_of(seed=31, late_share=0.1)
    job = Job(interval(Time.milliseconds(2), Time.milliseconds(15), exclusive=True), 2, then=stamped)
    job.feed(batches)
    want, _, _ = interval_want(batches, 3, 14)  # Flink moves exclusive bounds inwards by 1 ms
    assert want
    assert sorted(job.out) == sorted((o, o[4]) for o in want)  # timestamp: the later element's


def test_interval_join_under_random_live_rescales():
    batches = batches_of(n_batches=60, seed=40, late_share=0.15)
    job = Job(interval(-10, 0), 2, late=(LEFT_LATE, RIGHT_LATE)).feed(batches, rescale_to=[1, 2, 3, 5, 8])
    want, late_left, late_right = interval_want(batches, -10, 0)
    assert sorted(job.out) == want
    assert sorted(job.late[0]) == late_left
    assert sorted(job.late[1]) == late_right


def test_interval_join_rejects_crossed_bounds():
    env = StreamExecutionEnvironment.get_execution_environment()
    ds = env.from_collection([(0, "k", 0, 0)], RECORD)
    with pytest.raises(ValueError):
        ds.key_by(lambda r: r[1]).interval_join(ds.key_by(lambda r: r[1])).between(5, 1)
    with pytest.raises(TypeError):
        ds.key_by(lambda r: r[1]).interval_join(ds)


# ---- band join ---------------------------------------------------------------------------------
def near(left, right):
    return (left[3] + right[3]) % 3 != 0


def band(bound, predicate=near):
    return lambda a, b: a.band_join(b).on(predicate).within(bound).apply(lambda x, y: (x, y))


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_band_join_produces_every_pair_once(parallelism):
    batches = batches_of(seed=50 + parallelism, late_share=0.1)
    job = Job(band(15), parallelism, then=stamped).feed(batches)
    pairs, _ = model.band_join(batches, 15, near, DELAY)
    assert len(pairs) > 1000
    assert sorted(job.out) == sorted(((a, b), ts) for a, b, ts in pairs)


def buffered(client) -> tuple[list, dict]:
    """The band join's buffered records, and how many each key group holds."""
    table = client.query_state("join")
    records, per_kg = [], {}
    if "band join buffer" not in table.column_names:  # no instance has declared its state yet
        return records, per_kg
    for kg, raw in zip(table.column("key_group").to_pylist(), table.column("band join buffer").to_pylist()):
        elements = pickle.loads(raw) if isinstance(raw, bytes) else raw or []
        records += [record for _, _, record in elements]
        per_kg[kg] = per_kg.get(kg, 0) + len(elements)
    return sorted(records), per_kg


def wait_for_buffer(client, want, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        records, per_kg = buffered(client)
        if records == want or time.monotonic() > deadline:
            assert records == want
            return per_kg


def per_instance(per_kg, parallelism, max_parallelism=128):
    counts = [0] * parallelism
    for kg, n in per_kg.items():
        counts[kg * parallelism // max_parallelism] += n
    return counts


def test_band_join_spreads_its_window_over_instances_and_rescales_without_copying():
    batches = batches_of(n_batches=60, seed=60, late_share=0.05)
    within = 2000
    same = lambda a, b: a[3] == b[3]  # noqa: E731
    pairs, snapshots = model.band_join(batches, within, same, DELAY)
    job = Job(band(within, same), parallelism=4)
    for b in batches[:20]:
        job.writer.write(b)
    per_kg = wait_for_buffer(job.client, snapshots[19])
    total = sum(per_kg.values())
    assert total > 600
    assert len(per_kg) == 128  # round robin: every key group holds part of the window
    for n in per_instance(per_kg, 4):
        assert abs(n - total / 4) <= 0.2 * total / 4
    report = job.client.rescale("join", 2)
    assert report.state_bytes_copied == 0
    assert wait_for_buffer(job.client, snapshots[19]) == per_kg  # nothing moved
    for n in per_instance(per_kg, 2):
        assert abs(n - total / 2) <= 0.2 * total / 2
    rng = random.Random(3)
    for i, b in enumerate(batches[20:], start=20):
        job.writer.write(b)
        if rng.random() < 0.3:
            assert job.client.rescale("join", rng.choice([1, 2, 3, 5, 8])).state_bytes_copied == 0
        if i == 50:
            assert len(snapshots[50]) < len(snapshots[40])  # old elements expire with the watermark
            wait_for_buffer(job.client, snapshots[50])
    job.finish()
    assert len(pairs) > 1000
    assert sorted(job.out) == sorted((a, b) for a, b, _ in pairs)


def test_band_join_needs_a_band():
    env = StreamExecutionEnvironment.get_execution_environment()
    ds = env.from_collection([(0, "k", 0, 0)], RECORD)
    with pytest.raises(ValueError):
        ds.band_join(ds).on(near).apply(lambda a, b: (a, b))
    with pytest.raises(TypeError):
        ds.band_join(ds).on(3)


class PairAnew(ProcessJoinFunction):
    def process_element(self, left, right, ctx):
        yield (*pair(left, right), "new")


class PairOld(ProcessJoinFunction):
    def process_element(self, left, right, ctx):
        yield pair(left, right)


@pytest.mark.parametrize("kind", ["window join", "interval join"])
def test_a_live_update_of_the_join_function_takes_over_from_one_record(kind):
    """The pairs are the model's; those made before the update come from the old function and
    the rest from the new one. A window join's key fires its windows in order, so per key every
    old window comes before every new one."""
    batches = batches_of(seed=7)
    if kind == "window join":
        assigner = TumblingEventTimeWindows.of(Time.milliseconds(25))
        job = Job(
            lambda a, b: (
                a.join(b).where(lambda r: r[1]).equal_to(lambda r: r[1]).window(assigner).apply(Pair())
            )
        )
        new = lambda a, b: (*pair(a, b), "new")  # noqa: E731
        want = [o for *_, outs in model.window_join(batches, pair, DELAY, assign=tumbling(25)) for o in outs]
    else:
        job = Job(
            lambda a, b: (
                a.key_by(lambda r: r[1])
                .interval_join(b.key_by(lambda r: r[1]))
                .between(-5, 5)
                .process(PairOld())
            )
        )
        new = PairAnew()
        want = [pair(a, b) for a, b, _ in model.interval_join(batches, -5, 5, DELAY)[0]]
    for b in batches[:15]:
        job.writer.write(b)
    deadline = time.monotonic() + 30
    while len(job.out) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    job.client.update("join", new)
    for b in batches[15:]:
        job.writer.write(b)
    job.finish()
    old = [tuple(o) for o in job.out if len(o) == 5]
    fresh = [tuple(o[:5]) for o in job.out if len(o) == 6]
    assert old and fresh
    assert sorted(old + fresh) == sorted(want)
    if kind == "window join":
        for key in {o[0] for o in fresh}:
            last_old = max((o[3] // 25 for o in old if o[0] == key), default=-1)
            assert last_old < min(o[3] // 25 for o in fresh if o[0] == key)
