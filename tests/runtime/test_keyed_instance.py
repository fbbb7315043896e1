"""A keyed instance runs a batch's per-record calls without the cyclic collector, which runs
between batches: no collection stalls a batch, and cycles a user function makes last one batch.
It reads small entries queued in its gate as one (Gate.read_joined): a writer of one record at a
time gets exactly what a plain-Python model computes, through live rescales too."""

from __future__ import annotations

import gc
import random
import time

import pyarrow as pa
import pytest

from stretch import channels
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource

ROW = Types.TUPLE([Types.LONG(), Types.LONG()])
OUT = Types.TUPLE([Types.LONG(), Types.LONG(), Types.LONG()])
BATCH, BATCHES = 4096, 6
LIVE = [0]  # Cycle objects alive in the worker


class Cycle:
    """Garbage only the cyclic collector frees."""

    def __init__(self):
        self.me = self
        LIVE[0] += 1

    def __del__(self):
        LIVE[0] -= 1


class CyclesPerRecord(KeyedProcessFunction):
    def process_element(self, value, ctx):
        Cycle()
        yield value[0], sum(s["collections"] for s in gc.get_stats()), LIVE[0]


def test_no_collection_runs_inside_a_batch_and_cycles_are_freed_between_batches():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    source = env.from_source(ChannelSource("in", ROW, durable=False), None, "in")
    source.key_by(lambda r: r[0]).process(CyclesPerRecord(), OUT).sink_to(ChannelSink("out"))
    client = env.execute_async("collector between batches")
    writer = channels.open_writer(client, "in")
    for b in range(BATCHES):
        keys = pa.array([(b * BATCH + i) % 64 for i in range(BATCH)], pa.int64())
        writer.write(pa.RecordBatch.from_arrays([keys, keys], names=["f0", "f1"]))
    writer.end()
    got = list(channels.open_reader(client, "out"))
    assert client.wait().name == "FINISHED"
    assert len(got) == BATCH * BATCHES
    collections = [c for _, c, _ in got]
    # with the collector on, a collection about every 700 new objects: dozens of counts
    assert len(set(collections)) <= BATCHES
    assert collections == sorted(collections)
    # it ran between batches all the same: the cycles of one batch did not outlive the next
    assert max(live for _, _, live in got) <= 2 * BATCH


PAIR = ROW


@pytest.mark.parametrize("by", ["selector", "field"])
def test_a_writer_of_one_record_at_a_time_gets_every_record_in_order_per_key(by):
    """By a selector, the channel's source reads the entries; by a field, the writer appends them
    to the keyed operator's gate, whose instances read them, rescaled meanwhile."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    stream = env.from_source(ChannelSource("in", PAIR, durable=False), None, "in")
    keyed = stream.key_by(lambda r: r[0]) if by == "selector" else stream.key_by(0)
    keyed.reduce(lambda a, b: (a[0], a[1] + b[1])).name("sums").sink_to(ChannelSink("out"))
    client = env.execute_async(f"one-at-a-time-{random.randrange(1 << 40):x}")
    rng = random.Random(3)
    records = [(rng.randrange(5), rng.randrange(100)) for _ in range(3000)]
    with channels.open_writer(client, "in") as writer:
        for i, record in enumerate(records):
            writer.write([record])
            if i % 500 == 0:
                time.sleep(0.05)  # the readers catch up, then entries queue again
            if i in (1000, 2000):
                client.rescale("sums", 3 if i == 1000 else 1)
    assert client.wait(60).name == "FINISHED"
    totals, want = {}, {}
    for key, value in records:  # running sums per key, in the order written
        totals[key] = totals.get(key, 0) + value
        want.setdefault(key, []).append((key, totals[key]))
    got = {}
    for key, total in channels.open_reader(client, "out"):
        got.setdefault(key, []).append((key, total))
    assert got == want
