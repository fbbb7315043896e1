"""Checkpoints and recovery: kill -9 of any worker at any moment leaves the output exactly equal to
a plain-Python reference; readers see only what a complete checkpoint covers; a job whose process
died restarts from its latest checkpoint at another parallelism."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from stretch import channels
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.connectors.datagen import DataGeneratorSource, RateLimiterStrategy
from stretch.datastream.window import TumblingEventTimeWindows
from stretch.errors import JobExecutionError
from stretch.runtime.checkpointing import CheckpointStore
from stretch.runtime.state_dir import job_dir
from tests.runtime.worker_kills import finish_after_a_kill, kill_a_busy_worker, wait_for_recoveries

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])
TRIPLE = Types.TUPLE([Types.LONG(), Types.LONG(), Types.LONG()])
KEYS = 61


def _pairs(i: int, n: int) -> pa.RecordBatch:
    idx = np.arange(i, i + n, dtype=np.int64)
    return pa.record_batch([pa.array(idx % KEYS), pa.array(idx)], names=["f0", "f1"])


def running_sums(env, n: int, rate: int):
    """Running sum per key (a reduce): every record yields one output, so nothing may be lost or doubled."""
    src = DataGeneratorSource(
        batch_function=_pairs,
        count=n,
        rate_limiter_strategy=RateLimiterStrategy.per_second(rate),
        batch_rows=1000,
        type_info=PAIR,
    )
    reduced = (
        env.from_source(src, None, "numbers").key_by(lambda r: r[0]).reduce(lambda a, b: (a[0], a[1] + b[1]))
    )
    return reduced.map(lambda r: r, output_type=PAIR).name("sums")


def running_sums_reference(n: int) -> list:
    acc, out = {}, []
    for i in range(n):
        acc[i % KEYS] = acc.get(i % KEYS, 0) + i
        out.append((i % KEYS, acc[i % KEYS]))
    return out


def windowed_sums(env, n: int, rate: int):
    """Event-time tumbling windows (state and timers in the arena), event time = record index ms."""
    src = DataGeneratorSource(
        generator_function=lambda i: (i % KEYS, i, i * 3),
        count=n,
        rate_limiter_strategy=RateLimiterStrategy.per_second(rate),
        batch_rows=1000,
        type_info=TRIPLE,
    )
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(0)).with_timestamp_assigner(
        "f1"
    )
    return (
        env.from_source(src, strategy, "events")
        .key_by(lambda r: r[0])
        .window(TumblingEventTimeWindows.of(Time.milliseconds(500)))
        .reduce(lambda a, b: (a[0], a[1], a[2] + b[2]), output_type=TRIPLE)
        .name("windows")
    )


def windowed_sums_reference(n: int) -> list:
    windows: dict = {}
    for i in range(n):
        key = (i % KEYS, i // 500)
        first, total = windows.get(key, (i, 0))
        windows[key] = (first, total + i * 3)
    return [(k, first, total) for (k, _), (first, total) in windows.items()]


PIPELINES = {
    "running_sums": (running_sums, running_sums_reference),
    "windows": (windowed_sums, windowed_sums_reference),
}


def _start(build, n: int, rate: int, parallelism: int = 2, interval_ms: int | None = 50, name=None):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.enable_checkpointing(interval_ms)
    build(env, n, rate).sink_to(ChannelSink("out"))
    return env.execute_async(name or f"ckpt-{random.randrange(1 << 40):x}")


def _output(client) -> list:
    return sorted(tuple(r) for r in channels.open_reader(client, "out"))


@pytest.mark.parametrize("trial", range(20))
def test_kill_9_of_a_random_worker_at_a_random_moment_leaves_the_output_exact(trial):
    rng = random.Random(trial)
    pipeline = list(PIPELINES)[trial % 2]
    build, reference = PIPELINES[pipeline]
    n = 40_000
    client = _start(build, n, rate=100_000)
    co = client._coordinator
    victim = finish_after_a_kill(client, rng, after=(0.02, 0.35))
    assert len(co.recoveries) == 1, (pipeline, victim.task, co.recoveries)
    assert _output(client) == sorted(reference(n)), (pipeline, victim.task, co.recoveries)


def test_a_worker_killed_again_during_recovery_is_recovered_too():
    """Each kill after the first hits a worker of the recovered attempt as soon as it runs a task,
    long before that attempt has caught up. The kills wait for the recovery and for a busy worker
    (with deadlines): on a loaded machine a recovery takes seconds, longer than any fixed delay."""
    build, reference = PIPELINES["running_sums"]
    n = 60_000
    rng = random.Random(7)
    client = _start(build, n, rate=100_000)
    co = client._coordinator
    try:
        time.sleep(0.15)
        kill_a_busy_worker(co, rng)
        for recovered in (1, 2):
            wait_for_recoveries(co, recovered)
            kill_a_busy_worker(co, rng)  # one of the new attempt's workers, while it restarts
        assert client.wait(60).name == "FINISHED"
    finally:
        if not co.done:
            client.cancel()
            client.wait(30)
    assert len(co.recoveries) == 3, co.recoveries
    assert _output(client) == sorted(reference(n))


def test_readers_see_output_only_once_a_checkpoint_covers_it():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing()  # on demand only
    src = env.from_source(ChannelSource("in", PAIR), None, "in")
    src.key_by(lambda r: r[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).map(
        lambda r: r, output_type=PAIR
    ).sink_to(ChannelSink("out"))
    client = env.execute_async(f"visible-{random.randrange(1 << 40):x}")
    try:
        reader = channels.open_reader(client, "out")
        with channels.open_writer(client, "in") as writer:
            writer.write([(k % 5, k) for k in range(100)])
            co = client._coordinator
            deadline = time.monotonic() + 30
            while co.describe()["operators"][0]["records_in"] < 100:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(TimeoutError):  # processed, but not yet covered by a checkpoint
                reader.read_batch(timeout=0.3)
            report = client.trigger_checkpoint()
            assert report["id"] >= 1 and report["bytes"] > 0
            got = []
            while len(got) < 100:
                got.extend(_rows(reader.read_batch(timeout=10)))
            writer.write([(k % 5, k) for k in range(100, 150)])
        assert client.wait(60).name == "FINISHED"
        while (batch := reader.read_batch(timeout=10)) is not None:
            got.extend(_rows(batch))
    finally:
        if not client._coordinator.done:
            client.cancel()
            client.wait(30)
    acc, expected = {}, []
    for k in range(150):
        acc[k % 5] = acc.get(k % 5, 0) + k
        expected.append((k % 5, acc[k % 5]))
    assert sorted(got) == sorted(expected)


def _rows(batch: pa.RecordBatch) -> list[tuple]:
    return [tuple(r.values()) for r in batch.to_pylist()]


def test_checkpoints_and_rescales_requested_together_interleave():
    build, reference = PIPELINES["windows"]
    n = 60_000
    client = _start(build, n, rate=60_000, interval_ms=None)
    errors = []

    def checkpoints():
        for _ in range(8):
            try:
                client.trigger_checkpoint()
            except Exception as e:  # the job may end first
                if client._coordinator.status.name != "FINISHED":
                    errors.append(e)
            time.sleep(0.02)

    def rescales():
        for p in (3, 1, 4, 2):
            try:
                client.rescale("windows", p)
            except RuntimeError as e:  # the job may have read all its input, or ended
                if "consumed all its input" not in str(e) and client._coordinator.status.name != "FINISHED":
                    errors.append(e)
            time.sleep(0.03)

    threads = [threading.Thread(target=checkpoints), threading.Thread(target=rescales)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert client.wait(60).name == "FINISHED"
    assert not errors
    assert len(client._coordinator.checkpointer.history) >= 1
    assert _output(client) == sorted(reference(n))


JOB_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from stretch.datastream import StreamExecutionEnvironment
    from tests.runtime.test_checkpointing import running_sums
    from stretch.datastream.connectors.channel import ChannelSink

    name, parallelism, n, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.enable_checkpointing(50)
    running_sums(env, n, rate).sink_to(ChannelSink("out"))
    client = env.execute_async(name)
    print("started", flush=True)
    client.wait()
    print("finished", flush=True)
    """
)


