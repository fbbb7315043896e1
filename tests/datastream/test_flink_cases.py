"""Apache Flink's own PyFlink DataStream test cases and examples, run on stretch.

stretch promises that a PyFlink DataStream program runs by changing its imports from ``pyflink``
to ``stretch``. Each case here is one of Flink's (named in its comment: a method of
``flink-python/pyflink/datastream/tests/test_data_stream.py`` or ``test_window.py``, or a script
under ``flink-python/pyflink/examples/datastream/``), restated with Flink's inputs, the same
calls, and Flink's expected output; Flink's expectations are the independent reference. The
examples print instead of asserting: here they collect what they would print (one of them prints),
checked against Flink's comments or a plain-Python model of the program.
``DataStreamTestSinkFunction`` is a stand-in for Flink's (tests/datastream/flink_test_sink.py);
lines that only configure PyFlink's Java runner are left out. Flink runs these tests at
parallelism 2 unless a case sets it; so do these (a case's group says which). The porting guide
(docs/guides/porting-from-pyflink.md) lists the cases that differ on purpose and those left out.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import json
import pathlib
import shutil
import tempfile
from collections import defaultdict

import pytest

from stretch.common import Duration, Row
from stretch.common.time import Time
from stretch.common.typeinfo import Types
from stretch.common.watermark_strategy import TimestampAssigner, WatermarkStrategy
from stretch.datastream import (
    RuntimeContext,
    RuntimeExecutionMode,
    StreamExecutionEnvironment,
    TimeCharacteristic,
)
from stretch.datastream.functions import (
    AggregateFunction,
    CoFlatMapFunction,
    CoMapFunction,
    CoProcessFunction,
    FilterFunction,
    FlatMapFunction,
    KeyedCoProcessFunction,
    KeyedProcessFunction,
    KeySelector,
    MapFunction,
    ProcessAllWindowFunction,
    ProcessFunction,
    ProcessWindowFunction,
    ReduceFunction,
    WindowFunction,
)
from stretch.datastream.output_tag import OutputTag
from stretch.datastream.state import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
)
from stretch.datastream.window import (
    ContinuousEventTimeTrigger,
    CountSlidingWindowAssigner,
    CountTrigger,
    EventTimeSessionWindows,
    EventTimeTrigger,
    GlobalWindows,
    PurgingTrigger,
    SessionWindowTimeGapExtractor,
    SlidingEventTimeWindows,
    TumblingEventTimeWindows,
)
from stretch.metrics import Counter, Distribution, Meter
from tests.datastream import flink_windows
from tests.datastream.flink_test_sink import DataStreamTestSinkFunction

STR_INT_ROW = Types.ROW([Types.STRING(), Types.INT()])
STR_INT_TUPLE = Types.TUPLE([Types.STRING(), Types.INT()])
INT_STR_TUPLE = Types.TUPLE([Types.INT(), Types.STRING()])
WINDOW_COUNT = Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG(), Types.INT()])


@pytest.fixture
def env():
    """Flink's PyFlinkStreamingTestCase environment: streaming, parallelism 2."""
    environment = StreamExecutionEnvironment.get_execution_environment()
    environment.set_parallelism(2)
    environment.set_runtime_mode(RuntimeExecutionMode.STREAMING)
    return environment


@pytest.fixture
def sink():
    return DataStreamTestSinkFunction()


# Most cases are grouped: each group's cases build their pipelines in one environment, which runs
# them as one job (a job's start costs more than these cases' records); each case then checks its
# own sinks, and reports as a test of its own. A case is a function that adds its pipeline to the
# environment and returns the check to run once the job has finished.
GROUPS = {
    "parallelism 2": (RuntimeExecutionMode.STREAMING, 2),
    "parallelism 1": (RuntimeExecutionMode.STREAMING, 1),
    "batch": (RuntimeExecutionMode.BATCH, 2),
    "batch, parallelism 1": (RuntimeExecutionMode.BATCH, 1),
}
CASES: dict = {}  # case name -> (group, build)
_RUNS: dict = {}  # group -> ({case name: check}, the job's error or None)


def case(group: str):
    def register(build):
        CASES[build.__name__] = (group, build)
        return build

    return register


def _built(build, environment):
    """The case's check; if building its pipeline fails, a check that raises that error."""
    try:
        return build(environment)
    except Exception as error:

        def refused(error=error):
            raise error

        return refused


def run_group(group: str):
    if group not in _RUNS:
        mode, parallelism = GROUPS[group]
        environment = StreamExecutionEnvironment.get_execution_environment()
        environment.set_parallelism(parallelism)
        environment.set_runtime_mode(mode)
        checks = {name: _built(build, environment) for name, (g, build) in CASES.items() if g == group}
        try:
            environment.execute(f"Flink's cases, {group}")
            _RUNS[group] = (checks, None)
        except Exception as error:  # every case of the group reports it
            _RUNS[group] = (checks, error)
    return _RUNS[group]


class SecondColumnTimestampAssigner(TimestampAssigner):
    def extract_timestamp(self, value, record_timestamp) -> int:
        return int(value[1])


def by_second_column():
    return WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner(
        SecondColumnTimestampAssigner()
    )


class SecondField(KeySelector):
    def get_key(self, value):
        return value[1]


# ---- test_data_stream.py: basic operations, state, co-operations ----------------------------------


@case("parallelism 2")
def basic_operations(env):
    """DataStreamTests.test_basic_operations"""
    sink = DataStreamTestSinkFunction()
    source = env.from_collection(
        [
            (word, Row(word[0], decimal.Decimal(n)))
            for n, word in enumerate(["ab", "bdc", "cfgs", "deeefg"], 1)
        ],
        type_info=Types.TUPLE([Types.STRING(), Types.ROW([Types.STRING(), Types.BIG_DEC()])]),
    )
    triple = Types.TUPLE([Types.STRING(), Types.INT(), Types.BIG_DEC()])

    class PlusOne(MapFunction):
        def map(self, value):
            return Row(value[0], value[1] + 1, value[2])

    class EvenLength(FlatMapFunction):
        def flat_map(self, value):
            if value[1] % 2 == 0:
                yield value

    class LongerThanTwo(FilterFunction):
        def filter(self, value):
            return value[1] > 2

    (
        source.map(lambda r: (r[0], len(r[0]), r[1][1]), output_type=triple)
        .flat_map(EvenLength(), output_type=triple)
        .filter(LongerThanTwo())
        .map(PlusOne(), output_type=Types.ROW([Types.STRING(), Types.INT(), Types.BIG_DEC()]))
        .add_sink(sink)
    )

    def check():
        assert sorted(sink.get_results()) == ["+I[cfgs, 5, 3]", "+I[deeefg, 7, 4]"]

    return check


@case("parallelism 2")
def keyed_process_function_with_state(env):
    """DataStreamTests.test_keyed_process_function_with_state (value, list and TTL'd map state)"""
    sink = DataStreamTestSinkFunction()
    env.get_config().set_auto_watermark_interval(2000)
    env.set_stream_time_characteristic(TimeCharacteristic.EventTime)
    rows = [(1, "hi", "1603708211000"), (2, "hello", "1603708224000"), (3, "hi", "1603708226000")]
    rows += [(4, "hello", "1603708289000"), (5, "hi", "1603708291000"), (6, "hello", "1603708293000")]
    source = env.from_collection(rows, type_info=Types.ROW([Types.INT(), Types.STRING(), Types.STRING()]))

    class ThirdColumn(TimestampAssigner):
        def extract_timestamp(self, value, record_timestamp) -> int:
            return int(value[2])

    class Describe(KeyedProcessFunction):
        def open(self, runtime_context: RuntimeContext):
            self.last = runtime_context.get_state(ValueStateDescriptor("value_state", Types.INT()))
            self.seen = runtime_context.get_list_state(ListStateDescriptor("list_state", Types.INT()))
            by_id = MapStateDescriptor("map_state", Types.INT(), Types.STRING())
            by_id.enable_time_to_live(
                StateTtlConfig.new_builder(Time.seconds(1))
                .set_update_type(StateTtlConfig.UpdateType.OnReadAndWrite)
                .set_state_visibility(StateTtlConfig.StateVisibility.ReturnExpiredIfNotCleanedUp)
                .disable_cleanup_in_background()
                .build()
            )
            self.by_id = runtime_context.get_map_state(by_id)

        def process_element(self, value, ctx):
            before, self_list = self.last.value(), list(self.seen.get())
            entries = dict(self.by_id.items())
            mapped = "{" + ", ".join(f"{k}: {entries[k]}" for k in sorted(entries)) + "}"
            self.last.update(value[0])
            self.seen.add(value[0])
            self.by_id.put(value[0], value[1])
            yield (
                f"current key: {ctx.get_current_key()}, current value state: {before}, "
                f"current list state: {self_list}, current map state: {mapped}, current value: {value}"
            )

    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner(ThirdColumn())
    source.assign_timestamps_and_watermarks(strategy).key_by(lambda r: r[1], key_type=Types.STRING()).process(
        Describe(), output_type=Types.STRING()
    ).add_sink(sink)

    def check():

        def line(key, value_state, list_state, map_state, f0, ts):
            return (
                f"current key: {key}, current value state: {value_state}, current list state: {list_state}, "
                f"current map state: {map_state}, current value: Row(f0={f0}, f1='{key}', f2='{ts}')"
            )

        assert sorted(sink.get_results()) == sorted(
            [
                line("hi", None, [], "{}", 1, 1603708211000),
                line("hello", None, [], "{}", 2, 1603708224000),
                line("hi", 1, [1], "{1: hi}", 3, 1603708226000),
                line("hello", 2, [2], "{2: hello}", 4, 1603708289000),
                line("hi", 3, [1, 3], "{1: hi, 3: hi}", 5, 1603708291000),
                line("hello", 4, [2, 4], "{2: hello, 4: hello}", 6, 1603708293000),
            ]
        )

    return check


