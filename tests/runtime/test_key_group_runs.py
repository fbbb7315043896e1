"""Gate batches in runs of key groups: the layout against a plain-Python stable sort, instances
reading only their own runs, and jobs on laid-out batches against plain-Python running results,
with key groups in any order, under random live rescales and across a kill -9 recovery."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pytest

from stretch import channels
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.connectors.datagen import DataGeneratorSource, RateLimiterStrategy
from stretch.datastream.state import ValueStateDescriptor
from stretch.runtime.batch import KG_COLUMN
from stretch.runtime.key_group_runs import (
    BLOCK_NS,
    MAX_BLOCKS,
    MIN_ROWS,
    block_rows,
    laid_out,
    not_laid_out,
    owned_ranges,
    owns_all,
    spans,
)
from stretch.runtime.routing import keyed_by_field, keyed_by_selector
from stretch.state.key_groups import key_group, key_groups_of
from tests.runtime.test_rescale import Job, rescale_randomly
from tests.runtime.worker_kills import finish_after_a_kill

MAXP = 128
PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])


def mixed_batch(n: int, seed: int) -> pa.RecordBatch:
    """Columns of every kind the layout moves: 8-byte values, narrower ones, strings, nulls."""
    rng = np.random.default_rng(seed)
    words = ["a", "bb", "", "dddd", "é"]
    return pa.record_batch(
        {
            "key": rng.integers(0, 5000, n),
            "x": rng.random(n),
            "small": pa.array(rng.integers(-100, 100, n).astype(np.int32)),
            "flag": pa.array(rng.random(n) < 0.5),
            "text": pa.array([words[i % 5] for i in rng.integers(0, 5, n)]),
            "maybe": pa.array([None if v < 0.2 else int(v * 1000) for v in rng.random(n)], pa.int64()),
            "when": pa.array(rng.integers(0, 10**12, n), pa.timestamp("ms")),
        }
    )


@pytest.mark.parametrize("seed", range(4))
def test_a_laid_out_batch_is_a_stable_sort_by_key_group(seed):
    batch = mixed_batch(3000 + seed * 517, seed)
    out = keyed_by_field(batch, "key", MAXP, runs=True)
    kgs = [key_group(k, MAXP) for k in batch.column("key").to_pylist()]
    order = sorted(range(batch.num_rows), key=lambda i: kgs[i])  # Python's sort is stable
    rows = batch.to_pylist()
    assert laid_out(out)
    assert out.drop_columns([KG_COLUMN]).to_pylist() == [rows[i] for i in order]
    assert out.column(KG_COLUMN).to_pylist() == [kgs[i] for i in order]
    again = keyed_by_field(out.drop_columns([KG_COLUMN]), "key", MAXP, runs=True)  # already in order
    assert laid_out(again) and again.equals(out)
    plain = keyed_by_field(batch, "key", MAXP)
    assert not laid_out(plain) and plain.drop_columns([KG_COLUMN]).equals(batch)


@pytest.mark.parametrize("block", [400, 1000, 2999])
def test_a_batch_laid_out_in_blocks_is_a_stable_sort_by_key_group_within_each_block(block):
    batch = mixed_batch(5003, block)
    out = keyed_by_field(batch, "key", MAXP, runs=True, block=block)
    kgs = [key_group(k, MAXP) for k in batch.column("key").to_pylist()]
    rows = batch.to_pylist()
    order = [
        i
        for first in range(0, len(rows), block)
        for i in sorted(range(first, min(first + block, len(rows))), key=lambda i: kgs[i])
    ]
    assert laid_out(out) == block
    assert out.drop_columns([KG_COLUMN]).to_pylist() == [rows[i] for i in order]
    assert out.column(KG_COLUMN).to_pylist() == [kgs[i] for i in order]
    picked = not_laid_out(out.slice(17))  # rows sliced off a laid-out batch are no longer in blocks
    assert not laid_out(picked) and picked.to_pylist() == out.slice(17).to_pylist()
    few = keyed_by_field(batch, "key", MAXP, runs=True, block=1)  # no more than MAX_BLOCKS blocks
    assert laid_out(few) == -(-len(rows) // MAX_BLOCKS)
    whole = keyed_by_field(batch, "key", MAXP, runs=True, block=len(rows))  # one block: the batch
    assert laid_out(whole) == len(rows) and whole.equals(keyed_by_field(batch, "key", MAXP, runs=True))
    assert laid_out(not_laid_out(whole.slice(17))) == len(rows) - 17  # one block stays in order


def test_blocks_take_the_readers_about_block_ns_and_none_is_made_before_their_rate_is_known():
    assert block_rows(0.0, MAXP) == 0
    assert block_rows(1000.0, MAXP) == BLOCK_NS // 1000
    assert block_rows(1e9, MAXP) == MIN_ROWS and block_rows(1e9, 4096) == 4096


def test_small_batches_and_selector_keys():
    items = [(f"user{i % 37}", i) for i in range(MIN_ROWS - 1)]
    batch = pa.record_batch({"f0": [r[0] for r in items], "f1": [r[1] for r in items]})
    keys = [r[0] for r in items]
    small = keyed_by_selector(batch, items, keys, None, MAXP, "op", runs=True)
    assert not laid_out(small) and small.column("f1").to_pylist() == [r[1] for r in items]
    items = items * 3
    batch = pa.record_batch({"f0": [r[0] for r in items], "f1": list(range(len(items)))})
    keys = [r[0] for r in items]
    ts = list(range(1000, 1000 + len(items)))
    out = keyed_by_selector(batch, items, keys, None, MAXP, "op", ts, runs=True)
    kgs = [key_group(k, MAXP) for k in keys]
    order = sorted(range(len(items)), key=lambda i: kgs[i])
    assert laid_out(out)
    assert out.column("f1").to_pylist() == order  # the record index travelled with its row
    assert out.column("__key").to_pylist() == [keys[i] for i in order]
    assert out.column("__ts").to_pylist() == [ts[i] for i in order]


@pytest.mark.parametrize("seed", range(6))
def test_each_instance_reads_exactly_the_rows_it_owns_in_any_ownership(seed):
    rng = np.random.default_rng(seed)
    keys = pa.record_batch({"k": rng.integers(0, 10**6, 4000)})
    batch = keyed_by_field(keys, "k", MAXP, runs=True, block=[0, 300, 1024][seed % 3])
    kgs = batch.column(KG_COLUMN).to_numpy()
    p = int(rng.integers(1, 9))
    owners = (
        rng.integers(0, p, MAXP)  # any table, not only Flink's contiguous ranges
        if seed % 2
        else (np.arange(MAXP) * p // MAXP)
    ).astype(np.int16)
    seen = np.zeros(len(kgs), dtype=np.int64)
    for me in range(p):
        ranges = owned_ranges(owners, me)
        assert owns_all(ranges, MAXP) == (p == 1 or bool((owners == me).all()))
        rows = [i for a, b in spans(kgs, ranges, laid_out(batch)) for i in range(a, b)]
        assert rows == [i for i in range(len(kgs)) if owners[kgs[i]] == me]
        seen[rows] += 1
    assert (seen == 1).all()


def test_parallelism_1_emits_in_input_order_and_parallelism_3_keeps_each_keys_order():
    rng = np.random.default_rng(7)
    n = 60_000
    keys, values = rng.integers(0, 3000, n), rng.integers(-50, 50, n)
    acc, want = defaultdict(int), []
    for k, v in zip(keys.tolist(), values.tolist()):
        acc[k] += v
        want.append((k, acc[k]))
    for p in (1, 3):
        env = StreamExecutionEnvironment.get_execution_environment()
        env.set_parallelism(p)
        table = pa.table({"f0": keys, "f1": values})
        with env.from_arrow(table).key_by(0).sum(1).execute_and_collect() as it:
            got = [tuple(r) for r in it]
        if p == 1:
            assert got == want  # exactly the order of a plain Python loop
        else:
            got_per_key, want_per_key = defaultdict(list), defaultdict(list)
            for k, s in got:
                got_per_key[k].append(s)
            for k, s in want:
                want_per_key[k].append(s)
            assert got_per_key == want_per_key


def test_a_logged_input_channel_at_parallelism_1_keeps_the_input_order():
    """The job's input logger reads the gate too; it is not an instance: the batches stay as written."""
    rng = np.random.default_rng(8)
    n = 40_000
    keys, values = rng.integers(0, 3000, n), rng.integers(-50, 50, n)
    job = Job(
        lambda env: env.from_source(ChannelSource("in", PAIR, durable=True), None, "in").key_by(0).sum(1),
        "runs p1 logged",
        parallelism=1,
    )
    for start in range(0, n, 5000):
        job.writer.write(
            pa.record_batch({"f0": keys[start : start + 5000], "f1": values[start : start + 5000]})
        )
    acc, want = defaultdict(int), []
    for k, v in zip(keys.tolist(), values.tolist()):
        acc[k] += v
        want.append((k, acc[k]))
    assert [tuple(r) for r in job.finish()] == want


