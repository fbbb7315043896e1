"""Rescales and live updates at the readers' frontier: under a backlog they apply ahead of what is
queued, after the input ended they work off what is left, and the output stays exactly that of a
plain-Python sequential model, per key and in order; an ended job says how it ended."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
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
from stretch.datastream.connectors.datagen import DataGeneratorSource
from stretch.datastream.connectors.number_seq import NumberSequenceSource
from stretch.datastream.state import ValueStateDescriptor
from stretch.errors import InputEnded, JobEnded
from stretch.runtime.checkpointing import CheckpointStore
from stretch.runtime.state_dir import job_dir
from stretch.state.key_groups import key_group

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])
KEYS = 97


def spin(us: float) -> None:
    until = time.perf_counter() + us / 1e6
    while time.perf_counter() < until:
        pass


class Busy(KeyedProcessFunction):
    """A count and a sum per key, and some work per record: slow enough to fall behind a writer."""

    def __init__(self, cost_us: float = 30.0, tag: str = "v0"):
        self.cost_us, self.tag = cost_us, tag

    def open(self, ctx):
        self.count = ctx.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.total = ctx.get_state(ValueStateDescriptor("total", Types.LONG()))

    def process_element(self, value, ctx):
        spin(self.cost_us)
        c, t = (self.count.value() or 0) + 1, (self.total.value() or 0) + value[1]
        self.count.update(c)
        self.total.update(t)
        yield value[0], c, t, self.tag


def sequential(records, tags=None) -> dict:
    """The plain-Python model: per key, in input order, (key, count, running sum, code tag)."""
    count, total, out = defaultdict(int), defaultdict(int), defaultdict(list)
    for i, (k, v) in enumerate(records):
        count[k] += 1
        total[k] += v
        out[k].append((k, count[k], total[k], tags[i] if tags else "v0"))
    return dict(out)


def by_key(rows) -> dict:
    out = defaultdict(list)
    for r in rows:
        out[r[0]].append(tuple(r))
    return dict(out)


def _reader(client, name: str = "out"):
    out: list = []
    reader = channels.open_reader(client, name)
    thread = threading.Thread(target=lambda: out.extend(reader), daemon=True)
    thread.start()
    return out, thread


def _channel_job(name: str, parallelism: int = 1, cost_us: float = 30.0, key=lambda r: r[0]):
    """Busy over channel "in"; keyed by a field (``key=0``), writers append to its gate directly."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    (
        env.from_source(ChannelSource("in", PAIR), None, "in")
        .key_by(key)
        .process(Busy(cost_us))
        .name("busy")
        .sink_to(ChannelSink("out"))
    )
    return env.execute_async(name)


def test_random_rescales_under_a_growing_backlog_apply_at_the_frontier_and_stay_exact():
    rng = random.Random(5)
    records = [(rng.randrange(KEYS), rng.randrange(1000)) for _ in range(60_000)]
    client = _channel_job("frontier rescales")
    out, reading = _reader(client)
    writer = channels.open_writer(client, "in")
    written = threading.Event()

    def write():  # as fast as the gate takes it: the backlog grows while the operator works
        for i in range(0, len(records), 500):
            writer.write(records[i : i + 500])
        written.set()

    threading.Thread(target=write, daemon=True).start()
    co = client._coordinator
    gate = co.gates[co.plan.stage("busy").input_gate]
    reports, depths = [], []
    while not written.is_set() or gate.depth() > 4:
        depths.append(gate.depth())
        reports.append(client.rescale("busy", rng.randint(1, 8)))
        time.sleep(rng.random() * 0.03)
    writer.end()
    reading.join(60)
    assert client.wait(60).name == "FINISHED"
    assert by_key(out) == sequential(records)
    moved = [r for r in reports if r.new_parallelism != r.old_parallelism]
    assert len(moved) >= 10 and max(depths) >= 32, "too few rescales under too small a backlog"
    # each took effect ahead of what was queued, not after it: thousands of records behind most
    assert sum(r.queued >= 1000 for r in moved) >= len(moved) // 2, [r.queued for r in moved]
    assert all(r.state_bytes_copied == 0 for r in reports)