def kill_after_checkpoints(proc: subprocess.Popen, store: CheckpointStore, count: int) -> None:
    """Once the job script ``proc`` (which prints "started") has completed ``count`` checkpoints,
    SIGKILL it: the coordinator dies, and its workers follow it."""
    try:
        assert proc.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 30
        while len(store.completed()) < count:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_job_whose_process_died_restores_from_its_checkpoint_at_another_parallelism(tmp_path):
    name = f"crash-{random.randrange(1 << 40):x}"
    n = 200_000
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, str(script), name, "1", str(n), "100000"], stdout=subprocess.PIPE, text=True, env=env
    )
    store = CheckpointStore(job_dir(name) / "checkpoints")
    kill_after_checkpoints(proc, store, 2)  # let it get some way in
    latest = store.latest()
    assert latest is not None and 0 < latest["sources"]["0"] < n  # records the source had read
    env2 = StreamExecutionEnvironment.get_execution_environment()
    env2.set_parallelism(3)  # restored at another parallelism: key groups, not instances, are saved
    env2.enable_checkpointing(50)
    running_sums(env2, n, 400_000).sink_to(ChannelSink("out"))
    client = env2.execute_async(name, restore=True)
    assert client.wait(60).name == "FINISHED"
    assert client._coordinator.restored_from == latest["id"]
    # the whole log, both runs: the uncommitted tail of the dead run was replaced by this run's
    got = sorted(tuple(r) for r in channels.open_reader(client, "out", from_offset=0))
    assert got == sorted(running_sums_reference(n))


