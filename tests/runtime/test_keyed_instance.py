"""A keyed instance runs a batch's per-record calls without the cyclic collector, which runs
between batches: no collection stalls a batch, and cycles a user function makes last one batch."""

from __future__ import annotations

import gc

import pyarrow as pa

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
