"""The job's error policy: a record that a user function raises on fails the job (the default) or
goes to the dead-letter channel while the job goes on; input that cannot be accepted is refused at
the writer, with a clear error, and loses nothing already accepted."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import pyarrow as pa
import pytest

import stretch
from stretch import channels
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.errors import UserFunctionError

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])
N = 300


class RejectSevens(KeyedProcessFunction):
    def process_element(self, value, ctx):
        if value[1] % 7 == 0:
            raise ValueError(f"no sevens: {value[1]}")
        yield value


def _job(env, source):
    """Every stateless step and process_element reject some records, each for its own reason."""
    return (
        source.map(lambda r: r if r[1] % 11 else (r[0], 1 // 0), output_type=PAIR)
        .filter(lambda r: r[1] % 13 or r[1] / 0)
        .flat_map(lambda r: [r] if r[1] % 17 else [r, int("x")], output_type=PAIR)
        .key_by(lambda r: r[0] if r[1] % 19 else r[0] + [])
        .process(RejectSevens(), output_type=PAIR)
        .name("rejecting")
    )


def _rejected_by(v: int) -> str | None:
    for m, function in (
        (11, "map"),
        (13, "filter"),
        (17, "flat_map"),
        (19, "key selector"),
        (7, "process_element"),
    ):
        if v % m == 0:
            return function
    return None


def _start(policy: str, checkpoint_ms: int | None = None, n=N, source=None):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.set_error_policy(policy)
    if checkpoint_ms:
        env.enable_checkpointing(checkpoint_ms)
    stream = source(env) if source else env.from_collection([(v % 5, v) for v in range(1, n + 1)], PAIR)
    _job(env, stream).sink_to(ChannelSink("out"))
    return env.execute_async(f"policy-{random.randrange(1 << 40):x}")


def test_dead_letter_policy_routes_each_rejected_record_and_keeps_the_rest():
    started_ms = time.time() * 1000
    client = _start("dead_letter")
    assert client.wait(60).name == "FINISHED"
    out = sorted(tuple(r) for r in channels.open_reader(client, "out"))
    assert out == sorted((v % 5, v) for v in range(1, N + 1) if _rejected_by(v) is None)
    letters = list(channels.open_reader(client, "dead-letters"))
    by_value = {int(r.record.strip("()").split(", ")[1]): r for r in letters}
    assert len(by_value) == len(letters) == sum(1 for v in range(1, N + 1) if _rejected_by(v))
    for v, letter in by_value.items():
        assert _rejected_by(v) in letter.function, (v, letter.function)
        assert letter.operator
        assert letter.traceback.startswith("Traceback")
        assert started_ms - 1000 <= letter.time.to_epoch_milli() <= time.time() * 1000
    sevens = [letter for v, letter in by_value.items() if _rejected_by(v) == "process_element"]
    assert sevens and all(
        letter.key == repr(int(letter.record.strip("()").split(", ")[0])) for letter in sevens
    )
    assert all("ValueError: no sevens" in letter.error for letter in sevens)


class YieldThenRejectSevens(KeyedProcessFunction):
    def process_element(self, value, ctx):
        yield value
        if value[1] % 7 == 0:
            raise ValueError(f"no sevens: {value[1]}")
        yield (value[0], -value[1])


def test_a_rejected_record_takes_back_what_it_yielded_before_it_raised():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.set_error_policy("dead_letter")
    values = range(1, N + 1)
    env.from_collection([(v % 5, v) for v in values], PAIR).key_by(lambda r: r[0]).process(
        YieldThenRejectSevens(), output_type=PAIR
    ).sink_to(ChannelSink("out"))
    client = env.execute_async(f"take-back-{random.randrange(1 << 40):x}")
    assert client.wait(60).name == "FINISHED"
    kept = [v for v in values if v % 7]
    want = sorted([(v % 5, v) for v in kept] + [(v % 5, -v) for v in kept])
    assert sorted(tuple(r) for r in channels.open_reader(client, "out")) == want
    assert len(list(channels.open_reader(client, "dead-letters"))) == N // 7


def test_fail_policy_names_operator_function_key_and_record():
    client = _start("fail")
    with pytest.raises(UserFunctionError) as info:
        client.wait(60)
    message = str(info.value)
    assert "map function" in message and "ZeroDivisionError" in message
    assert "record (1, 11)" in message and "User code traceback" in message
    user_part = message.split("User code traceback (worker process):\n", 1)[1]
    frames = [line for line in user_part.splitlines() if line.lstrip().startswith("File ")]
    engine = str(Path(stretch.__file__).parent) + os.sep
    assert frames and all(engine not in f for f in frames)  # the user's frames, not the engine's
    assert __file__ in frames[0]


def test_dead_letters_are_exactly_once_across_a_worker_kill():
    n = 20_000

    def source(env):
        from stretch.datastream.connectors.datagen import DataGeneratorSource, RateLimiterStrategy

        gen = DataGeneratorSource(
            generator_function=lambda i: ((i + 1) % 5, i + 1),
            count=n,
            rate_limiter_strategy=RateLimiterStrategy.per_second(50_000),
            batch_rows=500,
            type_info=PAIR,
        )
        return env.from_source(gen, None, "numbers")

    client = _start("dead_letter", checkpoint_ms=50, n=n, source=source)
    co = client._coordinator
    time.sleep(0.2)
    os.kill(random.choice([w for w in co.workers.all() if w.task is not None]).pid, signal.SIGKILL)
    assert client.wait(60).name == "FINISHED"
    assert len(co.recoveries) == 1
    out = sorted(tuple(r) for r in channels.open_reader(client, "out"))
    assert out == sorted((v % 5, v) for v in range(1, n + 1) if _rejected_by(v) is None)
    letters = sorted(
        int(r.record.strip("()").split(", ")[1]) for r in channels.open_reader(client, "dead-letters")
    )
    assert letters == [v for v in range(1, n + 1) if _rejected_by(v)]


@pytest.mark.parametrize("policy", ["fail", "dead_letter"])
def test_input_the_job_cannot_accept_is_refused_at_the_writer_and_loses_nothing(policy, tmp_path):
    client = _start(policy, source=lambda env: env.from_source(ChannelSource("in", PAIR), None, "in"))
    co = client._coordinator
    accepted = [(v % 5, v) for v in range(1, 200) if _rejected_by(v) is None]
    try:
        writer = channels.open_writer(client, "in")
        writer.write(accepted[:100])
        with pytest.raises(TypeError, match="expected LONG"):  # a record of the wrong type
            writer.write([(1, 2), (1, "three")])
        with pytest.raises(ValueError, match="does not match channel 'in'"):  # another schema
            writer.write(pa.record_batch({"f0": [1], "f1": [1.5]}))
        big = pa.record_batch({"f0": pa.array([1], pa.int64()), "f1": pa.array([2], pa.int64())})
        gate = writer._gate
        limit = gate.max_entry_bytes
        gate.max_entry_bytes = 8  # as if the record were larger than the gate
        with pytest.raises(ValueError, match="does not fit a gate"):  # an oversized record
            writer.write(big)
        gate.max_entry_bytes = limit
        staged = co.channels.publisher.staging / "broken.arrows"  # undecodable data from an outside writer
        staged.write_bytes(b"not arrow at all" * 100)
        with pytest.raises(pa.ArrowInvalid):
            co.channels.publisher.publish("in", "q", 0, [str(staged)])
        writer.write(accepted[100:])
        writer.end()
        assert client.wait(60).name == "FINISHED"
    finally:
        if not co.done:
            client.cancel()
            client.wait(30)
    assert sorted(tuple(r) for r in channels.open_reader(client, "out")) == sorted(accepted)
    if policy == "dead_letter":  # refused input never entered the job: no dead letters for it
        assert list(channels.open_reader(client, "dead-letters")) == []


def test_unknown_policy_is_refused():
    env = StreamExecutionEnvironment.get_execution_environment()
    with pytest.raises(ValueError, match="'fail' or 'dead_letter'"):
        env.set_error_policy("ignore")


class Unprintable(Exception):
    """A user's exception whose own ``__str__`` raises."""

    def __str__(self):
        raise RuntimeError("no str for you")