CHANNEL_JOB_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from stretch import channels
    from stretch.datastream import StreamExecutionEnvironment
    from tests.runtime.test_checkpointing import channel_sums

    name, n = sys.argv[1], int(sys.argv[2])
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing()  # on demand: none is taken before the process dies
    client = channel_sums(env, name)
    writer = channels.open_writer(client, "in")
    writer.write([(k % KEYS, k) for k in range(n)])
    while client.describe()["operators"][0]["records_in"] < n:  # accepted, processed, not committed
        time.sleep(0.01)
    print("processed", flush=True)
    time.sleep(60)
    """
)


def channel_sums(env, name: str, restore: bool = False):
    """Running sums of what writers append to channel "in", into channel "out"."""
    env.from_source(ChannelSource("in", PAIR), None, "in").key_by(lambda r: r[0]).reduce(
        lambda a, b: (a[0], a[1] + b[1])
    ).map(lambda r: r, output_type=PAIR).sink_to(ChannelSink("out"))
    return env.execute_async(name, restore=restore)


def _run_until(script: Path, args: list, line: str) -> None:
    """Run a job script in a process of its own until it prints ``line``, then SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == line
    finally:
        proc.kill()
        proc.wait(30)


def test_a_job_whose_process_died_before_its_first_checkpoint_restores_from_its_start(tmp_path):
    """The dead run's accepted input is in its input log and its output was never committed: the
    restored run reads that input again from the run's start, and readers see each result once."""
    name = f"early-crash-{random.randrange(1 << 40):x}"
    n = 3000
    script = tmp_path / "job.py"
    script.write_text(CHANNEL_JOB_SCRIPT.replace("KEYS", str(KEYS)))
    _run_until(script, [name, str(n)], "processed")
    with pytest.raises(RuntimeError, match="stopped before its end"):  # and nothing of it committed
        channels.open_reader(name, "out", from_offset=0).read_batch()
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(3)
    env.enable_checkpointing(50)
    client = channel_sums(env, name, restore=True)
    assert client._coordinator.restored_from == 0  # the start of the dead run
    channels.open_writer(client, "in").end()
    assert client.wait(60).name == "FINISHED"
    got = sorted(tuple(r) for r in channels.open_reader(name, "out", from_offset=0))
    assert got == sorted(running_sums_reference(n))