class Running(KeyedProcessFunction):
    """The per-record path: a running count and sum per key in ValueState."""

    def open(self, ctx):
        self.count = ctx.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.total = ctx.get_state(ValueStateDescriptor("total", Types.LONG()))

    def process_element(self, value, ctx):
        c, t = (self.count.value() or 0) + 1, (self.total.value() or 0) + value[1]
        self.count.update(c)
        self.total.update(t)
        yield value[0], c, t


def reference(keys, values) -> dict:
    acc, out = defaultdict(lambda: (0, 0)), defaultdict(list)
    for k, v in zip(keys, values):
        c, t = acc[k]
        acc[k] = (c + 1, t + v)
        out[k].append((k, c + 1, t + v))
    return dict(out)


@pytest.mark.parametrize("path", ["vectorized", "per-record", "per-record, large batches"])
def test_laid_out_batches_under_random_live_rescales(path):
    """Batches of keys in any key-group order (random, descending, already in order), written while
    the operator is rescaled at random between 1 and 8 instances: each key's results are exact.
    Large batches are laid out in several blocks (a per-record function reads two of its runs a
    call)."""
    rng = random.Random(21)
    n, size = {"vectorized": (120_000, 3000), "per-record": (30_000, 3000)}.get(path, (150_000, 15_000))
    keys = np.random.default_rng(21).integers(0, 4000, n)
    for start in range(0, n, 4 * size):  # some batches come in key-group order, some reversed
        part = keys[start : start + size]
        kgs = key_groups_of(part, MAXP)
        keys[start : start + size] = part[np.argsort(kgs, kind="stable")[:: 1 if start % (8 * size) else -1]]
    values = np.random.default_rng(22).integers(-100, 100, n)

    def build(env):
        keyed = env.from_source(ChannelSource("in", PAIR), None, "in").key_by(0)
        if path == "vectorized":
            return keyed.sum(1).name("op")
        return keyed.process(Running(), Types.TUPLE([Types.LONG()] * 3)).name("op")

    job = Job(build, f"runs under rescales {path}")

    def write():
        for start in range(0, n, size):
            job.writer.write(
                pa.record_batch({"f0": keys[start : start + size], "f1": values[start : start + size]})
            )
            time.sleep(0.002 if size < 10_000 else 0.05)  # large ones: after the readers' rate is known

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    rescale_randomly(job, "op", rng, 30, writer)
    writer.join()
    got = job.finish()
    want = reference(keys.tolist(), values.tolist())
    have = defaultdict(list)
    for r in got:
        have[r[0]].append(tuple(r))
    if path == "vectorized":
        want = {k: [(k, t) for k, _, t in rows] for k, rows in want.items()}
    assert have == want