HI_HELLO = [(1, "hi"), (2, "hello"), (3, "hi"), (4, "hello"), (5, "hi"), (6, "hello")]
RUNNING_SUMS = ["(1,hi)", "(12,hello)", "(2,hello)", "(4,hi)", "(6,hello)", "(9,hi)"]


@case("parallelism 2")
def reducing_state(env):
    """DataStreamTests.test_reducing_state"""
    sink = DataStreamTestSinkFunction()

    class RunningSum(KeyedProcessFunction):
        def open(self, runtime_context: RuntimeContext):
            self.total = runtime_context.get_reducing_state(
                ReducingStateDescriptor("reducing_state", lambda a, b: a + b, Types.INT())
            )

        def process_element(self, value, ctx):
            self.total.add(value[0])
            yield self.total.get(), value[1]

    env.from_collection(HI_HELLO, type_info=INT_STR_TUPLE).key_by(
        lambda r: r[1], key_type=Types.STRING()
    ).process(RunningSum(), output_type=INT_STR_TUPLE).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == RUNNING_SUMS

    return check


@case("parallelism 2")
def aggregating_state(env):
    """DataStreamTests.test_aggregating_state (with a TTL)"""
    sink = DataStreamTestSinkFunction()

    class Sum(AggregateFunction):
        def create_accumulator(self):
            return 0

        def add(self, value, accumulator):
            return value + accumulator

        def get_result(self, accumulator):
            return accumulator

        def merge(self, acc_a, acc_b):
            return acc_a + acc_b

    class RunningSum(KeyedProcessFunction):
        def open(self, runtime_context: RuntimeContext):
            descriptor = AggregatingStateDescriptor("aggregating_state", Sum(), Types.INT())
            descriptor.enable_time_to_live(
                StateTtlConfig.new_builder(Time.seconds(1))
                .set_update_type(StateTtlConfig.UpdateType.OnReadAndWrite)
                .disable_cleanup_in_background()
                .build()
            )
            self.total = runtime_context.get_aggregating_state(descriptor)

        def process_element(self, value, ctx):
            self.total.add(value[0])
            yield self.total.get(), value[1]

    env.from_collection(HI_HELLO, type_info=INT_STR_TUPLE).key_by(
        lambda r: r[1], key_type=Types.STRING()
    ).process(RunningSum(), output_type=INT_STR_TUPLE).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == RUNNING_SUMS

    return check


class IncDec(CoFlatMapFunction):
    def flat_map1(self, value):
        yield value + 1

    def flat_map2(self, value):
        yield value - 1


CO_OPERATIONS = sorted(["4", "5", "6", "7", "8", "3", "5", "7", "9", "11", "3", "5", "7", "9", "11"])


@case("parallelism 2")
def basic_co_operations(env):
    """DataStreamTests.test_basic_co_operations (map1 imports a module added by add_python_file)"""
    sink = DataStreamTestSinkFunction()
    folder = pathlib.Path(tempfile.mkdtemp())
    library = folder / "test_stream_dependency_manage_lib.py"
    library.write_text("def add_two(a):\n    return a + 2\n")

    class AddTwoOrOne(CoMapFunction):
        def map1(self, value):
            from test_stream_dependency_manage_lib import add_two

            return add_two(value)

        def map2(self, value):
            return value + 1

    env.add_python_file(str(library))
    numbers = env.from_collection([1, 2, 3, 4, 5])
    doubled = numbers.map(lambda x: x * 2)
    numbers.connect(doubled).flat_map(IncDec()).connect(doubled).map(AddTwoOrOne()).add_sink(sink)

    def check():
        shutil.rmtree(folder)
        assert sorted(sink.get_results(True)) == CO_OPERATIONS

    return check


@case("parallelism 2")
def basic_co_operations_with_output_type(env):
    """ProcessDataStreamTests.test_basic_co_operations_with_output_type"""
    sink = DataStreamTestSinkFunction()

    class AddTwoOrOne(CoMapFunction):
        def map1(self, value):
            return value + 2

        def map2(self, value):
            return value + 1

    numbers = env.from_collection([1, 2, 3, 4, 5])
    doubled = numbers.map(lambda x: x * 2)
    numbers.connect(doubled).flat_map(IncDec(), output_type=Types.INT()).connect(doubled).map(
        AddTwoOrOne(), output_type=Types.INT()
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == CO_OPERATIONS

    return check


class CountPerKeyWithTimer(KeyedCoProcessFunction):
    """Flink's MyKeyedCoProcessFunction: counts per key over both inputs, one timer at 3."""

    def open(self, runtime_context: RuntimeContext):
        self.timer_registered = False
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.INT()))

    def _bump(self, value):
        count = (self.count.value() or 0) + 1
        self.count.update(count)
        return [Row(value[0], count)]

    def process_element1(self, value, ctx):
        if not self.timer_registered:
            ctx.timer_service().register_event_time_timer(3)
            self.timer_registered = True
        return self._bump(value)

    def process_element2(self, value, ctx):
        return self._bump(value)

    def on_timer(self, timestamp, ctx):
        return [Row("on_timer", timestamp)]


@case("parallelism 1")
def keyed_co_process(env):
    """DataStreamTests.test_keyed_co_process"""
    sink = DataStreamTestSinkFunction()
    left = env.from_collection([("a", 1), ("b", 2), ("c", 3)], type_info=STR_INT_ROW)
    right = env.from_collection([("b", 2), ("c", 3), ("d", 4)], type_info=STR_INT_ROW)
    left = left.assign_timestamps_and_watermarks(by_second_column())
    right = right.assign_timestamps_and_watermarks(by_second_column())
    left.connect(right).key_by(lambda r: r[0], lambda r: r[0]).process(CountPerKeyWithTimer()).map(
        lambda r: Row(r[0], r[1] + 1)
    ).add_sink(sink)

    def check():
        expected = ["<Row('a', 2)>", "<Row('b', 2)>", "<Row('b', 3)>", "<Row('c', 2)>", "<Row('c', 3)>"]
        assert sorted(sink.get_results(True)) == expected + ["<Row('d', 2)>", "<Row('on_timer', 4)>"]

    return check


# ---- test_data_stream.py: side outputs ------------------------------------------------------------

SIDE = OutputTag("side", Types.INT())
ABC = [("a", 0), ("b", 1), ("c", 2)]


class NameAndSideNumber(ProcessFunction):
    def process_element(self, value, ctx):
        yield value[0]
        yield SIDE, value[1]


def main_and_side(env, stream, tag=SIDE):
    main, side = DataStreamTestSinkFunction(), DataStreamTestSinkFunction()
    stream.add_sink(main)
    stream.get_side_output(tag).add_sink(side)
    return main, side


@case("parallelism 2")
def process_side_output(env):
    """DataStreamTests.test_process_side_output"""
    stream = env.from_collection(ABC, type_info=STR_INT_ROW).process(
        NameAndSideNumber(), output_type=Types.STRING()
    )
    main, side = main_and_side(env, stream)

    def check():
        assert sorted(main.get_results()) == ["a", "b", "c"]
        assert sorted(side.get_results()) == ["0", "1", "2"]

    return check


@case("parallelism 2")
def side_output_chained_with_upstream_operator(env):
    """DataStreamTests.test_side_output_chained_with_upstream_operator"""
    source = env.from_collection(ABC, type_info=STR_INT_ROW)
    stream = source.map(lambda r: (r[0], r[1] + 1)).process(NameAndSideNumber(), output_type=Types.STRING())
    main, side = main_and_side(env, stream)

    def check():
        assert sorted(main.get_results()) == ["a", "b", "c"]
        assert sorted(side.get_results()) == ["1", "2", "3"]

    return check


@case("parallelism 2")
def process_multiple_side_output(env):
    """DataStreamTests.test_process_multiple_side_output"""
    numbers, labels = OutputTag("side1", Types.INT()), OutputTag("side2", Types.STRING())

    class ThreeWays(ProcessFunction):
        def process_element(self, value, ctx):
            yield value[0]
            yield numbers, value[1]
            yield labels, value[0] + str(value[1])

    stream = env.from_collection(ABC, type_info=STR_INT_ROW).process(ThreeWays(), output_type=Types.STRING())
    main, side1 = main_and_side(env, stream, numbers)
    side2 = DataStreamTestSinkFunction()
    stream.get_side_output(labels).add_sink(side2)

    def check():
        assert sorted(main.get_results()) == ["a", "b", "c"]
        assert sorted(side1.get_results()) == ["0", "1", "2"]
        assert sorted(side2.get_results()) == ["a0", "b1", "c2"]

    return check