def test_a_new_run_never_shows_what_a_dead_run_left_uncommitted(tmp_path):
    name = f"fresh-after-crash-{random.randrange(1 << 40):x}"
    n = 3000
    script = tmp_path / "job.py"
    script.write_text(CHANNEL_JOB_SCRIPT.replace("KEYS", str(KEYS)))
    _run_until(script, [name, str(n)], "processed")
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(50)
    client = channel_sums(env, name)  # a new run, not a restore: it starts over
    writer = channels.open_writer(client, "in")
    writer.write([(k % KEYS, k) for k in range(n)])
    writer.end()
    assert client.wait(60).name == "FINISHED"
    got = sorted(tuple(r) for r in channels.open_reader(name, "out", from_offset=0))
    assert got == sorted(running_sums_reference(n))


def test_a_new_run_recovers_from_its_own_start_not_from_an_earlier_runs_checkpoint():
    name = f"stale-{random.randrange(1 << 40):x}"
    build, reference = PIPELINES["running_sums"]
    earlier = _start(build, 10_000_000, rate=100_000, interval_ms=None, name=name)
    earlier.trigger_checkpoint()
    earlier.cancel()  # its checkpoints stay (they could restore it)
    assert CheckpointStore(job_dir(name) / "checkpoints").completed()
    n = 40_000
    client = _start(build, n, rate=100_000, interval_ms=None, name=name)  # on demand: none taken
    co = client._coordinator
    try:
        time.sleep(0.2)
        os.kill(next(w.pid for w in co.workers.all() if w.task is not None), signal.SIGKILL)
        assert client.wait(60).name == "FINISHED"
    finally:
        if not co.done:
            client.cancel()
            client.wait(30)
    assert [r["checkpoint"] for r in co.recoveries] == [0]
    assert _output(client) == sorted(reference(n))


def _die_at_500(r):
    if r[1] == 500:  # a native crash, say: this record kills its worker every time
        os.kill(os.getpid(), signal.SIGKILL)
    return r


def test_a_worker_that_dies_at_every_attempt_fails_the_job_instead_of_looping():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing()  # none completes between the deaths
    env.engine_config.checkpoint.max_recoveries_in_a_row = 3
    env.from_collection([(i % KEYS, i) for i in range(2000)], PAIR).map(_die_at_500, output_type=PAIR).key_by(
        lambda r: r[0]
    ).reduce(lambda a, b: (a[0], a[1] + b[1])).sink_to(ChannelSink("out"))
    client = env.execute_async(f"crash-loop-{random.randrange(1 << 40):x}")
    with pytest.raises(JobExecutionError, match="gives up: 3 recoveries in a row"):
        client.wait(60)
    assert len(client._coordinator.recoveries) == 3


def test_a_finished_job_has_nothing_to_restore():
    name = f"done-{random.randrange(1 << 40):x}"
    build, reference = PIPELINES["running_sums"]
    client = _start(build, 5000, rate=50_000, name=name)
    assert client.wait(60).name == "FINISHED"
    # its latest checkpoint stays, to read its state (stretch.state.read_checkpoint), not to restore
    assert len(list((job_dir(name) / "checkpoints").glob("*/_metadata.json"))) == 1
    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing(50)
    build(env, 5000, 50_000).sink_to(ChannelSink("out"))
    with pytest.raises(ValueError, match="there is nothing to restore; run it without restore"):
        env.execute_async(name, restore=True)
    again = _start(build, 5000, rate=50_000, name=name)  # without restore it runs again
    assert again.wait(60).name == "FINISHED" and _output(again) == sorted(reference(5000))


