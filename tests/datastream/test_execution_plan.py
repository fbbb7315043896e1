"""BATCH execution mode and the JSON execution plan, against plain-Python models of Flink's."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import defaultdict

import pytest

from stretch.common import Configuration, Types
from stretch.datastream import (
    KeyedProcessFunction,
    RuntimeExecutionMode,
    StreamExecutionEnvironment,
)
from stretch.datastream.connectors.channel import ChannelSource

PARALLELISM = [1, 2, 4]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "the", "end", "fox"]


def batch_env(parallelism: int, mode=RuntimeExecutionMode.BATCH) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.set_runtime_mode(mode)
    return env


@pytest.mark.parametrize("parallelism", PARALLELISM)
def test_batch_word_count_emits_each_key_once_with_its_final_count(parallelism):
    rng = random.Random(parallelism)
    lines = [" ".join(rng.choices(WORDS, k=rng.randrange(1, 8))) for _ in range(300)]
    env = batch_env(parallelism)
    counts = (
        env.from_collection(lines)
        .flat_map(lambda line: [(w, 1) for w in line.split()], Types.TUPLE([Types.STRING(), Types.INT()]))
        .key_by(lambda p: p[0])
        .sum(1)
    )
    got = sorted(counts.execute_and_collect())
    want = defaultdict(int)
    for line in lines:
        for w in line.split():
            want[w] += 1
    assert got == sorted(want.items())  # one record per key: no rolling updates


@pytest.mark.parametrize("parallelism", PARALLELISM)
def test_batch_reduce_min_and_max_by_are_final_values(parallelism):
    rng = random.Random(7)
    data = [(f"k{rng.randrange(6)}", rng.randrange(1000)) for _ in range(400)]
    typ = Types.TUPLE([Types.STRING(), Types.INT()])

    def run(build):
        return sorted(
            build(
                batch_env(parallelism).from_collection(data, typ).key_by(lambda r: r[0])
            ).execute_and_collect()
        )

    by_key = defaultdict(list)
    for k, v in data:
        by_key[k].append(v)
    assert run(lambda ks: ks.reduce(lambda a, b: (a[0], a[1] + b[1]))) == sorted(
        (k, sum(vs)) for k, vs in by_key.items()
    )
    assert run(lambda ks: ks.max_by(1)) == sorted((k, max(vs)) for k, vs in by_key.items())
    assert run(lambda ks: ks.min(1)) == sorted((k, min(vs)) for k, vs in by_key.items())


class CountThenReport(KeyedProcessFunction):
    """Per record output as in STREAMING; an event-time timer reports the key's count."""

    def open(self, runtime_context):
        from stretch.datastream.state import ValueStateDescriptor

        self.n = runtime_context.get_state(ValueStateDescriptor("n", Types.LONG()))

    def process_element(self, value, ctx):
        self.n.update((self.n.value() or 0) + 1)
        ctx.timer_service().register_event_time_timer(10**12)
        yield "seen", value

    def on_timer(self, timestamp, ctx):
        yield "total", (ctx.get_current_key(), self.n.value())


@pytest.mark.parametrize("parallelism", PARALLELISM)
def test_batch_process_function_runs_per_record_and_timers_fire_at_the_end(parallelism):
    data = [f"k{i % 5}" for i in range(100)]
    got = batch_env(parallelism).from_collection(data).key_by(lambda r: r).process(CountThenReport())
    out = sorted(got.execute_and_collect())
    assert out == sorted([("seen", r) for r in data] + [("total", (f"k{i}", 20)) for i in range(5)])


def test_batch_mode_refuses_an_unbounded_source_and_automatic_streams_it():
    env = batch_env(1)
    env.from_source(ChannelSource("in"), None, "in").key_by(lambda r: r).sum(0).print()
    with pytest.raises(ValueError, match="BATCH execution mode needs bounded sources, and 'in'"):
        env.execute_async("batch")
    auto = batch_env(1, RuntimeExecutionMode.AUTOMATIC)
    auto.from_collection([("a", 1), ("a", 2)]).key_by(lambda r: r[0]).sum(1).print()
    plan_only = json.loads(auto.get_execution_plan())  # AUTOMATIC on bounded input: BATCH
    assert [n["type"] for n in plan_only["nodes"]][-1] == "Sink: Print to Std. Out"


