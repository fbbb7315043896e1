"""A frontier epoch meeting each kind of gate record, under a backlog: watermarks (windows and late
data), idle and leave marks (an upstream operator rescaled too), checkpoint barriers, transaction
ends, broadcast elements. Each against a plain-Python model of the same computation."""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from stretch import channels, jobs
from stretch.channels import OutputLog
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import AggregateFunction, KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.output_tag import OutputTag
from stretch.datastream.window import TumblingEventTimeWindows
from stretch.runtime.event_time import producer_id
from stretch.runtime.gate import Kind
from tests.datastream import test_broadcast_stream as bcast
from tests.datastream.flink_windows import by_key, run, tumbling
from tests.datastream.test_windows import RECORD, batches_of
from tests.runtime.test_rescaler import Busy, checkpointed_busy, sequential, spin


def rescaling(
    client, operator: str, stop: threading.Event, choices=(1, 2, 3, 4), seed: int = 1, at_least: int = 0
) -> threading.Thread:
    """Random rescales of ``operator``, a few milliseconds apart, until ``stop`` (and at least
    ``at_least`` of them: on a slow machine the writes may end before the second)."""

    def run_():
        rng = random.Random(seed)
        while not stop.is_set() or len(client._coordinator.rescales) < at_least:
            try:
                client.rescale(operator, rng.choice(choices))
            except Exception:  # the input ended meanwhile: nothing left to rescale
                if not client._coordinator.done and not stop.is_set():
                    raise
                return
            time.sleep(rng.random() * 0.02)

    thread = threading.Thread(target=run_, daemon=True)
    thread.start()
    return thread


def collect(client, name: str) -> tuple[list, threading.Thread]:
    out: list = []
    reader = channels.open_reader(client, name)
    thread = threading.Thread(target=lambda: out.extend(reader), daemon=True)
    thread.start()
    return out, thread


class SlowSum(AggregateFunction):
    """A window's (sum, count), with some work per record: the window operator falls behind."""

    def create_accumulator(self):
        return (0, 0)

    def add(self, value, acc):
        spin(40)
        return acc[0] + value[2], acc[1] + 1

    def get_result(self, acc):
        return acc

    def merge(self, a, b):
        return a[0] + b[0], a[1] + b[1]


def test_watermarks_windows_and_late_data_across_frontier_epochs():
    batches = batches_of(n_batches=50, per_batch=100, keys=23, seed=4, late_share=0.15)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(20)).with_timestamp_assigner(
        "f1"
    )
    late = OutputTag("late", RECORD)
    windows = (
        env.from_source(ChannelSource("in", RECORD), strategy, "in")
        .key_by(lambda r: r[0])
        .window(TumblingEventTimeWindows.of(Time.milliseconds(25)))
        .side_output_late_data(late)
        .aggregate(SlowSum())
        .name("windows")
    )
    windows.sink_to(ChannelSink("out"))
    windows.get_side_output(late).sink_to(ChannelSink("late"))
    client = env.execute_async("frontier windows")
    (out, t1), (dropped, t2) = collect(client, "out"), collect(client, "late")
    writer = channels.open_writer(client, "in")
    stop = threading.Event()
    rescales = rescaling(client, "windows", stop, at_least=5)
    for b in batches:  # back to back: the window operator falls behind
        writer.write(b)
    stop.set()
    rescales.join(60)
    writer.end()
    t1.join(60), t2.join(60)
    assert client.wait(60).name == "FINISHED"
    want, want_late = run(
        batches, lambda r: r[0], lambda r: r[1], assign=tumbling(25), result=lambda rs: rs, delay=20
    )
    assert sorted(out) == sorted((sum(r[2] for r in rs), len(rs)) for *_, rs in want)
    assert sorted(tuple(r) for r in dropped) == sorted(want_late)
    assert len(client._coordinator.rescales) >= 5


class PassOn(KeyedProcessFunction):
    """Forwards each record with its timestamp, slowly: the upstream operator of a re-keying job."""

    def process_element(self, value, ctx):
        spin(25)
        yield value


def users_then_regions(env, strategy, region) -> None:
    """Records pass the slow ``users`` operator keyed by user, then ``regions`` sums them per
    ``region(record)`` in 100 ms event-time windows, into channel ``out``."""
    (
        env.from_source(ChannelSource("in", RECORD), strategy, "in")
        .key_by(lambda r: r[0])
        .process(PassOn(), RECORD)
        .name("users")
        .key_by(region)
        .window(TumblingEventTimeWindows.of(Time.milliseconds(100)))
        .reduce(lambda a, b: (a[0], a[1], a[2] + b[2]), output_type=RECORD)
        .name("regions")
        .sink_to(ChannelSink("out"))
    )


