"""State read from a job's checkpoints (one machine) equals a plain-Python model of the state at
each checkpoint's position, and the table a running job's state read gives: for a job still
running, one that finished, and one whose process was killed with SIGKILL."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest

from stretch import _shm, channels
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import StreamExecutionEnvironment, aggregates
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.window import TumblingEventTimeWindows
from stretch.state import CheckpointNotFound, IncompleteCheckpoint, checkpoint_dir, read_checkpoint
from tests.state.test_queryable import Remember  # two ValueStates, a ListState and a MapState a key

RECORD = Types.TUPLE([Types.STRING(), Types.LONG(), Types.STRING()])


def records(start: int, n: int) -> list[tuple]:
    return [(f"k{i % 37}", i, "abc"[i % 3]) for i in range(start, start + n)]


def model(rows: list[tuple]) -> dict:
    """What Remember holds per key after ``rows``, in plain Python."""
    state: dict = {}
    for key, n, tag in rows:
        s = state.setdefault(key, {"count": 0, "values": [], "by_tag": {}})
        s["count"] += 1
        s["last"] = tag
        s["values"].append(n)
        s["by_tag"][tag] = n
    return state


def as_model(table: pa.Table) -> dict:
    return {
        r["key"]: {"count": r["count"], "last": r["last"], "values": r["values"], "by_tag": dict(r["by_tag"])}
        for r in table.to_pylist()
    }


def remember_job(name: str, restore: bool = False):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing()  # on demand: the test says when
    env.from_source(ChannelSource("in", RECORD), None, "in").key_by(lambda r: r[0]).process(Remember()).name(
        "remember"
    ).sink_to(DiscardingSink())
    return env.execute_async(name, restore=restore)


def wait_processed(client, n: int) -> None:
    """Until the operator's state covers ``n`` records (so a checkpoint now covers them too)."""
    deadline = time.monotonic() + 30
    while sum(r.get("count") or 0 for r in client.query_state("remember").to_pylist()) < n:
        assert time.monotonic() < deadline, "the job never processed its input"
        time.sleep(0.02)


def test_checkpoints_of_a_running_then_finished_job_hold_the_state_at_their_positions():
    name = f"read-ckpt-{random.randrange(1 << 40):x}"
    client = remember_job(name)
    path = checkpoint_dir(name)
    writer = channels.open_writer(client, "in")
    first, second = records(0, 1500), records(1500, 700)
    writer.write(first)
    wait_processed(client, len(first))
    one = client.trigger_checkpoint()["id"]
    live = client.query_state("remember")
    read = read_checkpoint(path, "remember")
    assert read.equals(live)  # the table a running job's state read gives, column for column
    assert as_model(read) == model(first)
    writer.write(second)
    wait_processed(client, len(first) + len(second))
    two = client.trigger_checkpoint()["id"]
    writer.write(records(2200, 100))  # after the last checkpoint: in no checkpoint
    assert as_model(read_checkpoint(path, "remember", checkpoint=one)) == model(first)
    assert as_model(read_checkpoint(path, "remember")) == model(first + second)
    writer.end()
    assert client.wait(60).name == "FINISHED"
    # a finished job keeps its latest checkpoint, readable; a restore is still refused
    assert as_model(read_checkpoint(path, "remember")) == model(first + second)
    assert as_model(read_checkpoint(path.parent, "remember", checkpoint=two)) == model(first + second)
    with pytest.raises(CheckpointNotFound, match=rf"no checkpoint {one} at .* \(completed: {two}\)"):
        read_checkpoint(path, "remember", checkpoint=one)
    with pytest.raises(
        LookupError, match=r"no keyed operator 'nope' in checkpoint .*operators there: remember"
    ):
        read_checkpoint(path, "nope")
    some = read_checkpoint(path, "remember", key_groups=range(0, 40))
    assert set(some.column("key_group").to_pylist()) <= set(range(40)) and some.num_rows > 0


KILLED_JOB = textwrap.dedent(
    """
    import sys, time
    from stretch import channels
    from tests.state.test_checkpoint_reader import records, remember_job, wait_processed

    client = remember_job(sys.argv[1])
    writer = channels.open_writer(client, "in")
    writer.write(records(0, 1200))
    wait_processed(client, 1200)
    client.trigger_checkpoint()
    writer.write(records(1200, 500))  # processed, never checkpointed
    wait_processed(client, 1700)
    print("ready", flush=True)
    time.sleep(60)
    """
)


def test_the_checkpoint_of_a_job_killed_with_sigkill_holds_the_state_at_its_position(tmp_path):
    name = f"killed-ckpt-{random.randrange(1 << 40):x}"
    script = tmp_path / "job.py"
    script.write_text(KILLED_JOB)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, str(script), name], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        _shm.unlink_prefix(f"{_shm.PREFIX}-{os.getuid()}-{proc.pid}")  # what the dead engine left
    path = checkpoint_dir(name)
    assert as_model(read_checkpoint(path, "remember")) == model(records(0, 1200))
    # a checkpoint the process died taking: skipped, saying so
    (path / "0000000002").mkdir()
    (path / "0000000002" / "1-0.arrow").write_bytes(b"half")
    with pytest.warns(
        IncompleteCheckpoint, match=r"checkpoint 2 at .* is incomplete .*: reading checkpoint 1"
    ):
        assert as_model(read_checkpoint(path, "remember")) == model(records(0, 1200))
    with pytest.raises(CheckpointNotFound, match=r"checkpoint 2 at .* is incomplete .*; completed: 1"):
        read_checkpoint(path, "remember", checkpoint=2)


def test_rolling_aggregate_and_window_state_read_as_a_running_jobs():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing()
    clicks = Types.ROW_NAMED(["user", "ts", "amount"], [Types.LONG(), Types.LONG(), Types.DOUBLE()])
    watermarks = WatermarkStrategy.for_bounded_out_of_orderness(
        Duration.of_seconds(2)
    ).with_timestamp_assigner("ts")
    source = env.from_source(ChannelSource("in", clicks), watermarks, "in")
    source.key_by("user").sum("amount").name("totals").sink_to(ChannelSink("totals"))
    source.key_by("user").window(TumblingEventTimeWindows.of(Time.minutes(1))).aggregate(
        [aggregates.count(), aggregates.sum("amount")]
    ).name("windows").sink_to(ChannelSink("windows"))
    name = f"fused-ckpt-{random.randrange(1 << 40):x}"
    client = env.execute_async(name)
    writer = channels.open_writer(client, "in")
    sent = [(i % 17, i * 100, float(i)) for i in range(2000)]
    writer.write(sent)
    deadline = time.monotonic() + 30
    while any(op["records_in"] < len(sent) for op in client.describe()["operators"] if op["name"] != "in"):
        assert time.monotonic() < deadline, "the job never processed its input"
        time.sleep(0.02)
    client.trigger_checkpoint()
    totals = read_checkpoint(checkpoint_dir(name), "totals")
    assert totals.equals(client.query_state("totals"))
    assert {r["key"]: r["sum(amount)"] for r in totals.to_pylist()} == {
        u: sum(a for user, _, a in sent if user == u) for u in range(17)
    }
    assert read_checkpoint(checkpoint_dir(name), "windows").equals(client.query_state("windows"))
    writer.end()
    assert client.wait(60).name == "FINISHED"
