"""The vectorized window operator's index of open windows, in one process: key groups restored
from a snapshot taken without an index are indexed from their rings, and fire exactly."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa

from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream import aggregates as A
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.window import SlidingEventTimeWindows
from stretch.plan.stages import compile_plan
from stretch.runtime.batch import KG_COLUMN, TS_COLUMN
from stretch.runtime.operators.vector_window import VectorWindowOperator
from stretch.state import _table_kernels as TK
from stretch.state import _window_kernels as K
from stretch.state.arena import Arena
from stretch.state.key_groups import key_groups_of
from stretch.state.keyed_table import KeyedTable
from stretch.state.snapshot import copy_key_groups, describe_arena, load_key_groups, prepare_arena
from stretch.state.timers import EVENT

MAXP = 8
RECORD = Types.TUPLE([Types.LONG(), Types.LONG(), Types.LONG()])
SIZE, SLIDE = 30, 10


def operator_spec():
    env = StreamExecutionEnvironment.get_execution_environment()
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(0)).with_timestamp_assigner(
        "f1"
    )
    stream = env.from_collection([(0, 0, 0)], RECORD).assign_timestamps_and_watermarks(strategy)
    windows = SlidingEventTimeWindows.of(Time.milliseconds(SIZE), Time.milliseconds(SLIDE))
    stream.key_by("f0").window(windows).aggregate([A.count(), A.sum("f2")]).sink_to(DiscardingSink())
    plan = compile_plan(env._sinks, 1, MAXP)
    return next(s.operator for s in plan.stages if s.operator is not None)


def open_operator(arena: Arena) -> VectorWindowOperator:
    op = VectorWindowOperator(operator_spec(), "windows", KeyedTable(arena))
    op.owned = np.arange(MAXP)
    return op


def feed(op: VectorWindowOperator, records: list[tuple], delay: int) -> list[tuple]:
    """Process the records as one batch, then the watermark after it; the windows that fired."""
    keys, ts, vals = (pa.array(c, pa.int64()) for c in zip(*records))
    batch = pa.record_batch([keys, ts, vals, ts], names=["f0", "f1", "f2", TS_COLUMN])
    kgs = key_groups_of(keys, MAXP)
    batch = batch.append_column(KG_COLUMN, pa.array(kgs))
    op.process_owned(batch, kgs.copy(), np.zeros(MAXP, np.int16), 0)
    op.watermark = max(ts.to_pylist()) - delay - 1
    return fired(op, op.watermark)


def fired(op: VectorWindowOperator, watermark: int) -> list[tuple]:
    out = op.fire(EVENT, watermark)
    return [] if out is None else [tuple(r.values())[:5] for r in out.data_batch().to_pylist()]


def model(records: list[tuple]) -> list[tuple]:
    windows: dict = {}
    for k, t, v in records:
        for start in range(t - t % SLIDE, t - SIZE, -SLIDE):
            c, s = windows.get((k, start), (0, 0))
            windows[(k, start)] = (c + 1, s + v)
    return sorted((k, s, s + SIZE, c, total) for (k, s), (c, total) in windows.items())


def without_index(arena: Arena, op: VectorWindowOperator) -> list[pa.RecordBatch]:
    """The operator's key groups as a snapshot taken before the index existed would hold them."""
    batches = copy_key_groups(op.table, op.owned)
    words = (
        TK.STATE_BASE
        + op.iid * TK.STATE_WORDS
        + np.array([TK.S_DATA_OFF, TK.S_DATA_CAP, TK.S_HEAP_USED, K.S_INDEXED])
    )

    def strip(word: int, raw: bytes) -> bytes:
        if word != -1:
            return raw
        header = np.frombuffer(raw, np.int64).copy()
        header[words] = 0
        return header.tobytes()

    out = []
    for b in batches:
        data = [strip(w, raw) for w, raw in zip(b.column("word").to_pylist(), b.column("data").to_pylist())]
        stripped = pa.record_batch(
            [b.column(0), b.column(1), b.column(2), pa.array(data, pa.large_binary())], schema=b.schema
        )
        out.append(stripped.filter(pa.array(b.column("word").to_numpy() != words[0])))
    return out


def test_key_groups_restored_without_an_index_are_indexed_from_their_rings(shm_prefix):
    rng = random.Random(4)
    records = [(rng.randrange(40), t + rng.randrange(-25, 1), rng.randrange(100)) for t in range(0, 600, 2)]
    records = [(k, max(t, 0), v) for k, t, v in records]
    first, second = records[:150], records[150:]
    arena = Arena.create(shm_prefix, MAXP)
    try:
        op = open_operator(arena)
        out = []
        for i in range(0, len(first), 30):
            out += feed(op, first[i : i + 30], delay=30)
        assert out  # some windows fired before the snapshot, some are open in it
        batches = without_index(arena, op)
        description = describe_arena(arena)
    finally:
        arena.close()
    restored = Arena.create(shm_prefix, MAXP)
    try:
        registry = [e for e in description["registry"] if e["name"] != "__window_index"]
        prepare_arena(restored, {**description, "registry": registry})
        assert load_key_groups(restored, batches)
        op = open_operator(restored)
        for i in range(0, len(second), 30):
            out += feed(op, second[i : i + 30], delay=30)
        out += fired(op, 2**63 - 1)
    finally:
        restored.close()
    assert sorted(out) == model(records)