@case("parallelism 2")
def co_process_side_output(env):
    """DataStreamTests.test_co_process_side_output"""

    class Swap(CoProcessFunction):
        def process_element1(self, value, ctx):
            yield value[0]
            yield SIDE, value[1]

        def process_element2(self, value, ctx):
            yield value[1]
            yield SIDE, value[0]

    left = env.from_collection(ABC, type_info=STR_INT_ROW)
    right = env.from_collection(
        [(3, "c"), (1, "a"), (0, "d")], type_info=Types.ROW([Types.INT(), Types.STRING()])
    )
    main, side = main_and_side(env, left.connect(right).process(Swap(), output_type=Types.STRING()))

    def check():
        assert sorted(main.get_results()) == ["a", "a", "b", "c", "c", "d"]
        assert sorted(side.get_results()) == ["0", "0", "1", "1", "2", "3"]

    return check


@case("parallelism 2")
def keyed_process_side_output(env):
    """DataStreamTests.test_keyed_process_side_output"""

    class RunningSumToSide(KeyedProcessFunction):
        def open(self, context: RuntimeContext):
            self.total = context.get_reducing_state(
                ReducingStateDescriptor("reduce", lambda i, j: i + j, Types.INT())
            )

        def process_element(self, value, ctx):
            yield value[1]
            self.total.add(value[1])
            yield SIDE, self.total.get()

    source = env.from_collection([("a", 1), ("b", 2), ("a", 3), ("b", 4)], type_info=STR_INT_ROW)
    main, side = main_and_side(
        env, source.key_by(lambda r: r[0]).process(RunningSumToSide(), output_type=Types.INT())
    )

    def check():
        assert sorted(main.get_results()) == ["1", "2", "3", "4"]
        assert sorted(side.get_results()) == ["1", "2", "4", "6"]

    return check


@case("parallelism 2")
def keyed_co_process_side_output(env):
    """DataStreamTests.test_keyed_co_process_side_output"""

    class CountToSide(KeyedCoProcessFunction):
        def open(self, context: RuntimeContext):
            self.count = context.get_reducing_state(
                ReducingStateDescriptor("reduce", lambda i, j: i + j, Types.INT())
            )

        def process_element1(self, value, ctx):
            yield ctx.get_current_key(), value[1]
            self.count.add(1)
            yield SIDE, self.count.get()

        def process_element2(self, value, ctx):
            yield ctx.get_current_key(), value[0]
            self.count.add(1)
            yield SIDE, self.count.get()

    left = env.from_collection([("a", 1), ("b", 2), ("a", 3), ("b", 4)], type_info=STR_INT_ROW)
    right = env.from_collection(
        [(8, "a"), (7, "b"), (6, "a"), (5, "b")], type_info=Types.ROW([Types.INT(), Types.STRING()])
    )
    stream = (
        left.key_by(lambda r: r[0])
        .connect(right.key_by(lambda r: r[1]))
        .process(CountToSide(), output_type=STR_INT_TUPLE)
    )
    main, side = main_and_side(env, stream)

    def check():
        assert sorted(main.get_results()) == sorted(
            ["(a,1)", "(b,2)", "(a,3)", "(b,4)", "(b,5)", "(a,6)", "(b,7)", "(a,8)"]
        )
        assert sorted(side.get_results()) == ["1", "1", "2", "2", "3", "3", "4", "4"]

    return check


class ValueAndDouble(ProcessFunction):
    def process_element(self, value, ctx):
        yield value
        yield SIDE, value * 2


def test_side_output_stream_execute_and_collect(env):
    """DataStreamTests.test_side_output_stream_execute_and_collect"""
    stream = env.from_collection([1, 2, 3], Types.INT()).process(ValueAndDouble())
    assert sorted(stream.get_side_output(SIDE).execute_and_collect()) == [2, 4, 6]


@case("parallelism 2")
def side_output_tag_reusing(env):
    """DataStreamTests.test_side_output_tag_reusing"""
    first, second = DataStreamTestSinkFunction(), DataStreamTestSinkFunction()
    stream = env.from_collection([1, 2, 3], Types.INT()).process(ValueAndDouble())
    stream.get_side_output(SIDE).add_sink(first)
    stream.map(lambda i: i * 2).process(ValueAndDouble()).get_side_output(SIDE).add_sink(second)

    def check():
        assert sorted(first.get_results(stringify=False)) == ["2", "4", "6"]
        assert sorted(second.get_results(stringify=False)) == ["12", "4", "8"]

    return check


# ---- test_data_stream.py: keyed operations --------------------------------------------------------

LETTERS = [("a", 0), ("b", 0), ("c", 1), ("d", 1), ("e", 2)]


class ConcatWithStateCheck(ReduceFunction):
    """Flink's MyReduceFunction: concatenates names, and checks its own keyed state as it goes."""

    def open(self, runtime_context: RuntimeContext):
        self.calls = runtime_context.get_state(ValueStateDescriptor("test_state", Types.INT()))

    def reduce(self, value1, value2):
        calls = 2 if self.calls.value() is None else self.calls.value() + 1
        result = Row(value1[0] + value2[0], value1[1])
        assert result[0] != "ab" or calls == 2
        assert result[0] != "cde" or calls == 3
        self.calls.update(calls)
        return result


def reduce_with_state(env, expected):
    sink = DataStreamTestSinkFunction()
    source = env.from_collection([("a", 0), ("c", 1), ("d", 1), ("b", 0), ("e", 1)], type_info=STR_INT_ROW)
    keyed = source.key_by(SecondField(), key_type=Types.INT())
    with pytest.raises(Exception):
        keyed.name("keyed stream")
    keyed.reduce(ConcatWithStateCheck()).add_sink(sink)

    def check():
        assert sorted(sink.get_results(False)) == sorted(expected)

    return check


@case("parallelism 2")
def reduce_with_state_streaming(env):
    """DataStreamStreamingTests.test_reduce_with_state"""
    return reduce_with_state(env, ["+I[a, 0]", "+I[ab, 0]", "+I[c, 1]", "+I[cd, 1]", "+I[cde, 1]"])


@case("batch")
def reduce_with_state_batch(env):
    """DataStreamBatchTests.test_reduce_with_state"""
    return reduce_with_state(env, ["+I[ab, 0]", "+I[cde, 1]"])


@case("parallelism 2")
def keyed_co_map(env):
    """ProcessDataStreamTests.test_keyed_co_map: each input sees its own keyed state per key"""
    sink = DataStreamTestSinkFunction()

    class CheckPrevious(CoMapFunction):
        def open(self, runtime_context: RuntimeContext):
            self.previous1 = runtime_context.get_state(ValueStateDescriptor("pre1", Types.STRING()))
            self.previous2 = runtime_context.get_state(ValueStateDescriptor("pre2", Types.STRING()))

        @staticmethod
        def check(previous, value):
            if value[0] in ("b", "d"):
                assert previous.value() == {"b": "a", "d": "c"}[value[0]]
            previous.update(value[0])
            return value

        def map1(self, value):
            return self.check(self.previous1, value)

        def map2(self, value):
            return self.check(self.previous2, value)

    left = env.from_collection(LETTERS, type_info=STR_INT_ROW).key_by(SecondField(), key_type=Types.INT())
    right = env.from_collection(LETTERS, type_info=STR_INT_ROW)
    left.connect(right).key_by(SecondField(), SecondField(), key_type=Types.INT()).map(CheckPrevious()).map(
        lambda r: (r[0], r[1] + 1)
    ).add_sink(sink)

    def check():
        once = ["('a', 1)", "('b', 1)", "('c', 2)", "('d', 2)", "('e', 3)"]
        assert sorted(sink.get_results(True)) == sorted(once * 2)

    return check


class FirstSeen(CoFlatMapFunction):
    """Flink's MyRichCoFlatMapFunction: numbers twice, each name once (map state)."""

    def open(self, runtime_context: RuntimeContext):
        self.seen = runtime_context.get_map_state(MapStateDescriptor("map", Types.STRING(), Types.BOOLEAN()))

    def flat_map1(self, value):
        yield str(value[0] + 1)
        yield str(value[0] + 1)

    def flat_map2(self, value):
        if value[0] not in self.seen:
            self.seen[value[0]] = True
            yield value[0]


@case("parallelism 2")
def keyed_co_flat_map(env):
    """ProcessDataStreamTests.test_keyed_co_flat_map"""
    sink = DataStreamTestSinkFunction()
    numbers = env.from_collection([(1, 1), (2, 2), (3, 3)], type_info=Types.ROW([Types.INT(), Types.INT()]))
    names = env.from_collection(
        [("a", "a"), ("b", "b"), ("c", "c"), ("a", "a")],
        type_info=Types.ROW([Types.STRING(), Types.STRING()]),
    )
    numbers.connect(names).key_by(lambda r: 1, lambda r: 1).flat_map(
        FirstSeen(), output_type=Types.STRING()
    ).filter(lambda x: x != "4").add_sink(sink)

    def check():
        assert sorted(sink.get_results(False)) == ["2", "2", "3", "3", "a", "b", "c"]

    return check