def _reject_elevens_unprintably(r):
    if r[1] % 11 == 0:
        raise Unprintable()
    return r


class RejectSevensUnprintably(KeyedProcessFunction):
    def process_element(self, value, ctx):
        if value[1] % 7 == 0:
            raise Unprintable()
        yield value


def _unprintable_job(policy: str, where: str):
    """``where`` ("map" or "process_element") rejects records with an exception that cannot be
    printed: multiples of 11 or of 7."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.set_error_policy(policy)
    stream = env.from_collection([(v % 5, v) for v in range(1, N + 1)], PAIR)
    if where == "map":
        stream = stream.map(_reject_elevens_unprintably, output_type=PAIR).name("unprintable")
    else:
        stream = stream.key_by(lambda r: r[0]).process(RejectSevensUnprintably(), output_type=PAIR)
        stream = stream.name("unprintable")
    stream.sink_to(ChannelSink("out"))
    return env.execute_async(f"unprintable-{random.randrange(1 << 40):x}")


PLACEHOLDER = "Unprintable: <exception str() failed: RuntimeError: no str for you>"


@pytest.mark.parametrize("where, m", [("map", 11), ("process_element", 7)])
def test_dead_letters_take_an_exception_whose_str_raises(where, m):
    client = _unprintable_job("dead_letter", where)
    assert client.wait(60).name == "FINISHED"
    out = sorted(tuple(r) for r in channels.open_reader(client, "out"))
    assert out == sorted((v % 5, v) for v in range(1, N + 1) if v % m)
    letters = list(channels.open_reader(client, "dead-letters"))
    assert sorted(int(r.record.strip("()").split(", ")[1]) for r in letters) == list(range(m, N + 1, m))
    assert all(r.operator == "unprintable" and r.error == PLACEHOLDER for r in letters)


@pytest.mark.parametrize("where, m", [("map", 11), ("process_element", 7)])
def test_fail_policy_names_an_exception_whose_str_raises(where, m):
    client = _unprintable_job("fail", where)
    with pytest.raises(UserFunctionError) as info:
        client.wait(60)
    message = str(info.value)
    assert f"{where if where != 'map' else 'map function'} of operator 'unprintable'" in message
    assert PLACEHOLDER in message
    failed_on = re.search(r"failed on record \((\d), (\d+)\)", message)  # instances race to fail first
    assert failed_on and int(failed_on[2]) % m == 0 and int(failed_on[1]) == int(failed_on[2]) % 5
    assert isinstance(info.value.__cause__, Unprintable)


def _key_of(x: int):
    """Int keys, but for some records after the first batch (65,536 records): a str or a tuple."""
    if x >= 65_536 and x % 3 == 0:
        return f"k{x % 10}" if x % 2 else (x % 10, "t")
    return x % 10


@pytest.mark.parametrize("aggregate", ["sum", "reduce"])
def test_dead_letters_take_the_records_whose_keys_the_operator_cannot_hold(aggregate):
    n = 70_000
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.set_error_policy("dead_letter")
    keyed = env.from_collection(list(range(n)), Types.LONG()).key_by(_key_of)
    summed = keyed.sum(0) if aggregate == "sum" else keyed.reduce(lambda a, b: a + b)
    summed.name("summing").sink_to(ChannelSink("out"))
    client = env.execute_async(f"key-types-{random.randrange(1 << 40):x}")
    assert client.wait(60).name == "FINISHED"
    acc, want = {}, []
    for x in range(n):
        k = _key_of(x)
        if isinstance(k, int):
            acc[k] = acc.get(k, 0) + x
            want.append(acc[k])
    assert sorted(channels.open_reader(client, "out")) == sorted(want)
    letters = list(channels.open_reader(client, "dead-letters"))
    assert sorted(int(r.record) for r in letters) == [x for x in range(n) if not isinstance(_key_of(x), int)]
    for r in letters:
        key = _key_of(int(r.record))
        assert r.operator == "summing" and r.function == "key type" and r.key == repr(key)
        assert r.error == (
            f"TypeError: operator 'summing': record {r.record} has key {key!r} of type {type(key).__name__}, "
            "but the operator's keys are int; one operator's keys must share one type, as in Flink: "
            "make the key selector return one type"
        )
