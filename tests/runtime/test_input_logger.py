"""An input channel's log keeps every batch a write accepted, even when the job's process dies
before its logger copied them: the next job to start copies them from the dead run's gate."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest

from stretch import _shm as shm
from stretch import channels
from stretch.datastream import StreamExecutionEnvironment
from stretch.runtime.channel_log import ChannelLog
from stretch.runtime.gate import Gate, Kind
from stretch.runtime.input_logger import InputLogger, LogProgress, records_dir, salvage
from stretch.runtime.state_dir import job_dir
from tests.runtime.test_checkpointing import KEYS, channel_sums, running_sums_reference


def batch(i: int) -> pa.RecordBatch:
    return pa.record_batch({"n": pa.array(range(i * 10, i * 10 + 10), pa.int64())})


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def dead_run(tmp_path, monkeypatch):
    """A gate, its log and a logger's progress, as a run killed mid-way leaves them (recorded in a
    runtime directory of the test's own: a job starting meanwhile would salvage it first)."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("STRETCH_RUNTIME_DIR", str(runtime))
    prefix = shm.engine_prefix()
    gate = Gate.create(prefix, "channel", 64, 1 << 20)
    log = ChannelLog(tmp_path / "log")
    progress = LogProgress.create(prefix, log.end_offset, 0)
    logger = InputLogger("in", gate, 1, log, progress, producer=3)  # not started: the test logs instead
    record = json.loads(logger.record.read_text())
    logger.record.write_text(json.dumps({**record, "pid": dead_pid()}))
    yield gate, log, progress, logger.record
    logger.record.unlink(missing_ok=True)
    log.close()
    shm.unlink_prefix(prefix)


def log_as_the_logger_did(gate, log, progress, upto: int, commit: bool = True) -> None:
    """What the logger of the dead run did before it died: entries below ``upto``."""
    end, start = progress.committed()
    for seq in range(start, upto):
        entry = gate.read(seq)
        if entry.kind is Kind.DATA and entry.arg0 == 3:
            end = log.append_ipc(gate.payload(seq)) + 1
        if commit or seq + 1 < upto:
            progress.commit(end, seq + 1)


@pytest.mark.parametrize("killed_before_commit", [False, True])
def test_a_dead_runs_unlogged_batches_are_copied_once_in_gate_order(dead_run, killed_before_commit):
    gate, log, progress, record = dead_run
    model = []
    for i in range(8):
        gate.append_batch(batch(i), producer=3)
        model.append(batch(i))
        if i == 2:
            gate.append_control(Kind.WATERMARK, 3, 100)  # not data: not logged
        if i == 4:
            gate.append_batch(batch(100 + i), producer=1)  # another stage's: not this log's
    log_as_the_logger_did(gate, log, progress, upto=5, commit=not killed_before_commit)
    assert log.end_offset == 4  # batches 0 to 3 (entries 0 to 4, the watermark among them)
    assert salvage(record) == 4
    assert list(ChannelLog(log.dir).read(0)) == model
    assert not record.exists()
    assert salvage(record) == 0  # once


def test_a_live_runs_gate_is_left_alone(dead_run):
    gate, log, _, record = dead_run
    record.write_text(json.dumps({**json.loads(record.read_text()), "pid": os.getpid()}))
    gate.append_batch(batch(0), producer=3)
    assert salvage(record) == 0
    assert log.end_offset == 0 and record.exists()


def test_a_record_whose_segments_are_gone_is_removed(dead_run):
    gate, log, progress, record = dead_run
    gate.append_batch(batch(0), producer=3)
    shm.unlink(gate.name)
    shm.unlink(progress.segment.name)
    assert salvage(record) == 0
    assert log.end_offset == 0 and not record.exists()