class WhoProcessed(Busy):
    """Busy, saying which instance processed each record."""

    def open(self, ctx):
        super().open(ctx)
        self.index = ctx.get_index_of_this_subtask()

    def process_element(self, value, ctx):
        for k, c, t, _ in super().process_element(value, ctx):
            yield k, c, t, str(self.index)


def test_a_rescale_applies_inside_one_large_batch_of_a_per_record_function():
    # A per-record function gets a whole run of a batch in one call; the call claims it piece by
    # piece, so an instance added while the only batch is being worked off takes its share of it.
    rng = random.Random(11)
    records = [(rng.randrange(KEYS), rng.randrange(1000)) for _ in range(12_000)]
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    env.from_source(ChannelSource("in", PAIR), None, "in").key_by(lambda r: r[0]).process(
        WhoProcessed(100.0)
    ).name("busy").sink_to(ChannelSink("out"))
    client = env.execute_async("rescale inside a batch")
    out, reading = _reader(client)
    writer = channels.open_writer(client, "in")
    writer.write(records)  # one gate entry: 1.2 s of work at parallelism 1
    deadline = time.monotonic() + 30
    while len(out) < 500:  # results come out while the batch is worked off, not at its end
        assert time.monotonic() < deadline, "no results while the one batch was worked off"
        time.sleep(0.005)
    report = client.rescale("busy", 2)
    writer.end()
    reading.join(60)
    assert client.wait(60).name == "FINISHED"
    assert report.new_parallelism == 2
    model = sequential(records)
    assert by_key([r[:3] for r in out]) == {k: [v[:3] for v in vs] for k, vs in model.items()}
    by_instance = {i: sum(r[3] == i for r in out) for i in ("0", "1")}
    assert by_instance["1"] > 1000, by_instance  # the new instance worked on the one batch


def test_rescales_and_an_update_after_the_input_ended_work_off_what_is_queued():
    """A bounded source pushed all its input (its end is in the gate, behind a backlog): the
    operator still rescales and updates, the new parallelism and code taking what is queued."""
    n = 30_000
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    numbers = env.from_source(NumberSequenceSource(0, n - 1, batch_rows=250), None, "numbers")
    numbers.map(lambda i: (i % KEYS, i), output_type=PAIR).key_by(lambda r: r[0]).process(Busy(60.0)).name(
        "busy"
    ).sink_to(ChannelSink("out"))
    client = env.execute_async("frontier after the end")
    out, reading = _reader(client)
    co = client._coordinator
    gate = co.gates[co.plan.stage("busy").input_gate]
    deadline = time.monotonic() + 60
    while gate.end_position is None:  # the source has pushed everything, the end included
        assert time.monotonic() < deadline
        time.sleep(0.005)
    up = client.rescale("busy", 2)
    updated = client.update("busy", Busy(60.0, tag="v1"))
    down = client.rescale("busy", 1)
    reading.join(60)
    assert client.wait(60).name == "FINISHED"
    assert up.queued > 0 and updated.queued > 0 and down.queued > 0  # each applied before the end
    got = by_key(out)
    # one position for every key: each record before it ran the old code, each from it the new
    tag_of = {k + m * KEYS: row[3] for k, rows in got.items() for m, row in enumerate(rows)}
    cut = min((i for i, tag in tag_of.items() if tag == "v1"), default=n)
    assert 0 < cut < n, "the update did not apply between the first and the last record"
    records = [(i % KEYS, i) for i in range(n)]
    assert got == sequential(records, ["v0" if i < cut else "v1" for i in range(n)])


class Slow(KeyedProcessFunction):
    def process_element(self, value, ctx):
        time.sleep(0.002)
        yield value