def _spread(i: int, n: int) -> pa.RecordBatch:
    idx = np.arange(i, i + n, dtype=np.int64)
    return pa.record_batch([pa.array((idx * 7919) % 997), pa.array(idx)], names=["f0", "f1"])


@pytest.mark.parametrize("trial", range(3))
def test_laid_out_batches_across_a_kill_9_recovery(trial):
    """A checkpointed vectorized sum at parallelism 2 (its gate batches in runs): a random busy
    worker killed with SIGKILL at a random moment; the output equals the plain-Python one."""
    rng = random.Random(trial)
    n = 200_000
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(50)
    src = DataGeneratorSource(
        batch_function=_spread,
        count=n,
        rate_limiter_strategy=RateLimiterStrategy.per_second(400_000),  # half a second of input
        batch_rows=4000,
        type_info=PAIR,
    )
    env.from_source(src, None, "numbers").key_by(0).sum(1).name("sums").sink_to(ChannelSink("out"))
    client = env.execute_async(f"runs-recovery-{trial}-{os.getpid()}")
    finish_after_a_kill(client, rng, after=(0.05, 0.2))
    assert len(client._coordinator.recoveries) == 1
    acc, want = defaultdict(int), []
    for i in range(n):
        k = (i * 7919) % 997
        acc[k] += i
        want.append((k, acc[k]))
    assert sorted(tuple(r) for r in channels.open_reader(client, "out")) == sorted(want)
