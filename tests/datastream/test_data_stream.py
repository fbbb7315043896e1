"""DataStream and KeyedStream calls with the results PyFlink gives, each against a plain-Python model.

The expectations follow Flink's own sources (flink-python/pyflink/datastream/data_stream.py and
window.py): what ``ctx.timestamp()`` is in a ProcessFunction, where side outputs go, how rolling
reductions and count windows behave, and what a KeyedStream collects as.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from stretch.common import Row, Types, WatermarkStrategy
from stretch.common.watermark_strategy import TimestampAssigner
from stretch.datastream import (
    MapFunction,
    OutputTag,
    ProcessFunction,
    ReduceFunction,
    StreamExecutionEnvironment,
)
from stretch.datastream.connectors.print_sink import PrintSink

PARALLELISM = [1, 2, 4]


def env_of(parallelism: int) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    return env


class SecondField(TimestampAssigner):
    def extract_timestamp(self, value, record_timestamp):
        return value[1]


class TimestampAndParity(ProcessFunction):
    """Yields each record with its timestamp; odd values also to a side output (PyFlink's way)."""

    def __init__(self, tag):
        self.tag = tag

    def process_element(self, value, ctx):
        yield value[0], ctx.timestamp()
        if value[2] % 2:
            yield self.tag, value[2]


def records(n=200, keys=5, seed=3):
    rng = random.Random(seed)
    return [(f"k{rng.randrange(keys)}", 1000 + i, rng.randrange(100)) for i in range(n)]


RECORD = Types.TUPLE([Types.STRING(), Types.LONG(), Types.INT()])


def _processed(parallelism: int, keyed: bool, tag: OutputTag, data: list):
    env = env_of(parallelism)
    ds = env.from_collection(data, RECORD).assign_timestamps_and_watermarks(
        WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner(SecondField())
    )
    if keyed:  # the non-keyed process then runs chained into a keyed operator's instances
        ds = ds.key_by(lambda r: r[0]).map(lambda r: r, output_type=RECORD)
    return ds.process(TimestampAndParity(tag), output_type=Types.TUPLE([Types.STRING(), Types.LONG()]))


@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("parallelism", PARALLELISM)
def test_process_function_sees_record_timestamps_and_splits_side_outputs(parallelism, keyed):
    data = records()
    tag = OutputTag("odd", Types.INT())
    got_main = sorted(_processed(parallelism, keyed, tag, data).execute_and_collect())
    got_side = sorted(_processed(parallelism, keyed, tag, data).get_side_output(tag).execute_and_collect())
    assert got_main == sorted((k, ts) for k, ts, _ in data)
    assert got_side == sorted(v for _, _, v in data if v % 2)


def test_process_function_without_timestamps_sees_none_and_no_timers():
    env = env_of(1)

    class Probe(ProcessFunction):
        def process_element(self, value, ctx):
            try:
                ctx.timer_service().register_event_time_timer(5)
                refused = False
            except RuntimeError:
                refused = True
            yield value, ctx.timestamp(), refused, ctx.timer_service().current_processing_time() > 0

    out = env.from_collection([1, 2]).process(Probe()).execute_and_collect(limit=10)
    assert sorted(out) == [(1, None, True, True), (2, None, True, True)]


class OpenedSum(ReduceFunction):
    """Refuses to reduce unless open() ran in this instance; adds an offset set in open()."""

    def open(self, runtime_context):
        self.offset = 0
        self.index = runtime_context.get_index_of_this_subtask()

    def reduce(self, a, b):
        return a[0], a[1], a[2] + b[2] + self.offset


@pytest.mark.parametrize("parallelism", PARALLELISM)
def test_keyed_reduce_calls_open(parallelism):
    data = records(120)
    out = env_of(parallelism).from_collection(data, RECORD).key_by(lambda r: r[0]).reduce(OpenedSum())
    got = sorted(out.execute_and_collect())
    running, want = defaultdict(int), []
    first = {}
    for k, ts, v in data:
        first.setdefault(k, ts)
        running[k] += v
        want.append((k, first[k], running[k]))
    assert got == sorted(want)


@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("parallelism", PARALLELISM)
def test_rolling_min_max_on_a_string_field(parallelism, op):
    rng = random.Random(5)
    data = [(f"k{rng.randrange(4)}", "".join(rng.choices("abcxyz", k=3)), i) for i in range(150)]
    typ = Types.TUPLE([Types.STRING(), Types.STRING(), Types.INT()])
    ks = env_of(parallelism).from_collection(data, typ).key_by(lambda r: r[0])
    got = sorted(getattr(ks, op)(1).execute_and_collect())
    best, firsts, want = {}, {}, []
    pick = min if op == "min" else max
    for k, s, i in data:  # the other fields keep the key's first record's values, as in PyFlink
        firsts.setdefault(k, (k, s, i))
        best[k] = pick(best.get(k, s), s)
        want.append((k, best[k], firsts[k][2]))
    assert got == sorted(want)


@pytest.mark.parametrize("parallelism", PARALLELISM)
def test_sliding_count_window_fires_full_windows_only(parallelism):
    ks = env_of(parallelism).from_collection([("a", 1), ("a", 3), ("a", 5)]).key_by(lambda r: r[0])
    out = ks.count_window(2, 1).reduce(lambda a, b: (a[0], a[1] + b[1])).execute_and_collect()
    assert sorted(v for _, v in out) == [4, 8]  # windows {1,3} and {3,5}; never {1} alone


@pytest.mark.parametrize("parallelism", PARALLELISM)
def test_sliding_count_window_with_slide_above_size(parallelism):
    values = list(range(1, 12))
    ks = env_of(parallelism).from_collection([("a", v) for v in values]).key_by(lambda r: r[0])
    out = ks.count_window(2, 3).apply(lambda key, window, rs: [(window.id, [r[1] for r in rs])])
    got = sorted(out.execute_and_collect())
    # window i covers the records i*3 .. i*3+1 (0-based); records between windows are in none
    want = [(i, values[3 * i : 3 * i + 2]) for i in range(len(values)) if 3 * i + 2 <= len(values)]
    assert got == want


@pytest.mark.parametrize("parallelism", PARALLELISM)
def test_key_selector_may_return_a_list(parallelism):
    data = [(i % 3, i % 2, i) for i in range(60)]
    ks = env_of(parallelism).from_collection(data).key_by(lambda r: [r[0], r[1]])
    got = sorted(ks.reduce(lambda a, b: (a[0], a[1], a[2] + b[2])).execute_and_collect())
    running, want = defaultdict(int), []
    for a, b, v in data:
        running[(a, b)] += v
        want.append((a, b, running[(a, b)]))
    assert got == sorted(want)


@pytest.mark.parametrize("parallelism", PARALLELISM)
def test_keyed_stream_collects_key_and_value_rows(parallelism):
    data = [(i, f"v{i % 4}") for i in range(40)]
    keyed = env_of(parallelism).from_collection(data).key_by(lambda r: r[1])
    got = list(keyed.execute_and_collect())
    assert sorted(got, key=lambda r: r[1]) == [Row(f0=v[1], f1=v) for v in data]
    assert all(r.as_dict() == {"f0": r[0], "f1": r[1]} for r in got)


def test_keyed_stream_by_field_collects_key_and_value_rows():
    typ = Types.ROW_NAMED(["id", "name"], [Types.INT(), Types.STRING()])
    env = env_of(2)
    got = env.from_collection([(1, "a"), (2, "b")], typ).key_by("name").execute_and_collect(limit=10)
    assert sorted((r.f0, tuple(r.f1)) for r in got) == [("a", (1, "a")), ("b", (2, "b"))]


def test_print_of_a_row_is_flinks_row_kind_and_comma_joined_fields(capsys):
    # PyFlink's DataStream.print() formats ROW records as '{row_kind}[{','.join(fields)}]'
    # (_align_output_type in pyflink/datastream/data_stream.py): no space after the comma
    env = env_of(1)
    env.from_collection([(1, "a"), (2, None)], Types.ROW([Types.INT(), Types.STRING()])).print()
    env.execute()
    lines = capsys.readouterr().out.split()
    assert lines == ["+I[1,a]", "+I[2,None]"]


class Tens(MapFunction):
    def map(self, value):
        return value * 10


def test_misuses_are_named_by_the_method_called_and_a_class_asks_for_an_instance():
    env = env_of(1)
    stream = env.from_collection([1, 2])
    for sink_method in ("sink_to", "add_sink"):
        for on in (stream, stream.key_by(lambda x: x)):
            with pytest.raises(TypeError, match=rf"^{sink_method} expects a stretch Sink .*got \[1\]$"):
                getattr(on, sink_method)([1])
            with pytest.raises(
                TypeError, match=rf"^{sink_method}: got the class PrintSink; pass an instance, PrintSink\(\)$"
            ):
                getattr(on, sink_method)(PrintSink)
    with pytest.raises(TypeError, match=r"^map: got the class Tens; pass an instance, Tens\(\)$"):
        stream.map(Tens)
    with pytest.raises(
        TypeError, match=r"The input must be a MapFunction or a callable function! \(map got 5\)"
    ):
        stream.map(5)
    assert sorted(stream.map(str).execute_and_collect(limit=2)) == ["1", "2"]  # a plain class is a callable