def test_an_operator_that_read_all_its_input_refuses_and_an_ended_job_says_how_it_ended():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    first = env.from_collection([(k, k) for k in range(400)], type_info=PAIR).key_by(lambda r: r[0]).sum(1)
    first.name("first").key_by(lambda r: r[0] % 3).process(Slow(), output_type=PAIR).name("second").sink_to(
        ChannelSink("out")
    )
    client = env.execute_async("frontier refusals")
    co = client._coordinator
    first_op = co.resources.keyed_index[co.plan.stage("first").id]
    deadline = time.monotonic() + 30
    while not co.stage_finished(co.plan.stage("first").id):  # "second" still has ~0.4 s of work
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with pytest.raises(InputEnded, match="operator 'first' has read all its input: nothing is left"):
        client.rescale("first", 3)
    with pytest.raises(InputEnded, match="operator 'first' has read all its input: nothing is left"):
        client.update("first", "max")
    assert int(co.control.epoch(first_op)) == 0  # nothing was published
    assert client.wait(60).name == "FINISHED"
    with pytest.raises(JobEnded, match="job 'frontier refusals' has finished: it cannot be rescaled"):
        client.rescale("second", 1)
    with pytest.raises(JobEnded, match="job 'frontier refusals' has finished: it cannot be updated"):
        client.update("second", Slow())
    assert sorted(tuple(r) for r in channels.open_reader(client, "out")) == [(k, k) for k in range(400)]


def test_a_cancelled_job_says_so_to_a_rescale():
    client = _channel_job("frontier cancelled", parallelism=2)
    client.cancel()
    with pytest.raises(JobEnded, match="job 'frontier cancelled' was cancelled: it cannot be rescaled"):
        client.rescale("busy", 3)


class Failing(KeyedProcessFunction):
    def process_element(self, value, ctx):
        raise ZeroDivisionError("user code says no")


def test_a_failed_job_says_how_in_one_line_to_a_rescale():
    """The user function's error, not the worker's traceback that comes with it."""
    env = StreamExecutionEnvironment.get_execution_environment()
    source = env.from_source(ChannelSource("in", PAIR), None, "in")
    source.key_by(0).process(Failing()).name("fails").sink_to(ChannelSink("out"))
    client = env.execute_async("frontier failed")
    writer = channels.open_writer(client, "in")
    writer.write([(1, 2)])
    with pytest.raises(Exception, match="user code says no"):
        client.wait(60)
    with pytest.raises(JobEnded) as ended:
        client.rescale("fails", 2)
    message = str(ended.value)
    assert "\n" not in message and message.startswith("job 'frontier failed' failed: ")
    assert "ZeroDivisionError: user code says no" in message and message.endswith(": it cannot be rescaled")


def _pairs(i: int, n: int) -> pa.RecordBatch:
    idx = np.arange(i, i + n, dtype=np.int64)
    return pa.record_batch([pa.array(idx % KEYS), pa.array(idx)], names=["f0", "f1"])


