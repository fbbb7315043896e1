"""A channel's source reads the small entries queued in its gate (or, checkpointed, the small
batches of its log) as one batch only where how its input is cut into batches is not seen
downstream (``channel_source.cut_unseen``); a checkpoint's position still counts log batches."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pyarrow as pa
import pytest

from stretch import channels
from stretch.common import Duration, Types, WatermarkStrategy
from stretch.datastream import KeyedBroadcastProcessFunction, KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.output_tag import OutputTag
from stretch.datastream.state import MapStateDescriptor, ValueStateDescriptor
from stretch.plan.stages import compile_plan
from stretch.runtime.channel_source import LogBatches, _joined, cut_unseen, join_most
from stretch.runtime.checkpointing import CheckpointStore
from stretch.runtime.event_time import MARK_KEY
from stretch.runtime.frontier import CLAIM_PIECE_NS
from stretch.runtime.gate import JOINED_ROWS, SMALL_ROWS
from stretch.runtime.state_dir import job_dir
from stretch.runtime.transactions import TXN_KEY
from tests.runtime.test_checkpointing import KEYS, running_sums_reference
from tests.runtime.worker_kills import kill_a_busy_worker

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])
STRATEGY = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(5)).with_timestamp_assigner("f1")


def keyed(env, source):
    source.key_by(lambda r: r[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).sink_to(DiscardingSink())


def mapped_then_keyed(env, source):
    keyed(env, source.map(lambda r: (r[0], 2 * r[1]), output_type=PAIR).filter(lambda r: r[1] > 0))


def timestamped(env, source):
    keyed(env, source.assign_timestamps_and_watermarks(STRATEGY))


def split_to_broadcast(env, source):
    rules = source.filter(lambda r: r[0] == 1).broadcast(
        MapStateDescriptor("rules", Types.LONG(), Types.LONG())
    )
    events = source.filter(lambda r: r[0] == 0)
    events.key_by(lambda r: r[0]).connect(rules).process(_Nothing(), PAIR).sink_to(DiscardingSink())


def with_side_output(env, source):
    from stretch.datastream.functions import ProcessFunction

    odd = OutputTag("odd", PAIR)

    class Split(ProcessFunction):
        def process_element(self, value, ctx):
            if value[1] % 2:
                yield odd, value
            else:
                yield value

    main = source.process(Split(), PAIR)
    keyed(env, main)
    main.get_side_output(odd).sink_to(DiscardingSink())


class _Nothing(KeyedBroadcastProcessFunction):
    def process_element(self, value, ctx):
        return ()

    def process_broadcast_element(self, value, ctx):
        return ()


@pytest.mark.parametrize(
    "program, joined",
    [
        (keyed, True),
        (mapped_then_keyed, True),
        (timestamped, False),  # a watermark after each batch
        (split_to_broadcast, False),  # a batch's rules and events go to two gates
        (with_side_output, False),
    ],
)
def test_queued_entries_are_joined_only_where_batches_are_not_seen(program, joined):
    env = StreamExecutionEnvironment.get_execution_environment()
    program(env, env.from_source(ChannelSource("in", PAIR, durable=False), None, "in"))
    plan = compile_plan(env._sinks, 1, 128)
    stage = next(s for s in plan.stages if getattr(s.source, "channel_name", None) == "in")
    assert cut_unseen(stage.chain) is joined


def test_a_source_with_a_watermark_strategy_reads_each_batch_alone():
    env = StreamExecutionEnvironment.get_execution_environment()
    keyed(env, env.from_source(ChannelSource("in", PAIR, durable=False), STRATEGY, "in"))
    stage = next(s for s in compile_plan(env._sinks, 1, 128).stages if s.source is not None)
    assert not cut_unseen(stage.chain)


def _gate_read(claim, measured=False, ns_per_row=0.0):
    from types import SimpleNamespace

    return SimpleNamespace(readers_claim=claim, read_rate_measured=measured, read_ns_per_row=ns_per_row)


@pytest.mark.parametrize(
    "into, most",
    [
        (False, 0),  # batches seen downstream: one at a time
        (None, JOINED_ROWS),  # into a sink
        (_gate_read(None), 0),  # no instance of the operator has started: not known how it reads
        (_gate_read(False), JOINED_ROWS),  # an operator that claims no pieces
        (_gate_read(True, False, 1000.0), 0),  # a per-record function, its rate a first guess
        (_gate_read(True, True, 500.0), CLAIM_PIECE_NS // 500),  # a claim piece at its measured rate
    ],
)
def test_how_many_rows_a_channels_source_joins_follows_how_the_operator_reads(into, most):
    assert join_most(into) == most


def _log_batches(rng: random.Random, n: int) -> list[pa.RecordBatch]:
    """Batches as a channel's log holds them: mostly a record each, some large, some with a
    transaction or a watermark of their own, two schemas."""
    out, k = [], 0
    for _ in range(n):
        rows = rng.choice([1, 1, 1, 2, 7, SMALL_ROWS - 1, SMALL_ROWS, 600])
        cols = {"a": pa.array(range(k, k + rows), pa.int64())}
        if rng.random() < 0.1:
            cols["b"] = pa.array([1.0] * rows)
        batch = pa.record_batch(cols)
        meta = rng.choice([None] * 8 + [{TXN_KEY: b"3"}, {MARK_KEY: b"10"}])
        out.append(batch.replace_schema_metadata(meta) if meta else batch)
        k += rows
    return out


@pytest.mark.parametrize("most", [0, 1, 50, 4096])
def test_a_logs_small_plain_batches_are_joined_in_order_up_to_the_rows_asked(most):
    """Against the batches one by one: the same rows in the same order, each item counting the log
    batches it holds; only runs of small batches without metadata, of one schema, are joined, and a
    joined one holds at most ``most`` rows plus one small batch."""
    batches = _log_batches(random.Random(most), 400)
    items = list(_joined(iter(batches), lambda: most))
    assert sum(i.count if isinstance(i, LogBatches) else 1 for i in items) == len(batches)
    got = [i.batch if isinstance(i, LogBatches) else i for i in items]
    assert [v for b in got for v in b.column("a").to_pylist()] == [
        v for b in batches for v in b.column("a").to_pylist()
    ]
    k = 0
    for item in items:
        held = batches[k : k + (item.count if isinstance(item, LogBatches) else 1)]
        k += len(held)
        if not isinstance(item, LogBatches):
            assert item is held[0]
            continue
        assert most and item.count > 1 and item.batch.num_rows - held[-1].num_rows < most
        for b in held:
            assert b.num_rows < SMALL_ROWS and not b.schema.metadata and b.schema.equals(held[0].schema)
        assert item.batch.equals(pa.concat_batches(held))
    assert (most > 1) == any(isinstance(i, LogBatches) for i in items)  # 1: a record reaches it


class RunningSum(KeyedProcessFunction):
    """A per-record function: its instances publish their rate, so its source joins what queues."""

    def open(self, runtime_context):
        self.sum = runtime_context.get_state(ValueStateDescriptor("sum", Types.LONG()))

    def process_element(self, value, ctx):
        total = (self.sum.value() or 0) + value[1]
        self.sum.update(total)
        yield value[0], total


@pytest.mark.parametrize("start", [0, 137])
def test_a_checkpointed_source_reads_its_log_joined_from_a_position_counted_in_log_batches(
    tmp_path, shm_prefix, monkeypatch, start
):
    """``read_log`` over a log of records written a call each, with watermarks and a dead run's
    unfinished transaction among them: from any position, the records after it, each once, in
    order, and the items' counts add up to the log batches read (what a checkpoint records)."""
    from types import SimpleNamespace

    from stretch.runtime import channel_source
    from stretch.runtime.channel_log import ChannelLog, LogTail

    batches = _log_batches(random.Random(start), 600)
    batches[300] = batches[300].replace_schema_metadata({TXN_KEY: b"7"})  # aborted: read as no rows
    log = ChannelLog(tmp_path / "log")
    for b in batches:
        log.append(b)
    tail = LogTail.create(shm_prefix, log.end_offset)
    tail.publish(log.end_offset, LogTail.ENDED)
    monkeypatch.setattr(channel_source, "_one_gate", lambda context: None)  # into a sink: joined freely
    res = SimpleNamespace(channel_logs={"in": (str(log.dir), tail.name)}, aborted_txns={7})
    context = SimpleNamespace(res=res, position=start, should_stop=lambda: False)
    try:
        items = list(channel_source.read_log(context, "in"))
    finally:
        tail.segment.close()  # its owner: unlinked too
        log.close()
    assert sum(i.count if isinstance(i, LogBatches) else 1 for i in items) == len(batches) - start
    assert any(isinstance(i, LogBatches) for i in items)
    expected = [b.slice(0, 0) if i == 300 else b for i, b in enumerate(batches)][start:]
    got = [i.batch if isinstance(i, LogBatches) else i for i in items]
    assert [v for b in got for v in b.column("a").to_pylist()] == [
        v for b in expected for v in b.column("a").to_pylist()
    ]


