"""Every error path: a clear exception at the call or record that caused it, and nothing leaked."""

from __future__ import annotations

import pytest

from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, MapFunction, StreamExecutionEnvironment
from stretch.datastream.state import ListStateDescriptor, ValueStateDescriptor
from stretch.errors import JobCancellationError, UserFunctionError


def env(p=2):
    e = StreamExecutionEnvironment.get_execution_environment()
    e.set_parallelism(p)
    return e


class FailsOnSeven(KeyedProcessFunction):
    def open(self, runtime_context):
        self.n = runtime_context.get_state(ValueStateDescriptor("n", Types.LONG()))

    def process_element(self, value, ctx):
        self.n.update((self.n.value() or 0) + 1)
        if value[1] == 7:
            raise ZeroDivisionError("seven is not welcome")
        yield value


def test_user_function_error_names_operator_key_record_and_traceback():
    records = [(f"k{i % 3}", i) for i in range(20)]
    ds = env().from_collection(records, Types.TUPLE([Types.STRING(), Types.LONG()]))
    ds.key_by(lambda r: r[0]).process(FailsOnSeven()).name("picky").print()
    with pytest.raises(UserFunctionError) as info:
        env_ = ds.get_execution_environment()
        env_.execute("failing job")
    text = str(info.value)
    assert "'picky'" in text
    assert "('k1', 7)" in text
    assert "key 'k1'" in text
    assert "ZeroDivisionError: seven is not welcome" in text
    assert 'raise ZeroDivisionError("seven is not welcome")' in text  # the user's own code line
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_user_error_while_collecting_is_raised_by_the_iterator():
    records = [("a", i) for i in range(50)]
    ds = env().from_collection(records, Types.TUPLE([Types.STRING(), Types.LONG()]))
    with pytest.raises(UserFunctionError, match="process_element"):
        with ds.key_by(lambda r: r[0]).process(FailsOnSeven()).execute_and_collect() as it:
            list(it)