def checkpointed_busy(name: str, n: int, parallelism: int = 1, restore: bool = False):
    """A checkpointed job whose operator falls behind its source: checkpoints every 100 ms."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.enable_checkpointing(100)
    source = DataGeneratorSource(batch_function=_pairs, count=n, batch_rows=250, type_info=PAIR)
    env.from_source(source, None, "numbers").key_by(lambda r: r[0]).process(Busy(40.0)).name("busy").sink_to(
        ChannelSink("out")
    )
    return env.execute_async(name, restore=restore)


def await_backlog(co, checkpoints: int = 1) -> None:
    """Until the operator is well behind its source and the job has completed checkpoints."""
    gate = co.gates[co.plan.stage("busy").input_gate]
    deadline = time.monotonic() + 60
    while gate.depth() < 16 or co.checkpointer.completed < checkpoints:
        assert time.monotonic() < deadline and not co.done, "no backlog built up"
        time.sleep(0.002)


def rescale_and_kill(client, parallelism: int, instance: int) -> tuple[threading.Thread, list]:
    """Rescale in a thread, and SIGKILL the worker of ``instance`` as soon as the new epoch is
    published (and that instance runs): before the instances have all reached its position.
    Returns the rescaling thread and the list its report goes to."""
    co = client._coordinator
    sid = co.plan.stage("busy").id
    op = co.resources.keyed_index[sid]
    epoch = int(co.control.epoch(op))
    reports: list = []

    def rescale_():
        try:
            reports.append(client.rescale("busy", parallelism))
        except Exception as e:  # the test shows it, rather than an empty list
            reports.append(e)

    rescale = threading.Thread(target=rescale_, daemon=True)
    rescale.start()
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline and not co.done, "the epoch was not placed"
        if int(co.control.epoch(op)) > epoch:
            victim = next((w for w in co.workers.all() if w.task == (sid, instance) and w.pid), None)
            if victim is not None:
                os.kill(victim.pid, signal.SIGKILL)
                return rescale, reports
        time.sleep(0.0002)


@pytest.mark.parametrize("victim", [0, 1], ids=["losing instance", "gaining instance"])
def test_a_kill_9_at_a_frontier_epoch_under_a_backlog_leaves_the_output_exact(victim):
    n = 24_000
    client = checkpointed_busy(f"frontier kill {victim}", n)
    co = client._coordinator
    try:
        await_backlog(co)
        rescale, reports = rescale_and_kill(client, 2, victim)
        rescale.join(60)
        assert (
            reports and getattr(reports[0], "new_parallelism", reports) == 2
        )  # in effect: the job recovered at 2
        assert client.wait(90).name == "FINISHED"
        assert len(co.recoveries) == 1
    finally:
        if not co.done:
            client.cancel()
    got = by_key(channels.open_reader(client, "out", from_offset=0))
    assert got == sequential([(i % KEYS, i) for i in range(n)])


KILLED_DURING_AN_EPOCH = textwrap.dedent(
    """
    import os, signal, sys
    from tests.runtime.test_rescaler import await_backlog, checkpointed_busy, rescale_and_kill

    client = checkpointed_busy(sys.argv[1], int(sys.argv[2]))
    await_backlog(client._coordinator)
    rescale_and_kill(client, 3, 0)
    os.kill(os.getpid(), signal.SIGKILL)  # the coordinator dies too, in the middle of the epoch
    """
)


def test_a_job_killed_in_the_middle_of_a_frontier_epoch_restores_exactly(tmp_path):
    n = 24_000
    name = f"frontier crash {random.randrange(1 << 40):x}"
    script = tmp_path / "job.py"
    script.write_text(KILLED_DURING_AN_EPOCH)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, str(script), name, str(n)], check=False, env=env, timeout=120, capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    latest = CheckpointStore(job_dir(name) / "checkpoints").completed()[-1]
    client = checkpointed_busy(name, n, parallelism=2, restore=True)
    assert client.wait(90).name == "FINISHED"
    assert client._coordinator.restored_from == latest
    got = by_key(channels.open_reader(client, "out", from_offset=0))  # both runs: each result once
    assert got == sequential([(i % KEYS, i) for i in range(n)])


def test_released_key_groups_stop_at_the_frontier_and_their_queued_records_come_back_in_order():
    """What a cluster node hands over: the state of the released key groups is final at the
    frontier, the records of theirs queued behind it come back; appended again (as the new owner
    would), every key's results are those of the sequential model."""
    rng = random.Random(8)
    records = [(rng.randrange(KEYS), rng.randrange(1000)) for _ in range(16_000)]
    client = _channel_job("frontier release", parallelism=2, key=0)  # rows straight into its gate
    co = client._coordinator
    out, reading = _reader(client)
    writer = channels.open_writer(client, "in")
    for i in range(0, len(records), 500):  # the whole input, far ahead of the operator
        writer.write(records[i : i + 500])
    moving = sorted({*range(0, 128, 3), *range(64, 128)})  # all of instance 1's: it stays, idle
    released = co.release("busy", moving)
    assert released.batches, "nothing of the released key groups was queued behind the frontier"
    back = [tuple(r.values()) for b in released.batches for r in b.select(["f0", "f1"]).to_pylist()]
    assert all(key_group(k, 128) in moving for k, _ in back)
    # per key, the records after the frontier in input order (batches are laid out by key group)
    for k, rows in by_key(back).items():
        theirs = [r for r in records if r[0] == k]
        assert rows == theirs[len(theirs) - len(rows) :]
    assert client.rescale("busy", 3).queued > 0  # away at any parallelism: their queue is not run
    co.own("busy", moving)  # as their new owner does: from after what was queued of theirs
    writer.write(back)  # then it takes what came along, before anything newer of theirs
    writer.end()
    reading.join(60)
    assert client.wait(60).name == "FINISHED"
    assert by_key(out) == sequential(records)