@case("parallelism 2")
def keyed_map(env):
    """ProcessDataStreamTests.test_keyed_map: a MapFunction on a KeyedStream has keyed state"""
    sink = DataStreamTestSinkFunction()
    keyed = env.from_collection(
        [("a", 0), ("b", 1), ("c", 0), ("d", 1), ("e", 2)], type_info=STR_INT_ROW
    ).key_by(SecondField(), key_type=Types.INT())
    with pytest.raises(Exception):
        keyed.name("keyed stream")

    class CountPerKey(MapFunction):
        def open(self, runtime_context: RuntimeContext):
            self.count = runtime_context.get_state(ValueStateDescriptor("test_state", Types.INT()))

        def map(self, value):
            if value[0] in ("b", "c", "d"):
                count = (self.count.value() or 0) + 1
                assert count == {"b": 1, "c": 1, "d": 2}[value[0]]
                self.count.update(count)
            return value

    keyed.map(CountPerKey()).map(lambda r: (r[0], r[1] + 1)).add_sink(sink)

    def check():
        assert sorted(sink.get_results(True)) == ["('a', 1)", "('b', 2)", "('c', 1)", "('d', 2)", "('e', 3)"]

    return check


class CountAndPrevious:
    """Shared by Flink's keyed flat_map and filter cases: the key's count, the instance's previous."""

    def open(self, runtime_context: RuntimeContext):
        self.previous = None
        self.count = runtime_context.get_state(ValueStateDescriptor("test_state", Types.INT()))

    def step(self, value):
        count = (self.count.value() or 0) + 1
        if value[0] in ("b", "d"):
            assert self.previous == {"b": "a", "d": "c"}[value[0]] and count == 2
        if value[0] == "e":
            assert count == 1
        self.previous = value[0]
        self.count.update(count)
        return value[0] not in ("b", "d")


@case("parallelism 2")
def keyed_flat_map(env):
    """ProcessDataStreamTests.test_keyed_flat_map"""
    sink = DataStreamTestSinkFunction()

    class Check(CountAndPrevious, FlatMapFunction):
        def flat_map(self, value):
            self.step(value)
            yield value

    keyed = env.from_collection(LETTERS, type_info=STR_INT_ROW).key_by(SecondField(), key_type=Types.INT())
    with pytest.raises(Exception):
        keyed.name("keyed stream")
    keyed.flat_map(Check()).map(lambda r: (r[0], r[1] + 1)).add_sink(sink)

    def check():
        assert sorted(sink.get_results(True)) == ["('a', 1)", "('b', 1)", "('c', 2)", "('d', 2)", "('e', 3)"]

    return check


@case("parallelism 2")
def keyed_filter(env):
    """ProcessDataStreamTests.test_keyed_filter"""
    sink = DataStreamTestSinkFunction()

    class Check(CountAndPrevious, FilterFunction):
        def filter(self, value):
            return self.step(value)

    keyed = env.from_collection(LETTERS, type_info=STR_INT_ROW).key_by(SecondField())
    with pytest.raises(Exception):
        keyed.name("keyed stream")
    keyed.filter(Check()).filter(lambda r: r[1] > 0).add_sink(sink)

    def check():
        assert sorted(sink.get_results(False)) == ["+I[c, 1]", "+I[e, 2]"]

    return check


@case("parallelism 2")
def multi_key_by(env):
    """ProcessDataStreamTests.test_multi_key_by"""
    sink = DataStreamTestSinkFunction()
    source = env.from_collection(LETTERS, type_info=STR_INT_ROW)
    source.key_by(SecondField(), key_type=Types.INT()).key_by(lambda r: r[0]).add_sink(sink)

    def check():
        assert sorted(sink.get_results(False)) == ["+I[a, 0]", "+I[b, 0]", "+I[c, 1]", "+I[d, 1]", "+I[e, 2]"]

    return check


@case("parallelism 2")
def collection_type_info(env):
    """ProcessDataStreamTests.test_collection_type_info"""
    sink = DataStreamTestSinkFunction()
    row = Types.ROW(
        [
            Types.INT(),
            Types.PRIMITIVE_ARRAY(Types.FLOAT()),
            Types.BASIC_ARRAY(Types.STRING()),
            Types.SQL_DATE(),
            Types.SQL_TIME(),
            Types.SQL_TIMESTAMP(),
            Types.LIST(Types.INT()),
        ]
    )
    value = (
        1,
        [1.1, 1.2, 1.30],
        [None, "hi", "flink"],
        datetime.date(2021, 1, 9),
        datetime.time(12, 0, 0),
        datetime.datetime(2021, 1, 9, 12, 0, 0, 11000),
        [1, 2, 3],
    )
    env.from_collection([value], type_info=row).map(lambda r: r, output_type=row).add_sink(sink)

    def check():
        expected = "+I[1, [1.1, 1.2, 1.3], [null, hi, flink], 2021-01-09, 12:00:00, 2021-01-09 12:00:00.011, [1, 2, 3]]"
        assert sink.get_results() == [expected]

    return check