def test_the_end_of_stream_in_a_dead_gate_ends_the_log(dead_run):
    gate, log, _, record = dead_run
    gate.append_batch(batch(0), producer=3)
    gate.append_control(Kind.END_OF_STREAM)
    gate.append_batch(batch(1), producer=3)  # never: the stream ended
    assert salvage(record) == 1
    assert log.ended and [b for b in ChannelLog(log.dir).read(0)] == [batch(0)]


def test_a_logger_copies_what_is_queued_in_gate_order_up_to_the_end_of_stream(tmp_path, monkeypatch):
    """Entries queued before the logger looks (a writer of a record a call, two producers, an end
    of stream, an entry after it): its producer's batches in gate order, the log ended, its
    progress at the entry after the end."""
    monkeypatch.setenv("STRETCH_RUNTIME_DIR", str(tmp_path))
    prefix = shm.engine_prefix()
    gate = Gate.create(prefix, "channel", 1024, 1 << 20)
    log = ChannelLog(tmp_path / "log", segment_bytes=2048)
    progress = LogProgress.create(prefix, 0, 0)
    rng, model = random.Random(5), []
    for i in range(300):
        producer = rng.choice([3, 3, 4])
        gate.append_batch(batch(i), producer=producer)
        if producer == 3:
            model.append(batch(i))
    gate.append_control(Kind.END_OF_STREAM)
    gate.append_batch(batch(999), producer=3)  # never: the stream ended
    logger = InputLogger("in", gate, 1, log, progress, producer=3)
    try:
        logger.start()
        logger.join(10)
        assert not logger.is_alive()
        reread = ChannelLog(tmp_path / "log", create=False)
        assert reread.ended and list(reread.read(0)) == model
        assert progress.committed() == (len(model), 301)
    finally:
        log.close()
        shm.unlink_prefix(prefix)


KILLED_JOB = textwrap.dedent(
    """
    import sys, time
    from stretch import channels
    from stretch.datastream import StreamExecutionEnvironment
    from stretch.runtime.channel_log import ChannelLog
    from tests.runtime.test_checkpointing import channel_sums

    name, n = sys.argv[1], int(sys.argv[2])
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing()  # on demand: none is taken before the process dies
    client = channel_sums(env, name)
    writer = channels.open_writer(client, "in")
    writer.write([(k % KEYS, k) for k in range(n // 2)])
    while client.describe()["operators"][0]["records_in"] < n // 2:  # logged, read and processed
        time.sleep(0.01)
    append = ChannelLog.append_ipcs
    def stalled(log, streams):  # the logger falls behind: a slow disk, a busy machine
        if "/channels/in/" in str(log.dir):
            time.sleep(3600)
        return append(log, streams)
    ChannelLog.append_ipcs = stalled
    for k in range(n // 2, n, 500):
        writer.write([(j % KEYS, j) for j in range(k, min(k + 500, n))])  # accepted: in the gate
    print("written", flush=True)
    time.sleep(60)
    """
)


def test_writes_accepted_just_before_the_jobs_process_died_are_restored(tmp_path):
    name = f"unlogged-{random.randrange(1 << 40):x}"
    n = 6000
    script = tmp_path / "job.py"
    script.write_text(KILLED_JOB.replace("KEYS", str(KEYS)))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, str(script), name, str(n)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "written"
    finally:
        proc.kill()
        proc.wait(30)
    time.sleep(0.2)  # its workers follow it
    log = ChannelLog(job_dir(name) / "channels" / "in" / "in", create=False)
    assert log.end_offset == 1  # the first write only: the rest were in the gate
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(3)
    env.enable_checkpointing(50)
    client = channel_sums(env, name, restore=True)
    channels.open_writer(client, "in").end()
    assert client.wait(60).name == "FINISHED"
    got = sorted(tuple(r) for r in channels.open_reader(name, "out", from_offset=0))
    assert got == sorted(running_sums_reference(n))
    assert not any(  # the restored run's logger ended, the dead one's was salvaged
        json.loads(r.read_text())["log"] == str(log.dir) for r in records_dir().glob("*.json")
    )