def test_map_error_names_the_record():
    ds = env().from_collection([1, 2, 0, 4], Types.LONG())
    with pytest.raises(UserFunctionError, match=r"map function of operator .* record 0"):
        ds.map(lambda x: 10 // x).execute_and_collect(limit=10)


@pytest.mark.parametrize("keyed", [False, True])
def test_a_failing_step_is_named_as_the_user_named_it(keyed):
    ds = env().from_collection([("a", 1), ("b", 0)], Types.TUPLE([Types.STRING(), Types.LONG()]))
    if keyed:
        ds = ds.key_by(lambda r: r[0])
    failing = ds.map(lambda r: 10 // r[1]).name("divider")
    with pytest.raises(
        UserFunctionError, match=r"map function of operator 'divider' failed on record \('b', 0\)"
    ):
        failing.execute_and_collect(limit=5)


def test_key_that_cannot_be_hashed_is_a_type_error_naming_the_record():
    ds = env().from_collection([("a", 1), ("b", 2)], Types.TUPLE([Types.STRING(), Types.LONG()]))
    with pytest.raises(
        TypeError, match=r"record \('b', 2\) has key \{'b'\}"
    ):  # (a list is fine, as in Flink)
        ds.key_by(lambda r: {r[0]} if r[0] == "b" else r[0]).sum(1).execute_and_collect(limit=5)


def test_parallelism_above_max_parallelism_fails_at_the_call():
    e = StreamExecutionEnvironment.get_execution_environment()
    e.set_max_parallelism(128)
    with pytest.raises(ValueError, match=r"above the max parallelism 128 .* set_max_parallelism"):
        e.set_parallelism(129)
    e.set_max_parallelism(16)
    ds = e.from_collection([1, 2, 3], Types.LONG())
    with pytest.raises(ValueError, match="above the max parallelism 16"):
        ds.key_by(lambda x: x).sum(0).set_parallelism(17)
    with pytest.raises(ValueError):
        e.set_parallelism(0)


def test_record_not_matching_declared_type_fails_at_from_collection():
    e = StreamExecutionEnvironment.get_execution_environment()
    with pytest.raises(TypeError, match=r"record 2 \('c', 'x'\) .* field 1 expected LONG, got str 'x'"):
        e.from_collection([("a", 1), ("b", 2), ("c", "x")], Types.TUPLE([Types.STRING(), Types.LONG()]))


def test_output_not_matching_declared_output_type_fails_naming_operator_and_output():
    ds = env().from_collection([1, 2, 3], Types.LONG())
    bad = ds.map(lambda x: "x" if x == 2 else x, output_type=Types.LONG()).name("mapper")
    with pytest.raises(TypeError) as info:
        bad.key_by(lambda x: 0).sum(0).execute_and_collect(limit=5)
    # no index: a position within some batch of the operator's outputs would mean nothing
    assert (
        str(info.value)
        == "operator 'mapper': its output 'x' does not match Types.LONG(): expected LONG, got str 'x'"
    )


class Echoes(KeyedProcessFunction):
    def process_element(self, value, ctx):
        yield ("k", "y" * 1000) if value == 3 else ("k", value)


def test_keyed_output_not_matching_declared_type_names_operator_and_a_shortened_output():
    ds = env().from_collection([1, 2, 3, 4], Types.LONG()).key_by(lambda x: x)
    out = ds.process(Echoes(), Types.ROW([Types.STRING(), Types.LONG()])).name("echo")
    with pytest.raises(TypeError) as info:
        out.execute_and_collect(limit=10)
    text = str(info.value)
    shortened = repr(("k", "y" * 1000))[:197] + "..."
    assert text.startswith(f"operator 'echo': its output {shortened} does not match Types.ROW(")
    assert text.endswith("field 1 expected LONG, got str " + repr("y" * 1000)[:197] + "...")


class UpdatesState(KeyedProcessFunction):
    """Puts ``bad(value)`` (or the value itself, if None) into a state of the declared type."""

    def __init__(self, descriptor, bad):
        self.descriptor = descriptor
        self.bad = bad

    def open(self, ctx):
        d = self.descriptor
        self.s = ctx.get_list_state(d) if isinstance(d, ListStateDescriptor) else ctx.get_state(d)

    def process_element(self, value, ctx):
        new = self.bad(value)
        new = value if new is None else new
        if isinstance(self.descriptor, ListStateDescriptor):
            self.s.add(new)
        else:
            self.s.update(new)
        yield value


@pytest.mark.parametrize(
    "descriptor, bad, declared, shown",
    [
        (
            ValueStateDescriptor("s", Types.LONG()),
            lambda v: "abc" if v == 3 else None,
            "Types.LONG()",
            "'abc'",
        ),
        (ListStateDescriptor("l", Types.INT()), lambda v: 1.5 if v == 3 else None, "Types.INT()", "1.5"),
        (ListStateDescriptor("l", Types.INT()), lambda v: "7" if v == 3 else None, "Types.INT()", "'7'"),
    ],
)
def test_state_given_a_value_of_another_type_fails_naming_operator_record_state_and_value(
    descriptor, bad, declared, shown
):
    ds = env().from_collection([1, 2, 3, 4], Types.LONG())
    with pytest.raises(UserFunctionError) as info:
        ds.key_by(lambda x: x).process(UpdatesState(descriptor, bad)).name("stateful").execute_and_collect(
            limit=5
        )
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith(
        "process_element of operator 'stateful' failed on record 3, key 3: TypeError: "
    )
    assert f"state {descriptor.name!r}" in first_line and declared in first_line and shown in first_line
    assert isinstance(info.value.__cause__, TypeError)


def test_state_value_beyond_its_column_range_fails_naming_operator_and_key():
    ds = env().from_collection([1, 2, 3, 4], Types.LONG())
    big = UpdatesState(ValueStateDescriptor("small", Types.INT()), lambda v: 2**40 if v == 3 else None)
    with pytest.raises(TypeError) as info:
        ds.key_by(lambda x: x * 10).process(big).name("stateful").execute_and_collect(limit=5)
    text = str(info.value)
    assert text.startswith("operator 'stateful', key 30: state 'small' is declared Types.INT()")
    assert str(2**40) in text


@pytest.mark.parametrize("aggregate", ["sum", "reduce"])
def test_keys_of_one_operator_must_share_a_type(aggregate):
    ds = env(2).from_collection(list(range(70000)) + [-1], Types.LONG())  # the first batch: int keys
    keyed = ds.key_by(lambda x: "minus one" if x < 0 else x % 10)
    summed = keyed.sum(0) if aggregate == "sum" else keyed.reduce(lambda a, b: a + b)
    with pytest.raises(TypeError) as info:
        with summed.name("summing").execute_and_collect() as it:
            list(it)
    assert str(info.value) == (
        "operator 'summing': record -1 has key 'minus one' of type str, but the operator's keys are "
        "int; one operator's keys must share one type, as in Flink: make the key selector return one type"
    )


def test_an_operator_whose_keys_are_mixed_takes_any_key():
    ds = env(2).from_collection(list(range(70000)), Types.LONG())  # the first batch: mixed keys
    summed = ds.key_by(lambda x: (x % 3, "t") if x < 10 else x % 3).reduce(lambda a, b: a + b)
    with summed.execute_and_collect() as it:
        got = sorted(it)
    acc, want = {}, []
    for x in range(70000):
        k = (x % 3, "t") if x < 10 else x % 3
        acc[k] = acc.get(k, 0) + x
        want.append(acc[k])
    assert got == sorted(want)


def test_cancel_of_a_running_job_leaves_nothing_behind():
    from stretch.datastream.connectors import DataGeneratorSource, DiscardingSink

    e = env()
    source = DataGeneratorSource(
        lambda i: (i % 5, i), count=None, type_info=Types.TUPLE([Types.LONG(), Types.LONG()])
    )
    e.from_source(source, None, "endless").key_by(lambda r: r[0]).sum(1).sink_to(DiscardingSink())
    client = e.execute_async("endless")
    assert client.wait(1.0).name == "RUNNING"
    client.cancel()
    assert client.get_job_status().result().name == "CANCELED"
    with pytest.raises(JobCancellationError, match="was cancelled"):  # as Flink's result does
        client.get_job_execution_result().result(10)


class CannotConnect(MapFunction):
    def open(self, runtime_context):
        raise ConnectionError("lookup service unreachable")

    def map(self, value):
        return value


class BadConfig(KeyedProcessFunction):
    def open(self, runtime_context):
        raise ValueError("no such setting")

    def process_element(self, value, ctx):
        yield value


@pytest.mark.parametrize(
    ("build", "operator", "cause"),
    [
        (lambda s: s.map(CannotConnect(), Types.LONG()).name("lookup"), "lookup", ConnectionError),
        (
            lambda s: s.key_by(lambda v: v % 3).process(BadConfig()).name("configured"),
            "configured",
            ValueError,
        ),
    ],
)
def test_an_open_that_raises_names_its_operator_and_says_open(build, operator, cause):
    e = env()
    build(e.from_collection(list(range(10)), Types.LONG())).print()
    with pytest.raises(UserFunctionError) as info:
        e.execute("open fails")
    assert str(info.value).startswith(f"open() of operator {operator!r} failed: {cause.__name__}")
    assert isinstance(info.value.__cause__, cause)
    assert "raise" in str(info.value)  # the user's own source line, from the worker's traceback