def test_a_checkpointed_job_refuses_a_channel_it_could_not_replay():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing(100)
    env.from_source(ChannelSource("in", PAIR, durable=False), None, "in").key_by(lambda r: r[0]).reduce(
        lambda a, b: a
    ).sink_to(ChannelSink("out"))
    with pytest.raises(ValueError, match="durable=True"):
        env.execute_async("not-durable")


def test_trigger_checkpoint_needs_checkpointing_enabled():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.from_source(ChannelSource("in", PAIR), None, "in").key_by(lambda r: r[0]).reduce(
        lambda a, b: a
    ).sink_to(ChannelSink("out"))
    client = env.execute_async("no-checkpoints")
    try:
        with pytest.raises(RuntimeError, match="enable_checkpointing"):
            client.trigger_checkpoint()
    finally:
        client.cancel()
        client.wait(30)


def test_status_shows_the_latest_checkpoint_and_the_cli_takes_one():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing()
    env.from_source(ChannelSource("in", PAIR), None, "in").key_by(lambda r: r[0]).reduce(
        lambda a, b: a
    ).sink_to(ChannelSink("out"))
    name = f"cli-{random.randrange(1 << 40):x}"
    client = env.execute_async(name)
    try:
        with channels.open_writer(client, "in") as writer:
            writer.write([(k, k) for k in range(50)])
            cli = [sys.executable, "-m", "stretch.cli"]
            out = subprocess.run(
                [*cli, "checkpoint", name], capture_output=True, text=True, timeout=60, check=False
            )
            assert out.returncode == 0, out.stderr
            assert out.stdout.startswith("checkpoint 1 complete")
            status = json.loads(
                subprocess.run(
                    [*cli, "status", name, "--json"], capture_output=True, text=True, timeout=60, check=True
                ).stdout
            )
            assert status["checkpoints"]["latest"]["id"] == 1
            assert status["checkpoints"]["completed"] == 1
    finally:
        client.wait(60)


def test_execute_and_collect_of_a_checkpointed_job_yields_each_result_once_across_a_kill():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(50)
    n = 40_000
    results = running_sums(env, n, 100_000).execute_and_collect(f"collect-{random.randrange(1 << 40):x}")
    co = results._coordinator
    got, killed, t0 = [], False, time.monotonic()
    with results:
        for r in results:
            got.append(tuple(r))
            if not killed and time.monotonic() - t0 > 0.15:
                os.kill(
                    random.choice([w for w in co.workers.all() if w.task is not None]).pid, signal.SIGKILL
                )
                killed = True
    assert killed and len(co.recoveries) == 1
    assert sorted(got) == sorted(running_sums_reference(n))


def test_a_branch_that_already_ended_keeps_its_output_exact_when_another_branch_recovers():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(50)
    short = DataGeneratorSource(batch_function=_pairs, count=3_000, batch_rows=1000, type_info=PAIR)
    env.from_source(short, None, "short").key_by(lambda r: r[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).map(
        lambda r: r, output_type=PAIR
    ).sink_to(ChannelSink("short"))
    running_sums(env, 60_000, 100_000).sink_to(ChannelSink("out"))
    client = env.execute_async(f"branches-{random.randrange(1 << 40):x}")
    co = client._coordinator
    short_sink = next(r for r in co.sink_runners if r.spec.sink.name == "short")
    deadline = time.monotonic() + 30
    while not short_sink.finished:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)
    keyed = [w for w in co.workers.all() if w.task is not None and co.plan.stages[w.task[0]].kind == "keyed"]
    os.kill(keyed[-1].pid, signal.SIGKILL)
    assert client.wait(60).name == "FINISHED"
    assert len(co.recoveries) == 1
    assert sorted(tuple(r) for r in channels.open_reader(client, "short")) == sorted(
        running_sums_reference(3_000)
    )
    assert _output(client) == sorted(running_sums_reference(60_000))