@case("parallelism 1")
def process_function(env):
    """ProcessDataStreamTests.test_process_function: ctx.timestamp() in a non-keyed ProcessFunction"""
    sink = DataStreamTestSinkFunction()
    env.get_config().set_auto_watermark_interval(2000)
    env.set_stream_time_characteristic(TimeCharacteristic.EventTime)
    stamps = ["1603708211000", "1603708224000", "1603708226000", "1603708289000"]
    source = env.from_collection(
        list(enumerate(stamps, 1)), type_info=Types.ROW([Types.INT(), Types.STRING()])
    )

    class Describe(ProcessFunction):
        def process_element(self, value, ctx):
            yield f"current timestamp: {ctx.timestamp()}, current_value: {value}"

    source.assign_timestamps_and_watermarks(by_second_column()).process(
        Describe(), output_type=Types.STRING()
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == [
            f"current timestamp: {ts}, current_value: Row(f0={i}, f1='{ts}')"
            for i, ts in enumerate(stamps, 1)
        ]

    return check


@case("parallelism 1")
def keyed_sum_streaming(env):
    """ProcessDataStreamStreamingTests.test_keyed_sum: by field name, by position, on a Tuple"""
    sink = DataStreamTestSinkFunction()
    source = env.from_collection(
        [(1, 1), (1, 2), (1, 3), (2, 5), (2, 1)],
        type_info=Types.ROW_NAMED(["v1", "v2"], [Types.INT(), Types.INT()]),
    )
    source.key_by(lambda r: r[0]).sum("v2").key_by(lambda r: r[0]).sum(1).map(
        lambda r: (r[1], r[0]), output_type=Types.TUPLE([Types.INT(), Types.INT()])
    ).key_by(lambda r: r[1]).sum().add_sink(sink)

    def check():
        assert sorted(sink.get_results(False)) == sorted(["(1,1)", "(5,1)", "(15,1)", "(5,2)", "(16,2)"])

    return check


@case("parallelism 1")
def keyed_min_by_and_max_streaming(env):
    """ProcessDataStreamStreamingTests.test_keyed_min_by_and_max"""
    sink = DataStreamTestSinkFunction()
    source = env.from_collection(
        [("a", 3, 0), ("a", 1, 1), ("b", 5, 0), ("b", 3, 1)],
        type_info=Types.ROW_NAMED(["v1", "v2", "v3"], [Types.STRING(), Types.INT(), Types.INT()]),
    )
    source.key_by(lambda r: r[0]).min_by("v2").map(
        lambda r: (r[0], r[1], r[2]), output_type=Types.TUPLE([Types.STRING(), Types.INT(), Types.INT()])
    ).key_by(lambda r: r[2]).max(1).key_by(lambda r: r[2]).min().map(
        lambda r: r[0], output_type=Types.STRING()
    ).key_by(lambda r: r).max_by().add_sink(sink)

    def check():
        assert sink.get_results(False) == ["a", "a", "a", "a"]

    return check


@case("batch, parallelism 1")
def keyed_sum_batch(env):
    """ProcessDataStreamBatchTests.test_keyed_sum: only each key's final sum, at the end"""
    sink = DataStreamTestSinkFunction()
    source = env.from_collection(
        [(1, 1), (1, 2), (1, 3), (5, 1), (5, 5)],
        type_info=Types.ROW_NAMED(["v1", "v2"], [Types.INT(), Types.INT()]),
    )

    def pair_with_12(data):
        for field in data:
            yield 12, field

    def fields(data):
        yield from data

    source.key_by(lambda r: r[0]).sum("v2").key_by(lambda r: r[1]).sum().flat_map(
        pair_with_12, output_type=Types.TUPLE([Types.INT(), Types.INT()])
    ).key_by(lambda r: r[0]).sum(1).flat_map(fields, output_type=Types.INT()).key_by(
        lambda x: x
    ).sum().add_sink(sink)

    def check():
        assert sink.get_results(False) == ["24"]

    return check


@case("batch, parallelism 1")
def keyed_min_by_and_max_batch(env):
    """ProcessDataStreamBatchTests.test_keyed_min_by_and_max (a key selector returning a list)"""
    sink = DataStreamTestSinkFunction()
    source = env.from_collection(
        [(1, "9", 0), (1, "5", 1), (1, "6", 2), (5, "5", 0), (5, "3", 1)],
        type_info=Types.ROW_NAMED(["v1", "v2", "v3"], [Types.INT(), Types.STRING(), Types.INT()]),
    )

    def with_one(data):
        for field in data:
            yield int(field), 1

    def fields(data):
        yield from data

    source.key_by(lambda r: r[0]).min_by("v2").map(
        lambda r: (r[0], r[1], r[2]), output_type=Types.TUPLE([Types.INT(), Types.STRING(), Types.INT()])
    ).key_by(lambda r: r[2]).max(0).flat_map(
        with_one, output_type=Types.TUPLE([Types.INT(), Types.INT()])
    ).key_by(lambda r: [1]).min_by().flat_map(fields, output_type=Types.INT()).key_by(
        lambda x: x
    ).max_by().add_sink(sink)

    def check():
        assert sink.get_results(False) == ["1"]

    return check


# ---- test_data_stream.py: CommonDataStreamTests ---------------------------------------------------


def test_data_stream_name(env):
    """CommonDataStreamTests.test_data_stream_name"""
    stream = env.from_collection([(1, "Hi", "Hello"), (2, "Hello", "Hi")])
    stream.name("test_name")
    assert stream.get_name() == "test_name"


def plan_of(env) -> dict:
    return json.loads(env.get_execution_plan())


def test_force_non_parallel(env, sink):
    """CommonDataStreamTests.test_force_non_parallel"""
    env.set_parallelism(8)
    env.from_collection([(1, "Hi", "Hello"), (2, "Hello", "Hi")]).force_non_parallel().add_sink(sink)
    assert plan_of(env)["nodes"][0]["parallelism"] == 1


def test_union(env, sink):
    """CommonDataStreamTests.test_union: the union's successor reads from every source"""
    first, second, third = (env.from_collection(values) for values in ([1, 2, 3], [4, 5, 6], [7, 8, 9]))
    third.union(first, second).map(lambda x: x + 1).add_sink(sink)
    nodes = plan_of(env)["nodes"]
    sources = sorted(n["id"] for n in nodes if n["pact"] == "Data Source")
    inputs = sorted(p["id"] for n in nodes if n["pact"] == "Operator" for p in n["predecessors"])
    assert sources == inputs


def test_project(env, sink):
    """CommonDataStreamTests.test_project"""
    four_ints = Types.TUPLE([Types.INT(), Types.INT(), Types.INT(), Types.INT()])
    env.from_collection([[1, 2, 3, 4], [5, 6, 7, 8]], type_info=four_ints).project(1, 3).map(
        lambda x: (x[0], x[1] + 1)
    ).add_sink(sink)
    assert plan_of(env)["nodes"][1]["type"] == "Projection"


def test_keyed_stream_partitioning(env):
    """CommonDataStreamTests.test_keyed_stream_partitioning: a KeyedStream refuses repartitioning"""
    keyed = env.from_collection([("ab", 1), ("bdc", 2), ("cfgs", 3), ("deeefg", 4)]).key_by(lambda r: r[1])
    for repartition in (keyed.shuffle, keyed.rebalance, keyed.rescale, keyed.broadcast, keyed.forward):
        with pytest.raises(Exception):
            repartition()


def test_execute_and_collect(env):
    """CommonDataStreamTests.test_execute_and_collect: a limit, a KeyedStream, every field type, arrays"""
    words = ["pyflink", "datastream", "execute", "collect"]
    assert list(env.from_collection(words).execute_and_collect(limit=3)) == words[:3]

    pairs = [("pyflink", 1), ("datastream", 2), ("pyflink", 1), ("collect", 2)]
    keyed = env.from_collection(
        collection=pairs, type_info=Types.TUPLE([Types.STRING(), Types.INT()])
    ).key_by(lambda r: r[0], Types.STRING())
    with keyed.execute_and_collect() as results:
        assert list(results) == [Row(f0=word, f1=(word, n)) for word, n in pairs]

    every_type = [
        (1, None, 1, True, 32767, -2147483648, 1.23, 1.98932, bytearray(b"flink"), "pyflink",
         datetime.date(2014, 9, 13), datetime.time(hour=12, minute=0, second=0, microsecond=123000),
         datetime.datetime(2018, 3, 11, 3, 0, 0, 123000), [1, 2, 3],
         [["pyflink", "datastream"], ["execute", "collect"]], decimal.Decimal("1000000000000000000.05"),
         decimal.Decimal("1000000000000000000.05999999999999999899999999999")),
        (2, None, 2, True, 23878, 652516352, 9.87, 2.98936, bytearray(b"flink"), "pyflink",
         datetime.date(2015, 10, 14), datetime.time(hour=11, minute=2, second=2, microsecond=234500),
         datetime.datetime(2020, 4, 15, 8, 2, 6, 235000), [2, 4, 6],
         [["pyflink", "datastream"], ["execute", "collect"]], decimal.Decimal("2000000000000000000.74"),
         decimal.Decimal("2000000000000000000.06111111111111111111111111111")),
    ]  # fmt: skip
    with env.from_collection(every_type).execute_and_collect() as results:
        assert sorted(results, key=str) == sorted(every_type, key=str)

    arrays = [[1, 2, 3], [4, 5]]
    with env.from_collection(
        arrays, type_info=Types.PRIMITIVE_ARRAY(Types.INT())
    ).execute_and_collect() as results:
        assert sorted(results, key=str) == arrays

    object_arrays = [(["test", "test"], [0.0, 0.0]), ([None], [0.0, 0.0])]
    tuple_of_arrays = Types.TUPLE([Types.OBJECT_ARRAY(Types.STRING()), Types.OBJECT_ARRAY(Types.DOUBLE())])
    with env.from_collection(object_arrays, type_info=tuple_of_arrays).execute_and_collect() as results:
        assert sorted(results, key=str) == sorted(object_arrays, key=str)


def test_function_with_error(env):
    """CommonDataStreamTests.test_function_with_error (Flink raises Py4JJavaError; stretch its own error)"""
    keyed = env.from_collection(
        [("a", 0), ("b", 0), ("c", 1), ("d", 1), ("e", 1)], type_info=STR_INT_ROW
    ).key_by(SecondField(), key_type=Types.INT())

    def failing(x):
        raise ValueError("flat_map_func error")
        yield x

    with pytest.raises(Exception, match="flat_map_func error"):
        keyed.flat_map(failing).print()
        env.execute("test_process_function_with_error")


@case("parallelism 2")
def data_with_custom_class(env):
    """CommonDataStreamTests.test_data_with_custom_class: an object of a local class between steps"""
    sink = DataStreamTestSinkFunction()

    class Data:
        def __init__(self, name, num):
            self.name = name
            self.num = num

    source = env.from_collection(ABC, type_info=STR_INT_ROW)
    source.map(lambda r: Data(r[0], r[1])).flat_map(lambda d: [d.name for _ in range(d.num)]).add_sink(sink)

    def check():
        assert sorted(sink.get_results(True)) == ["b", "c", "c"]

    return check


# ---- test_window.py ---------------------------------------------------------------------------------

HI = [("hi", 1), ("hi", 2), ("hi", 3), ("hi", 4), ("hi", 5), ("hi", 8), ("hi", 9), ("hi", 15)]
HI_SESSIONS = [("hi", 1), ("hi", 2), ("hi", 3), ("hi", 4), ("hi", 8), ("hi", 9), ("hi", 15)]
AB = [("a", 1), ("a", 2), ("b", 3), ("a", 6), ("b", 8), ("b", 9), ("a", 15)]


class CountWindowProcessFunction(ProcessWindowFunction):
    """Flink's: the key, the window's bounds, how many elements it holds."""

    def process(self, key, context, elements):
        return [(key, context.window().start, context.window().end, len(list(elements)))]


class CountAllWindowProcessFunction(ProcessAllWindowFunction):
    def process(self, context, elements):
        return [(context.window().start, context.window().end, len(list(elements)))]


class SumWindowFunction(WindowFunction):
    def apply(self, key, window, inputs):
        return [(key, sum(i[0] for i in inputs))]


class ValueAsGap(SessionWindowTimeGapExtractor):
    def extract(self, element) -> int:
        return element[1]


def keyed_by_word(env, records):
    return (
        env.from_collection(records, type_info=STR_INT_TUPLE)
        .assign_timestamps_and_watermarks(by_second_column())
        .key_by(lambda r: r[0], key_type=Types.STRING())
    )


def counted(env, records, assigner, expected, trigger=None):
    """Flink's window cases with its CountWindowProcessFunction: a check of what they collect."""
    sink = DataStreamTestSinkFunction()
    windowed = keyed_by_word(env, records).window(assigner)
    if trigger is not None:
        windowed = windowed.trigger(trigger)
    windowed.process(CountWindowProcessFunction(), WINDOW_COUNT).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == sorted(expected)

    return check


@case("parallelism 2")
def event_time_tumbling_window(env):
    """WindowTests.test_event_time_tumbling_window"""
    assigner = TumblingEventTimeWindows.of(Time.milliseconds(5))
    return counted(env, HI, assigner, ["(hi,0,5,4)", "(hi,5,10,3)", "(hi,15,20,1)"])


@case("parallelism 2")
def event_time_sliding_window(env):
    """WindowTests.test_event_time_sliding_window"""
    assigner = SlidingEventTimeWindows.of(Time.milliseconds(5), Time.milliseconds(2))
    expected = ["(hi,-2,3,2)", "(hi,0,5,4)", "(hi,2,7,4)", "(hi,4,9,3)", "(hi,6,11,2)", "(hi,8,13,2)"]
    return counted(env, HI, assigner, expected + ["(hi,12,17,1)", "(hi,14,19,1)"])


@case("parallelism 2")
def event_time_session_window(env):
    """WindowTests.test_event_time_session_window"""
    assigner = EventTimeSessionWindows.with_gap(Time.milliseconds(5))
    return counted(env, HI_SESSIONS, assigner, ["(hi,1,14,6)", "(hi,15,20,1)"])


@case("parallelism 1")
def event_time_dynamic_gap_session_window(env):
    """WindowTests.test_event_time_dynamic_gap_session_window"""
    records = [("hi", 1), ("hi", 2), ("hi", 3), ("hi", 4), ("hi", 9), ("hi", 9), ("hi", 15)]
    assigner = EventTimeSessionWindows.with_dynamic_gap(ValueAsGap())
    return counted(env, records, assigner, ["(hi,1,8,4)", "(hi,9,30,3)"])


@case("parallelism 2")
def session_window_late_merge(env):
    """WindowTests.test_session_window_late_merge"""
    assigner = EventTimeSessionWindows.with_gap(Time.milliseconds(5))
    return counted(env, [("hi", 0), ("hi", 8), ("hi", 4)], assigner, ["(hi,0,13,3)"])


@case("parallelism 2")
def event_time_session_window_with_purging_trigger(env):
    """WindowTests.test_event_time_session_window_with_purging_trigger"""
    assigner = EventTimeSessionWindows.with_gap(Time.milliseconds(3))
    trigger = PurgingTrigger.of(EventTimeTrigger.create())
    return counted(env, HI_SESSIONS, assigner, ["(hi,1,7,4)", "(hi,8,12,2)", "(hi,15,18,1)"], trigger)


@case("parallelism 2")
def count_tumbling_window(env):
    """WindowTests.test_count_tumbling_window"""
    sink = DataStreamTestSinkFunction()
    records = HI_HELLO + [(6, "hello")]
    env.from_collection(records, type_info=INT_STR_TUPLE).key_by(
        lambda r: r[1], key_type=Types.STRING()
    ).count_window(3).apply(SumWindowFunction(), STR_INT_TUPLE).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == ["(hello,12)", "(hi,9)"]

    return check


@case("parallelism 2")
def count_sliding_window(env):
    """WindowTests.test_count_sliding_window"""
    sink = DataStreamTestSinkFunction()
    env.from_collection(HI_HELLO, type_info=INT_STR_TUPLE).key_by(
        lambda r: r[1], key_type=Types.STRING()
    ).window(CountSlidingWindowAssigner(2, 1)).apply(SumWindowFunction(), STR_INT_TUPLE).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == ["(hello,10)", "(hello,6)", "(hi,4)", "(hi,8)"]

    return check


@case("parallelism 1")
def global_window_with_purging_trigger(env):
    """WindowTests.test_global_window_with_purging_trigger"""
    sink = DataStreamTestSinkFunction()

    class Count(ProcessWindowFunction):
        def process(self, key, context, elements):
            return [(key, len(list(elements)))]

    keyed_by_word(env, [("hi", 1)] * 7).window(GlobalWindows.create()).trigger(
        PurgingTrigger.of(CountTrigger.of(2))
    ).process(Count(), STR_INT_TUPLE).add_sink(sink)

    def check():
        assert sink.get_results() == ["(hi,2)", "(hi,2)", "(hi,2)"]

    return check


def session_of_2ms():
    return EventTimeSessionWindows.with_gap(Time.milliseconds(2))


@case("parallelism 2")
def window_reduce_passthrough(env):
    """WindowTests.test_window_reduce_passthrough"""
    sink = DataStreamTestSinkFunction()
    keyed_by_word(env, AB).window(session_of_2ms()).reduce(
        lambda a, b: (b[0], a[1] + b[1]), output_type=STR_INT_TUPLE
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == ["(a,15)", "(a,3)", "(a,6)", "(b,17)", "(b,3)"]

    return check


class StartAndFirst(ProcessWindowFunction):
    def process(self, key, context, elements):
        yield f"current window start at {context.window().start}, reduce result {next(iter(elements))}"


@case("parallelism 2")
def window_reduce_process(env):
    """WindowTests.test_window_reduce_process"""
    sink = DataStreamTestSinkFunction()
    keyed_by_word(env, AB).window(session_of_2ms()).reduce(
        lambda a, b: (b[0], a[1] + b[1]), window_function=StartAndFirst(), output_type=Types.STRING()
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == [
            "current window start at 1, reduce result ('a', 3)",
            "current window start at 15, reduce result ('a', 15)",
            "current window start at 3, reduce result ('b', 3)",
            "current window start at 6, reduce result ('a', 6)",
            "current window start at 8, reduce result ('b', 17)",
        ]

    return check


class EvenMinusOdd(AggregateFunction):
    """Flink's first MyAggregateFunction: the last name seen, and #even - #odd values."""

    def create_accumulator(self):
        return "", {0: 0, 1: 0}

    def add(self, value, accumulator):
        accumulator[1][value[1] % 2] += 1
        return value[0], accumulator[1]

    def get_result(self, accumulator):
        return accumulator[0], accumulator[1][0] - accumulator[1][1]

    def merge(self, acc_a, acc_b):
        return acc_a[0], {0: acc_a[1][0] + acc_b[1][0], 1: acc_a[1][1] + acc_b[1][1]}


class SumAndName(AggregateFunction):
    """Flink's second MyAggregateFunction: (sum, last name) as a typed accumulator."""

    def create_accumulator(self):
        return 0, ""

    def add(self, value, accumulator):
        return value[1] + accumulator[0], value[0]

    def get_result(self, accumulator):
        return accumulator[1], accumulator[0]

    def merge(self, acc_a, acc_b):
        return acc_a[0] + acc_b[0], acc_a[1]


class NameAndSum(ProcessWindowFunction):
    def process(self, key, context, elements):
        name, total = next(iter(elements))
        yield f"key {name} timestamp sum {total}"


class NameAndSumAll(ProcessAllWindowFunction):
    def process(self, context, elements):
        name, total = next(iter(elements))
        yield f"key {name} timestamp sum {total}"


@case("parallelism 2")
def window_aggregate_passthrough(env):
    """WindowTests.test_window_aggregate_passthrough"""
    sink = DataStreamTestSinkFunction()
    keyed_by_word(env, AB).window(session_of_2ms()).aggregate(
        EvenMinusOdd(), output_type=STR_INT_TUPLE
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == ["(a,-1)", "(a,0)", "(a,1)", "(b,-1)", "(b,0)"]

    return check


@case("parallelism 2")
def window_aggregate_accumulator_type(env):
    """WindowTests.test_window_aggregate_accumulator_type"""
    sink = DataStreamTestSinkFunction()
    keyed_by_word(env, AB).window(session_of_2ms()).aggregate(
        SumAndName(), accumulator_type=INT_STR_TUPLE, output_type=STR_INT_TUPLE
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == ["(a,15)", "(a,3)", "(a,6)", "(b,17)", "(b,3)"]

    return check


@case("parallelism 2")
def window_aggregate_process(env):
    """WindowTests.test_window_aggregate_process"""
    sink = DataStreamTestSinkFunction()
    keyed_by_word(env, AB).window(session_of_2ms()).aggregate(
        SumAndName(), window_function=NameAndSum(), accumulator_type=INT_STR_TUPLE, output_type=Types.STRING()
    ).add_sink(sink)

    def check():
        sums = [("a", 15), ("a", 3), ("a", 6), ("b", 17), ("b", 3)]
        assert sorted(sink.get_results()) == [f"key {k} timestamp sum {s}" for k, s in sums]

    return check


def all_of(env, records):
    return env.from_collection(records, type_info=STR_INT_TUPLE).assign_timestamps_and_watermarks(
        by_second_column()
    )


@case("parallelism 2")
def event_time_tumbling_window_all(env):
    """WindowTests.test_event_time_tumbling_window_all"""
    sink = DataStreamTestSinkFunction()
    records = [
        ("hi", 1),
        ("hello", 2),
        ("hi", 3),
        ("hello", 4),
        ("hello", 5),
        ("hi", 8),
        ("hi", 9),
        ("hi", 15),
    ]
    all_of(env, records).window_all(TumblingEventTimeWindows.of(Time.milliseconds(5))).process(
        CountAllWindowProcessFunction(), Types.TUPLE([Types.LONG(), Types.LONG(), Types.INT()])
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == ["(0,5,4)", "(15,20,1)", "(5,10,3)"]

    return check


@case("parallelism 1")
def window_all_reduce(env):
    """WindowTests.test_window_all_reduce"""
    sink = DataStreamTestSinkFunction()
    all_of(env, AB).window_all(session_of_2ms()).reduce(
        lambda a, b: (a[0], a[1] + b[1]), output_type=STR_INT_TUPLE
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == ["(a,15)", "(a,23)", "(a,6)"]

    return check


@case("parallelism 1")
def window_all_reduce_process(env):
    """WindowTests.test_window_all_reduce_process"""
    sink = DataStreamTestSinkFunction()

    class StartAndFirstAll(ProcessAllWindowFunction):
        def process(self, context, elements):
            yield f"current window start at {context.window().start}, reduce result {next(iter(elements))}"

    all_of(env, AB).window_all(session_of_2ms()).reduce(
        lambda a, b: (a[0], a[1] + b[1]), window_function=StartAndFirstAll(), output_type=Types.STRING()
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == sorted(
            [
                "current window start at 1, reduce result ('a', 6)",
                "current window start at 6, reduce result ('a', 23)",
                "current window start at 15, reduce result ('a', 15)",
            ]
        )

    return check


@case("parallelism 1")
def window_all_aggregate(env):
    """WindowTests.test_window_all_aggregate"""
    sink = DataStreamTestSinkFunction()
    all_of(env, AB).window_all(session_of_2ms()).aggregate(
        EvenMinusOdd(), output_type=STR_INT_TUPLE
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == ["(a,-1)", "(b,-1)", "(b,1)"]

    return check


@case("parallelism 1")
def window_all_aggregate_process(env):
    """WindowTests.test_window_all_aggregate_process"""
    sink = DataStreamTestSinkFunction()
    all_of(env, AB).window_all(session_of_2ms()).aggregate(
        SumAndName(),
        window_function=NameAndSumAll(),
        accumulator_type=INT_STR_TUPLE,
        output_type=Types.STRING(),
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == [
            "key a timestamp sum 15",
            "key b timestamp sum 23",
            "key b timestamp sum 6",
        ]

    return check


@case("parallelism 2")
def chained_window(env):
    """EmbeddedWindowTests.test_chained_window: a tuple key, a window reduce, then a map"""
    sink = DataStreamTestSinkFunction()

    class FirstField(TimestampAssigner):
        def extract_timestamp(self, value, record_timestamp) -> int:
            return value[0]

    minute, next_minute = 1676461680000, 1676461740000
    records = [
        (minute, "a1", "b1", 1),
        (minute, "a1", "b1", 1),
        (minute, "a2", "b2", 1),
        (minute, "a1", "b2", 1),
    ]
    records += [(next_minute, "a1", "b1", 1), (next_minute, "a2", "b2", 1)]
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner(FirstField())
    env.from_collection(records).assign_timestamps_and_watermarks(strategy).key_by(
        lambda r: (r[0], r[1], r[2])
    ).window(TumblingEventTimeWindows.of(Time.minutes(1))).reduce(
        lambda x, y: (x[0], x[1], x[2], x[3] + y[3]),
        output_type=Types.TUPLE([Types.LONG(), Types.STRING(), Types.STRING(), Types.INT()]),
    ).map(
        lambda r: (r[0], r[1], r[3]), output_type=Types.TUPLE([Types.LONG(), Types.STRING(), Types.INT()])
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == [
            f"({minute},a1,1)",
            f"({minute},a1,2)",
            f"({minute},a2,1)",
            f"({next_minute},a1,1)",
            f"({next_minute},a2,1)",
        ]

    return check


# ---- flink-python/pyflink/examples/datastream: the scripts print; a plain-Python model says what ----


def printed(capsys) -> list[str]:
    """The lines the job printed, without the ``N> `` instance prefix of parallel printing."""
    lines = capsys.readouterr().out.splitlines()
    return [line.split("> ", 1)[1] if line[:1].isdigit() and "> " in line else line for line in lines]


PEOPLE = [
    (1, '{"name": "Flink", "tel": 123, "addr": {"country": "Germany", "city": "Berlin"}}'),
    (2, '{"name": "hello", "tel": 135, "addr": {"country": "China", "city": "Shanghai"}}'),
    (3, '{"name": "world", "tel": 124, "addr": {"country": "USA", "city": "NewYork"}}'),
    (4, '{"name": "PyFlink", "tel": 32, "addr": {"country": "China", "city": "Hangzhou"}}'),
]


def test_example_basic_operations(env, capsys):
    """examples/datastream/basic_operations.py (its expected output is in its comments)"""
    env.set_parallelism(1)
    people = env.from_collection(
        PEOPLE, type_info=Types.ROW_NAMED(["id", "info"], [Types.INT(), Types.STRING()])
    )

    def update_tel(data):
        info = json.loads(data.info)
        info["tel"] += 1
        return data.id, json.dumps(info)

    def show(stream):
        capsys.readouterr()
        stream.print()
        env.execute()
        return printed(capsys)

    def bumped(i, tel):
        return str((i, PEOPLE[i - 1][1].replace(f'"tel": {tel}', f'"tel": {tel + 1}')))

    assert show(people.map(update_tel)) == [bumped(1, 123), bumped(2, 135), bumped(3, 124), bumped(4, 32)]
    assert show(people.filter(lambda data: data.id == 1).map(update_tel)) == [bumped(1, 123)]
    countries = people.map(lambda d: (json.loads(d.info)["addr"]["country"], json.loads(d.info)["tel"]))
    by_country = countries.key_by(lambda d: d[0]).reduce(lambda a, b: (a[0], a[1] + b[1]))
    assert show(by_country) == ["('Germany', 123)", "('China', 135)", "('USA', 124)", "('China', 167)"]


def collected(stream, expected):
    """Collect what the example would print (the same lines: Python's str of untyped records,
    Java's of typed ones) and check it against ``expected``."""
    sink = DataStreamTestSinkFunction()
    stream.add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == sorted(expected)

    return check


@case("parallelism 2")
def example_process_json_data(env):
    """examples/datastream/process_json_data.py"""

    def update_tel(data):
        info = json.loads(data[1])
        info["tel"] += 1
        return data[0], info

    chinese = env.from_collection(PEOPLE).map(update_tel).filter(lambda d: "China" in d[1]["addr"]["country"])
    expected = [update_tel(p) for p in PEOPLE if json.loads(p[1])["addr"]["country"] == "China"]
    return collected(chinese, [str(e) for e in expected])


AMOUNTS = [("Alice", 110.1), ("Bob", 30.2), ("Alice", 20.0), ("Bob", 53.1)]
AMOUNTS += [("Alice", 13.1), ("Bob", 3.1), ("Bob", 16.1), ("Alice", 20.1)]


class Sum(KeyedProcessFunction):
    """The examples' Sum: a running total per key in a pickled value state."""

    def __init__(self, field, emit_now):
        self.field, self.emit_now = field, emit_now

    def open(self, runtime_context: RuntimeContext):
        self.state = runtime_context.get_state(ValueStateDescriptor("state", Types.PICKLED_BYTE_ARRAY()))

    def process_element(self, value, ctx):
        current = (self.state.value() or 0) + value[self.field]
        self.state.update(current)
        if self.emit_now:
            yield value[0], current
        else:
            ctx.timer_service().register_event_time_timer(ctx.timestamp() + 2000)

    def on_timer(self, timestamp, ctx):
        yield ctx.get_current_key(), self.state.value()


@case("parallelism 2")
def example_state_access(env):
    """examples/datastream/state_access.py"""
    totals: collections.Counter = collections.Counter()
    expected = []
    for name, amount in AMOUNTS:
        totals[name] += amount
        expected.append(str((name, totals[name])))
    return collected(
        env.from_collection(AMOUNTS).key_by(lambda v: v[0]).process(Sum(1, emit_now=True)), expected
    )


@case("parallelism 2")
def example_event_time_timer(env):
    """examples/datastream/event_time_timer.py: every record's timer (2 s after it) fires once per
    key and time; the whole collection is in before the watermark passes any of them"""

    class FirstField(TimestampAssigner):
        def extract_timestamp(self, value, record_timestamp) -> int:
            return int(value[0])

    stamps = [1000, 4000, 3000, 2000, 5000, 3000, 7000, 10000]
    records = [(ts, name, amount) for ts, (name, amount) in zip(stamps, AMOUNTS, strict=True)]
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_seconds(2))
    stream = env.from_collection(records).assign_timestamps_and_watermarks(
        strategy.with_timestamp_assigner(FirstField())
    )
    totals: collections.Counter = collections.Counter()
    timers = defaultdict(set)
    for ts, name, amount in records:
        totals[name] += amount
        timers[name].add(ts + 2000)
    expected = [str((name, totals[name])) for name in timers for _ in timers[name]]
    return collected(stream.key_by(lambda v: v[1]).process(Sum(2, emit_now=False)), expected)


SONNET = [
    "To be, or not to be,--that is the question:--",
    "Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune",
    "Or to take arms against a sea of troubles,",
    "And by opposing end them?--To die,--to sleep,--",
    "No more; and by a sleep to say we end",
]


@case("batch, parallelism 1")
def example_word_count(env):
    """examples/datastream/word_count.py (BATCH, its built-in text; the first lines of it here)"""

    def split(line):
        yield from line.split()

    words = env.from_collection(SONNET).flat_map(split).map(lambda i: (i, 1), output_type=STR_INT_TUPLE)
    counted_words = words.key_by(lambda i: i[0]).reduce(lambda i, j: (i[0], i[1] + j[1]))
    counts = collections.Counter(word for line in SONNET for word in line.split())
    return collected(counted_words, [f"({word},{n})" for word, n in counts.items()])


def window_example(env, records, assigner, expected, trigger=None):
    """The windowing examples: a count per window, (key, start, end, count) with INT bounds."""
    windowed = keyed_by_word(env, records).window(assigner)
    if trigger is not None:
        windowed = windowed.trigger(trigger)
    four_ints = Types.TUPLE([Types.STRING(), Types.INT(), Types.INT(), Types.INT()])
    return collected(windowed.process(CountWindowProcessFunction(), four_ints), expected)


def fired(records, assign=None, gap_of=None) -> list[tuple]:
    """What fires, by the plain-Python window model of tests/datastream/flink_windows.py:
    (key, start, end, count) for each firing."""
    windows, _ = flink_windows.run(
        [records], lambda r: r[0], lambda r: r[1], assign, result=len, gap_of=gap_of
    )
    return windows


def model(records, assign=None, gap_of=None) -> list[str]:
    return [f"({k},{start},{end},{n})" for k, start, end, n in fired(records, assign, gap_of)]


@case("parallelism 1")
def example_tumbling_time_window(env):
    """examples/datastream/windowing/tumbling_time_window.py"""
    assigner = TumblingEventTimeWindows.of(Time.milliseconds(5))
    return window_example(env, HI, assigner, model(HI, flink_windows.tumbling(5)))


@case("parallelism 1")
def example_sliding_time_window(env):
    """examples/datastream/windowing/sliding_time_window.py"""
    assigner = SlidingEventTimeWindows.of(Time.milliseconds(5), Time.milliseconds(2))
    return window_example(env, HI, assigner, model(HI, flink_windows.sliding(5, 2)))


@case("parallelism 1")
def example_tumbling_time_window_with_continuous_trigger(env):
    """examples/datastream/windowing/tumbling_time_window_with_continuous_trigger.py: 10 ms windows
    fired every 5 ms of event time and at their end; all records are in when the watermark moves"""
    windows = defaultdict(list)
    for record in HI:
        windows[record[1] // 10 * 10].append(record[1])
    expected = []
    for start, stamps in windows.items():
        # Flink's ContinuousEventTimeTrigger: a timer at the first interval boundary after the
        # window's first record (then every interval), and one at the window's end - 1, when the
        # window goes
        first = min(ts // 5 * 5 + 5 for ts in stamps)
        fire_times = set(range(first, start + 9, 5)) | {start + 9}
        expected += [f"(hi,{start},{start + 10},{len(stamps)})"] * len(fire_times)
    assigner = TumblingEventTimeWindows.of(Time.milliseconds(10))
    return window_example(env, HI, assigner, expected, ContinuousEventTimeTrigger.of(Time.milliseconds(5)))


@case("parallelism 1")
def example_session_with_gap_window(env):
    """examples/datastream/windowing/session_with_gap_window.py"""
    assigner = EventTimeSessionWindows.with_gap(Time.milliseconds(5))
    return window_example(env, HI_SESSIONS, assigner, model(HI_SESSIONS, gap_of=lambda r: 5))


@case("parallelism 1")
def example_session_with_dynamic_gap_window(env):
    """examples/datastream/windowing/session_with_dynamic_gap_window.py"""
    records = [("hi", 1), ("hi", 2), ("hi", 3), ("hi", 4), ("hi", 9), ("hi", 9), ("hi", 15)]
    assigner = EventTimeSessionWindows.with_dynamic_gap(ValueAsGap())
    return window_example(env, records, assigner, model(records, gap_of=lambda r: r[1]))


@case("parallelism 1")
def example_tumbling_count_window(env):
    """examples/datastream/windowing/tumbling_count_window.py (and count_windowing.py)"""
    records = HI_HELLO + [(6, "hello")]
    keyed = env.from_collection(records, type_info=INT_STR_TUPLE).key_by(
        lambda r: r[1], key_type=Types.STRING()
    )
    per_key = defaultdict(list)
    for value, key in records:
        per_key[key].append(value)
    sums = [f"({key},{sum(v[i : i + 3])})" for key, v in per_key.items() for i in range(0, len(v) - 2, 3)]
    return collected(keyed.count_window(3).apply(SumWindowFunction(), STR_INT_TUPLE), sums)


@case("parallelism 2")
def metrics(env):
    """EmbeddedDataStreamStreamTests.test_metrics: a counter, a meter, a gauge and a distribution"""
    sink = DataStreamTestSinkFunction()
    words = [("ab", "a", decimal.Decimal(1)), ("bdc", "a", decimal.Decimal(2))]
    words += [("cfgs", "a", decimal.Decimal(3)), ("deeefg", "a", decimal.Decimal(4))]
    source = env.from_collection(
        words, type_info=Types.TUPLE([Types.STRING(), Types.STRING(), Types.BIG_DEC()])
    )

    class Measured(MapFunction):
        def open(self, runtime_context: RuntimeContext):
            group = runtime_context.get_metrics_group()
            self.seen, self.exposed = 0, 0
            self.counter: Counter = group.counter("my_counter")
            self.meter: Meter = group.meter("my_meter", 1)
            group.gauge("my_gauge", lambda: self.exposed)
            self.distribution: Distribution = group.distribution("my_distribution")

        def map(self, value):
            self.seen += 1
            self.counter.inc()
            assert self.counter.get_count() == self.seen
            self.meter.mark_event(1)
            assert self.meter.get_count() == self.seen
            self.exposed += 1
            self.distribution.update(int(value[2]))
            return Row(value[0], len(value[0]), value[2])

    source.key_by(lambda v: v[1]).map(
        Measured(), output_type=Types.ROW([Types.STRING(), Types.INT(), Types.BIG_DEC()])
    ).add_sink(sink)

    def check():
        assert sorted(sink.get_results()) == [
            "+I[ab, 2, 1]",
            "+I[bdc, 3, 2]",
            "+I[cfgs, 4, 3]",
            "+I[deeefg, 6, 4]",
        ]

    return check


class CountPerWindow(ProcessWindowFunction):
    """The older windowing examples' CountWindowProcessFunction: (key, count)."""

    def process(self, key, context, elements):
        return [(key, len(list(elements)))]


def older_window_example(env, records, assigner, expected_windows):
    stream = keyed_by_word(env, records).window(assigner).process(CountPerWindow(), STR_INT_TUPLE)
    return collected(stream, [f"({k},{n})" for k, _, _, n in expected_windows])


@case("parallelism 1")
def example_tumbling_windowing(env):
    """examples/datastream/windowing/tumbling_windowing.py (the older tumbling example)"""
    assigner = TumblingEventTimeWindows.of(Time.milliseconds(5))
    return older_window_example(env, HI, assigner, fired(HI, flink_windows.tumbling(5)))


@case("parallelism 1")
def example_sliding_windowing(env):
    """examples/datastream/windowing/sliding_windowing.py (an explicit offset of 0)"""
    assigner = SlidingEventTimeWindows.of(Time.milliseconds(5), Time.milliseconds(2), Time.seconds(0))
    return older_window_example(env, HI, assigner, fired(HI, flink_windows.sliding(5, 2)))


@case("parallelism 1")
def example_session_with_gap_windowing(env):
    """examples/datastream/windowing/session_with_gap_windowing.py (a gap of 5 s)"""
    assigner = EventTimeSessionWindows.with_gap(Time.seconds(5))
    return older_window_example(env, HI_SESSIONS, assigner, fired(HI_SESSIONS, gap_of=lambda r: 5000))


@case("parallelism 1")
def example_session_with_dynamic_gap_windowing(env):
    """examples/datastream/windowing/session_with_dynamic_gap_windowing.py"""
    assigner = EventTimeSessionWindows.with_dynamic_gap(ValueAsGap())
    return older_window_example(env, HI_SESSIONS, assigner, fired(HI_SESSIONS, gap_of=lambda r: r[1]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_flink_case(name):
    checks, error = run_group(CASES[name][0])
    if error is not None:
        raise error
    checks[name]()