def test_key_groups_left_after_a_release_are_spread_over_every_instance():
    """A node that gives away every key group of an instance's range: the instance must not
    retire (the operator still counts it, and later epochs wait for it) nor idle; the key groups
    left are spread over all instances; rescales with those key groups away, and owning them
    back, stay exact."""
    rng = random.Random(9)
    records = [(rng.randrange(KEYS), rng.randrange(1000)) for _ in range(8_000)]
    client = _channel_job("frontier release of a range", parallelism=2, key=0)
    co = client._coordinator
    out, reading = _reader(client)
    writer = channels.open_writer(client, "in")
    for i in range(0, len(records), 500):
        writer.write(records[i : i + 500])
    moving = list(range(64))  # instance 0's whole range at parallelism 2
    released = co.release("busy", moving)
    back = [tuple(r.values()) for b in released.batches for r in b.select(["f0", "f1"]).to_pylist()]
    op = co.resources.keyed_index[co.plan.stage("busy").id]
    table = co.control.table(op, co.control.epoch(op))
    assert set(table[moving].tolist()) == {-1}
    assert np.bincount(table[64:], minlength=2).tolist() == [32, 32]  # 64 left, half each
    for p in (3, 2):  # at 3, instance 0's range lies within the released ones again
        assert client.rescale("busy", p, timeout=30).new_parallelism == p
    co.own("busy", moving)
    writer.write(back)
    writer.end()
    reading.join(60)
    assert client.wait(60).name == "FINISHED"
    assert by_key(out) == sequential(records)


class StallsOnKey(Busy):
    """Busy; on key 0 it stalls while the file ``flag`` exists (one instance stops reading)."""

    def __init__(self, flag: str):
        super().__init__(cost_us=5.0)
        self.flag = flag

    def process_element(self, value, ctx):
        while value[0] == 0 and os.path.exists(self.flag):
            open(self.flag + ".seen", "w").close()
            time.sleep(0.01)
        yield from super().process_element(value, ctx)


def test_an_epoch_waits_for_an_instance_still_on_the_oldest_kept_epoch(tmp_path):
    """Epochs placed one after another (as a node's key-group moves are) while one instance is
    stuck: once the ring of kept epochs is full, the next waits for it instead of failing."""
    from stretch.runtime import control_block as cbk

    flag = tmp_path / "stall"
    flag.touch()
    rng = random.Random(10)
    records = [(rng.randrange(KEYS), rng.randrange(1000)) for _ in range(6_000)]
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.from_source(ChannelSource("in", PAIR), None, "in").key_by(0).process(StallsOnKey(str(flag))).name(
        "busy"
    ).sink_to(ChannelSink("out"))
    client = env.execute_async("epochs behind")
    co = client._coordinator
    stage = co.plan.stage("busy")
    out, reading = _reader(client)
    writer = channels.open_writer(client, "in")
    writer.write(records)
    deadline = time.monotonic() + 30
    while not (tmp_path / "stall.seen").exists():
        assert time.monotonic() < deadline, "key 0 never reached its instance"
        time.sleep(0.01)
    placed: list = []

    def place() -> None:
        for _ in range(cbk.TABLE_RING + 2):
            with co.rescaler.reconfiguring(stage):
                placed.append(co.rescaler.new_epoch(stage).epoch)

    placing = threading.Thread(target=place)
    placing.start()
    placing.join(1.0)
    assert placing.is_alive() and len(placed) == cbk.TABLE_RING - 1, placed  # waits for the stuck one
    flag.unlink()
    placing.join(30)
    assert not placing.is_alive() and len(placed) == cbk.TABLE_RING + 2
    writer.end()
    reading.join(60)
    assert client.wait(60).name == "FINISHED"
    assert by_key(out) == sequential(records)