def test_idle_and_leave_marks_across_frontier_epochs_of_two_operators():
    """Per-user records pass a slow operator, then are windowed per region; both are rescaled at
    random while behind, so instances of the first leave and join the second's producers, and the
    source goes idle between bursts: every window fires once, with exactly its records."""
    rng = random.Random(6)
    bursts = []
    t = 0
    for _ in range(8):
        burst = []
        for _ in range(600):
            t += rng.randrange(0, 3)
            burst.append((f"u{rng.randrange(40)}", t, rng.randrange(100)))
        bursts.append(burst)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    strategy = (
        WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(0))
        .with_timestamp_assigner("f1")
        .with_idleness(Duration.of_millis(30))
    )
    users_then_regions(env, strategy, lambda r: int(r[0][1:]) % 5)
    client = env.execute_async("frontier leave marks")
    out, reading = collect(client, "out")
    writer = channels.open_writer(client, "in")
    stop = threading.Event()
    both = [rescaling(client, "users", stop, seed=2), rescaling(client, "regions", stop, seed=3)]
    for burst in bursts:
        writer.write(burst)
        time.sleep(0.08)  # idle between bursts: the source says so
    stop.set()
    for thread in both:
        thread.join(60)
    writer.end()
    reading.join(60)
    assert client.wait(60).name == "FINISHED"
    windows: dict = {}
    for burst in bursts:
        for user, ts, value in burst:
            key = (int(user[1:]) % 5, ts // 100)
            windows[key] = windows.get(key, 0) + value
    assert sorted((int(u[1:]) % 5, ts // 100, v) for u, ts, v in out) == sorted(
        (k, w, v) for (k, w), v in windows.items()
    )
    leaves = [
        r
        for r in client._coordinator.rescales
        if r["operator"] == "users" and r["new_parallelism"] < r["old_parallelism"]
    ]
    assert leaves, "no instance of the first operator left while the second windowed"


def test_a_removed_instance_has_left_downstream_when_its_rescale_returns():
    """A rescale returns once every instance took up the epoch, a removed one having told
    downstream it left by then: a later epoch adding an instance of that index again announces the
    new one after the LEAVE, never before (a LEAVE after the announcement made the downstream
    tracker forget the new instance, and its records came after the watermark)."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(3)
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(0)).with_timestamp_assigner(
        "f1"
    )
    users_then_regions(env, strategy, lambda r: r[0])
    client = env.execute_async("leave before the epoch")
    out, reading = collect(client, "out")
    co = client._coordinator
    users, regions = co.plan.stage("users"), co.plan.stage("regions")
    gate = co.gates[regions.input_gate]
    removed = producer_id(users.id, 2)

    seen, left = 0, 0

    def leaves() -> int:  # the LEAVE marks of the removed instance appended to the gate so far
        nonlocal seen, left
        tail = gate.tail
        assert tail - seen <= gate.slot_capacity, "the gate wrapped between two looks"
        left += sum(
            1 for seq in range(seen, tail) if (e := gate.read(seq)).kind is Kind.LEAVE and e.arg0 == removed
        )
        seen = tail
        return left

    rows = [(f"u{i % 9}", i, i) for i in range(900)]
    try:
        with channels.open_writer(client, "in") as writer:
            for round_ in range(1, 31):
                writer.write(rows[(round_ - 1) * 30 : round_ * 30])
                leaves()
                client.rescale("users", 2)
                assert leaves() == round_, "the rescale returned before the removed instance left"
                client.rescale("users", 3)
    except BaseException:
        client.cancel()
        raise
    reading.join(60)
    assert client.wait(60).name == "FINISHED"
    windows: dict = {}
    for user, ts, value in rows:
        windows[(user, ts // 100)] = windows.get((user, ts // 100), 0) + value
    assert sorted((u, ts // 100, v) for u, ts, v in out) == sorted((u, w, v) for (u, w), v in windows.items())


def test_a_rescale_does_not_wait_for_a_checkpoint_under_way_and_both_are_exact():
    n = 40_000  # more than the gate holds: the source is still writing when the checkpoint starts
    client = checkpointed_busy("frontier checkpoint", n)  # checkpoints every 100 ms, far behind
    co = client._coordinator
    checkpointer = co.checkpointer
    gate = co.gates[co.plan.stage("busy").input_gate]

    def latest_completed() -> int:
        return checkpointer.history[-1]["id"] if checkpointer.history else 0

    deadline = time.monotonic() + 30
    # a checkpoint under way (its barrier waits at the gate's tail) with the operator behind
    while gate.depth() < 32 or checkpointer.last_id <= latest_completed():
        assert time.monotonic() < deadline and not co.done
        time.sleep(0.001)
    under_way = checkpointer.last_id
    report = client.rescale("busy", 3)
    assert latest_completed() < under_way, "the rescale waited for the checkpoint"
    assert report.queued > 0
    while latest_completed() < under_way:  # it completes after the rescale, with the new instances
        assert time.monotonic() < deadline and not co.done, "the checkpoint under way never completed"
        time.sleep(0.002)
    assert client.wait(60).name == "FINISHED"
    got = by_key(channels.open_reader(client, "out", from_offset=0))
    assert got == sequential([(i % 97, i) for i in range(n)])


def _publish(job, staging: str, records: list, txn: tuple) -> list:
    """Stage ``records`` as a Spark task would and publish them as transaction ``txn``."""
    path = os.path.join(staging, f"{uuid.uuid4().hex}.arrows")
    schema = pa.schema([("f0", pa.int64()), ("f1", pa.int64())])
    batch = pa.RecordBatch.from_pylist([{"f0": k, "f1": v} for k, v in records], schema=schema)
    with pa.OSFile(path, "wb") as f, pa.ipc.new_stream(f, schema) as w:
        w.write_batch(batch)
    reply = job.publish_txn("in", "out", *txn, [path])
    with OutputLog(reply["log"]) as log:
        return [
            tuple(r.values()) for o in reply["offsets"] for b in log.read(o, o + 1) for r in b.to_pylist()
        ]


def test_transaction_ends_across_frontier_epochs_each_return_exactly_their_results():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    pair = Types.TUPLE([Types.LONG(), Types.LONG()])
    env.from_source(ChannelSource("in", pair), None, "in").key_by(lambda r: r[0]).process(
        Busy(60.0), Types.TUPLE([Types.LONG(), Types.LONG(), Types.LONG(), Types.STRING()])
    ).name("busy").sink_to(ChannelSink("out"))
    client = env.execute_async("frontier transactions")
    job = jobs.find(client)
    staging = job.join_channel("in", "writer")["staging"]
    inputs = {p: [(i % 13, p * 1000 + i) for i in range(400)] for p in range(12)}
    stop = threading.Event()
    rescales = rescaling(client, "busy", stop, at_least=3)
    try:
        with ThreadPoolExecutor(4) as pool:  # four tasks at a time: the operator falls behind
            results = dict(
                zip(inputs, pool.map(lambda p: _publish(job, staging, inputs[p], ("q", 0, p)), inputs))
            )
    finally:
        stop.set()
        rescales.join(60)
        client.cancel()
    for p, records in inputs.items():  # one result for each record of its own, none of others'
        assert sorted(k for k, *_ in results[p]) == sorted(k for k, _ in records)
    final: dict = {}
    for rows in results.values():
        for k, c, t, _ in rows:
            final[k] = max(final.get(k, (0, 0)), (c, t))
    want = {k: rows[-1][1:3] for k, rows in sequential([r for rs in inputs.values() for r in rs]).items()}
    assert final == want
    assert len(client._coordinator.rescales) >= 3


class SlowFlag(bcast.Flag):
    def process_element(self, value, ctx):
        spin(100)
        yield from super().process_element(value, ctx)


def test_broadcast_elements_across_frontier_epochs():
    batches = bcast._batches(120, 17)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    src = env.from_source(ChannelSource("in", bcast.RECORD), None, "in")
    rules = src.filter(lambda r: r[0] == 1).map(lambda r: (r[1], r[2]))
    events = src.filter(lambda r: r[0] == 0).map(lambda r: (r[1], r[2]))
    events.key_by(lambda e: e[0]).connect(rules.broadcast(bcast.LIMITS)).process(SlowFlag(), bcast.OUT).name(
        "flag"
    ).sink_to(ChannelSink("out"))
    client = env.execute_async("frontier broadcast")
    out, reading = collect(client, "out")
    writer = channels.open_writer(client, "in")
    stop = threading.Event()
    rescales = rescaling(client, "flag", stop, at_least=3)
    for batch in batches:
        writer.write(batch)
    stop.set()
    rescales.join(60)
    writer.end()
    reading.join(60)
    assert client.wait(60).name == "FINISHED"
    assert sorted(tuple(r) for r in out) == bcast._model(batches)
    assert len(client._coordinator.rescales) >= 3
