"""Broadcast state: a rules stream broadcast to a (keyed or not) events stream, against a
plain-Python model that applies the rules in gate order, at parallelism 1 and 2, under a live
rescale and across a checkpoint and restore."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from stretch import channels
from stretch.common import Types
from stretch.datastream import (
    BroadcastProcessFunction,
    KeyedBroadcastProcessFunction,
    StreamExecutionEnvironment,
)
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.state import MapStateDescriptor, ValueStateDescriptor

RECORD = Types.TUPLE([Types.INT(), Types.STRING(), Types.LONG()])  # (0 event | 1 rule, name, value)
OUT = Types.TUPLE([Types.STRING(), Types.STRING(), Types.LONG(), Types.LONG()])
LIMITS = MapStateDescriptor("limits", Types.STRING(), Types.LONG())


class Flag(KeyedBroadcastProcessFunction):
    """Rules set a limit per key prefix (a negative one removes it); each event reports its key's
    running count and the limit in force for it."""

    def open(self, runtime_context):
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))

    def process_element(self, value, ctx):
        key, _ = value
        assert ctx.get_current_key() == key
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        limit = ctx.get_broadcast_state(LIMITS).get(key[0])
        yield "event", key, n, -1 if limit is None else limit

    def process_broadcast_element(self, value, ctx):
        name, limit = value
        limits = ctx.get_broadcast_state(LIMITS)
        if limit < 0:
            limits.remove(name)
        else:
            limits.put(name, limit)
        yield "rule", name, limit, len(limits.keys())


class Unkeyed(BroadcastProcessFunction):
    def process_element(self, value, ctx):
        key, amount = value
        limit = ctx.get_broadcast_state(LIMITS).get(key[0])
        yield "event", key, amount, -1 if limit is None else limit

    def process_broadcast_element(self, value, ctx):
        name, limit = value
        ctx.get_broadcast_state(LIMITS).put(name, limit)
        yield "rule", name, limit, 0


def _model(batches, keyed: bool = True) -> list:
    """The reference: rules and events in the order they were written (the gate's order)."""
    limits: dict = {}
    counts: dict = {}
    out = []
    for batch in batches:
        for kind, name, value in batch:
            if kind == 1:
                if value < 0 and keyed:
                    limits.pop(name, None)
                else:
                    limits[name] = value
                out.append(("rule", name, value, len(limits) if keyed else 0))
            else:
                counts[name] = counts.get(name, 0) + 1
                shown = counts[name] if keyed else value
                out.append(("event", name, shown, limits.get(name[0], -1)))
    return sorted(out)


def _batches(n: int, seed: int) -> list[list]:
    """Batches of only events or only rules (a batch of the channel is one entry of the gate)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.3:
            out.append(
                [(1, rng.choice("abc"), rng.choice([-1, 5, 10, 20])) for _ in range(rng.randint(1, 3))]
            )
        else:
            out.append(
                [(0, f"{rng.choice('abc')}{rng.randint(0, 9)}", rng.randint(0, 99)) for _ in range(20)]
            )
    return out


def _job(parallelism: int, keyed: bool = True, checkpointing: bool = False, name: str | None = None):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    if checkpointing:
        env.enable_checkpointing()  # on demand
    src = env.from_source(ChannelSource("in", RECORD, durable=checkpointing), None, "in")
    rules = src.filter(lambda r: r[0] == 1).map(lambda r: (r[1], r[2]))
    events = src.filter(lambda r: r[0] == 0).map(lambda r: (r[1], r[2]))
    if keyed:
        connected = events.key_by(lambda e: e[0]).connect(rules.broadcast(LIMITS))
        fn = Flag()
    else:
        connected = events.connect(rules.broadcast(LIMITS))
        fn = Unkeyed()
    connected.process(fn, OUT).name("flag").sink_to(ChannelSink("out"))
    return env, name or f"broadcast {parallelism} {keyed} {time.monotonic_ns()}"


def _run(batches, parallelism: int, keyed: bool = True, rescale_to: int | None = None) -> list:
    """The job's output; with ``rescale_to``, rescaled once the first half's output is out (so
    that the added instances start at a marker with rules before it)."""
    env, name = _job(parallelism, keyed)
    client = env.execute_async(name)
    writer = channels.open_writer(client, "in")
    reader = channels.open_reader(client, "out")
    got = []
    half = len(batches) // 2 if rescale_to is not None else len(batches)
    for batch in batches[:half]:
        writer.write(batch)
    if rescale_to is not None:
        expected = sum(len(b) for b in batches[:half])
        while len(got) < expected:
            got.extend(reader.read_batch(timeout=30).to_pylist())
        assert client.rescale("flag", rescale_to).state_bytes_copied == 0
    for batch in batches[half:]:
        writer.write(batch)
    writer.end()
    assert client.wait(60).name == "FINISHED"
    return sorted([*(tuple(r.values()) for r in got), *(tuple(r) for r in reader)])


@pytest.mark.parametrize("parallelism", [1, 2])
def test_every_event_sees_the_rules_before_it_in_the_gate(parallelism):
    batches = _batches(60, parallelism)
    assert _run(batches, parallelism) == _model(batches)


def test_an_instance_added_by_a_live_rescale_starts_with_the_broadcast_state():
    batches = _batches(60, 7)
    assert _run(batches, 1, rescale_to=3) == _model(batches)


@pytest.mark.parametrize("parallelism", [1, 2])
def test_a_non_keyed_stream_connected_to_a_broadcast_stream(parallelism):
    batches = [[(k, n, abs(v)) for k, n, v in b] for b in _batches(40, 11)]
    assert _run(batches, parallelism, keyed=False) == _model(batches, keyed=False)


def test_the_broadcast_state_is_restored_from_a_checkpoint():
    batches = _batches(40, 5)
    half = len(batches) // 2
    env, name = _job(2, checkpointing=True)
    client = env.execute_async(name)
    writer = channels.open_writer(client, "in")
    for batch in batches[:half]:
        writer.write(batch)
    client.trigger_checkpoint()  # covers the first half: the state as of it is saved
    client.cancel()
    client.wait(30)
    env, _ = _job(2, checkpointing=True)
    client = env.execute_async(name, restore=True)
    writer = channels.open_writer(client, "in")
    for batch in batches[half:]:
        writer.write(batch)
    writer.end()
    assert client.wait(60).name == "FINISHED"
    got = sorted(tuple(r) for r in channels.open_reader(client, "out", from_offset=0))
    assert got == _model(batches)


def test_read_only_broadcast_state_and_unknown_descriptors_are_refused():
    class Writes(KeyedBroadcastProcessFunction):
        def process_element(self, value, ctx):
            ctx.get_broadcast_state(LIMITS).put("x", 1)
            yield value

        def process_broadcast_element(self, value, ctx):
            yield value

    env = StreamExecutionEnvironment.get_execution_environment()
    rules = env.from_collection([("a", 1)]).broadcast(LIMITS)
    with pytest.raises(TypeError, match="KeyedBroadcastProcessFunction"):
        env.from_collection([("a", 1)]).key_by(lambda e: e[0]).connect(rules).process(Unkeyed())
    with pytest.raises(TypeError, match="MapStateDescriptor"):
        env.from_collection([1]).broadcast(ValueStateDescriptor("v", Types.LONG()))
    env.from_collection([("a", 1)]).key_by(lambda e: e[0]).connect(rules).process(Writes()).print()
    with pytest.raises(Exception, match="read-only"):
        env.execute("read-only broadcast state")


class Logging(Flag):
    """Flag, and a line in a file for every call of process_broadcast_element (a side effect)."""

    def __init__(self, path: str):
        self.path = path

    def process_broadcast_element(self, value, ctx):
        with open(self.path, "a") as f:
            f.write(f"{value}\n")
        yield from super().process_broadcast_element(value, ctx)


@pytest.mark.parametrize("parallelism", [1, 4])
def test_one_shared_copy_process_broadcast_element_runs_once_per_element(parallelism, tmp_path):
    """The broadcast state is one copy in shared memory: each broadcast element is applied once,
    whatever the parallelism (Flink applies it once per instance), and the results are exact."""
    log = tmp_path / "calls.txt"
    batches = _batches(40, 21)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    src = env.from_source(ChannelSource("in", RECORD), None, "in")
    rules = src.filter(lambda r: r[0] == 1).map(lambda r: (r[1], r[2]))
    events = src.filter(lambda r: r[0] == 0).map(lambda r: (r[1], r[2]))
    connected = events.key_by(lambda e: e[0]).connect(rules.broadcast(LIMITS))
    connected.process(Logging(str(log)), OUT).name("flag").sink_to(ChannelSink("out"))
    client = env.execute_async(f"broadcast once {parallelism} {time.monotonic_ns()}")
    writer = channels.open_writer(client, "in")
    for batch in batches:
        writer.write(batch)
    writer.end()
    assert client.wait(60).name == "FINISHED"
    assert sorted(tuple(r) for r in channels.open_reader(client, "out")) == _model(batches)
    rules_written = [(n, v) for b in batches for k, n, v in b if k == 1]
    assert log.read_text().splitlines() == [str(r) for r in rules_written]


def test_a_kill_9_of_an_instance_loses_and_duplicates_nothing():
    """A recovery rebuilds the versions from the checkpoint's broadcast state: exact output."""
    batches = _batches(80, 31)
    env, name = _job(2, checkpointing=True)
    env.get_checkpoint_config().set_checkpoint_interval(30)
    client = env.execute_async(name)
    co = client._coordinator
    writer = channels.open_writer(client, "in")
    stage = co.plan.stage("flag").id
    for i, batch in enumerate(batches):
        writer.write(batch)
        time.sleep(0.005)
        if i == len(batches) // 2:
            victim = next(w for w in co.workers.all() if w.task and w.task[0] == stage and w.pid)
            os.kill(victim.pid, signal.SIGKILL)
    writer.end()
    assert client.wait(60).name == "FINISHED"
    assert len(co.recoveries) == 1
    assert sorted(tuple(r) for r in channels.open_reader(client, "out")) == _model(batches)