def _held_back(flag: str):
    """A step that holds record 200 back until ``flag`` exists: the log fills behind the source."""

    def step(r):
        if r[1] == 200:
            while not Path(flag).exists():
                time.sleep(0.01)
        return r

    return step


def _records_in(client, operator: str) -> int:
    return next(o["records_in"] for o in client.describe()["operators"] if o["name"] == operator)


def test_a_checkpointed_source_reads_a_record_a_write_joined_and_restarts_where_it_was(tmp_path):
    """A writer writes a record a call into a checkpointed job whose source is held back: the
    source then reads the log's small batches joined as far as the keyed operator's rate allows, a
    checkpoint taken after that records its position in log batches, and the source killed then
    resumes there: every running sum comes once, as a plain loop gives them."""
    name = f"joined-log-{random.randrange(1 << 40):x}"
    n, flag = 2000, str(tmp_path / "go")
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(50)
    stream = env.from_source(ChannelSource("in", PAIR), None, "in").map(_held_back(flag), output_type=PAIR)
    sums = stream.key_by(lambda r: r[0]).process(RunningSum(), PAIR).name("sums")
    sums.sink_to(ChannelSink("out"))
    client = env.execute_async(name)
    co = client._coordinator
    try:
        with channels.open_writer(client, "in") as writer:
            for k in range(n):
                writer.write([(k % KEYS, k)])
            Path(flag).touch()
            while _records_in(client, "sums") < n // 2:
                time.sleep(0.01)
            store = CheckpointStore(job_dir(name) / "checkpoints")
            taken = len(store.completed())
            while len(store.completed()) <= taken:
                time.sleep(0.01)
            kill_a_busy_worker(co, random.Random(1), stage="in")
        assert client.wait(60).name == "FINISHED"
    finally:
        if not co.done:
            client.cancel()
            client.wait(30)
    assert len(co.recoveries) == 1
    got = sorted(tuple(r) for r in channels.open_reader(name, "out", from_offset=0))
    assert got == sorted(running_sums_reference(n))