def test_configuration_sets_mode_and_parallelism():
    conf = Configuration().set_string("execution.runtime-mode", "batch").set_integer("parallelism.default", 3)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    assert env.get_parallelism() == 3
    got = sorted(
        env.from_collection([("a", 1), ("b", 2), ("a", 3)])
        .key_by(lambda r: r[0])
        .sum(1)
        .execute_and_collect()
    )
    assert got == [("a", 4), ("b", 2)]


def test_execution_plan_has_flinks_shape():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(3)
    ds = env.from_collection([(1, "a")], Types.TUPLE([Types.INT(), Types.STRING()]))
    ds.map(lambda r: r, Types.TUPLE([Types.INT(), Types.STRING()])).key_by(lambda r: r[1]).sum(0).print()
    plan = json.loads(env.get_execution_plan())
    got = [(n["id"], n["type"], n["pact"], n["parallelism"], n.get("predecessors")) for n in plan["nodes"]]
    fwd = "FORWARD"
    assert got == [
        (1, "Source: Collection Source", "Data Source", 1, None),
        (2, "Map", "Operator", 1, [{"id": 1, "ship_strategy": fwd, "side": "second"}]),
        (3, "Sum", "Operator", 3, [{"id": 2, "ship_strategy": "HASH", "side": "second"}]),
        (4, "Sink: Print to Std. Out", "Data Sink", 3, [{"id": 3, "ship_strategy": fwd, "side": "second"}]),
    ]


KEYS = 37
PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])


def _pairs(i: int, n: int):
    import numpy as np
    import pyarrow as pa

    idx = np.arange(i, i + n, dtype=np.int64)
    return pa.record_batch([pa.array(idx % KEYS), pa.array(idx)], names=["f0", "f1"])


def _batch_sums_job(n: int, checkpointing: bool):
    from stretch.datastream.connectors.datagen import DataGeneratorSource, RateLimiterStrategy

    env = batch_env(2)
    if checkpointing:
        env.enable_checkpointing(50)
    src = DataGeneratorSource(
        batch_function=_pairs,
        count=n,
        rate_limiter_strategy=RateLimiterStrategy.per_second(40_000),
        batch_rows=500,
        type_info=PAIR,
    )
    sums = (
        env.from_source(src, None, "numbers").key_by(lambda r: r[0]).reduce(lambda a, b: (a[0], a[1] + b[1]))
    )
    return sums.name("sums").execute_and_collect(f"batch-{random.randrange(1 << 40):x}")


def _final_sums(n: int) -> list:
    totals = defaultdict(int)
    for i in range(n):
        totals[i % KEYS] += i
    return sorted(totals.items())


def test_batch_reduce_keeps_its_final_values_across_live_rescales():
    n = 80_000
    results = _batch_sums_job(n, checkpointing=False)
    client = results._client
    rng = random.Random(4)
    with results:
        for p in (4, 1, 3):
            time.sleep(rng.uniform(0.05, 0.12))
            client.rescale("sums", p)
        got = sorted(tuple(r) for r in results)
    assert got == _final_sums(n)  # one output per key, at the end, whatever moved in between


def test_batch_reduce_is_exact_across_a_kill_9_recovery():
    n = 80_000
    results = _batch_sums_job(n, checkpointing=True)
    co = results._coordinator
    with results:
        time.sleep(0.2)
        busy = [w for w in co.workers.all() if w.task is not None and w.pid]
        os.kill(random.choice(busy).pid, signal.SIGKILL)
        got = sorted(tuple(r) for r in results)
    assert len(co.recoveries) == 1
    assert got == _final_sums(n)


class RemindLater(KeyedProcessFunction):
    """A processing-time timer an hour ahead: BATCH fires it at the end of input, STREAMING never
    (the job ends first)."""

    def process_element(self, value, ctx):
        if value < 5:
            ctx.timer_service().register_processing_time_timer(
                ctx.timer_service().current_processing_time() + 3_600_000
            )
        yield "seen", value

    def on_timer(self, timestamp, ctx):
        yield "reminded", ctx.get_current_key()


@pytest.mark.parametrize("mode", [RuntimeExecutionMode.BATCH, RuntimeExecutionMode.STREAMING])
@pytest.mark.parametrize("parallelism", PARALLELISM)
def test_processing_time_timers_fire_at_the_end_of_input_in_batch_mode(parallelism, mode):
    data = list(range(12))
    out = batch_env(parallelism, mode).from_collection(data).key_by(lambda x: x).process(RemindLater())
    got = sorted(out.execute_and_collect())
    reminded = [("reminded", k) for k in range(5)] if mode is RuntimeExecutionMode.BATCH else []
    assert got == sorted([("seen", v) for v in data] + reminded)
