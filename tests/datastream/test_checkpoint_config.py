"""PyFlink's checkpoint setup runs unchanged, and each setting does what it does in Flink: the
interval and the minimum pause space the checkpoints, the timeout fails a slow one, the tolerable
number of failures fails the job, and the retention decides what a cancelled job leaves."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from stretch import channels
from stretch.common import Types
from stretch.datastream import (
    CheckpointingMode,
    ExternalizedCheckpointRetention,
    StreamExecutionEnvironment,
)
from stretch.datastream.connectors.channel import ChannelSink
from stretch.datastream.connectors.datagen import DataGeneratorSource, RateLimiterStrategy
from stretch.errors import JobExecutionError
from stretch.runtime.state_dir import job_dir

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])


def _name(prefix: str) -> str:
    return f"{prefix}-{random.randrange(1 << 40):x}"


def _counting_job(env, n: int, rate: int, pause_s: float = 0.0):
    """Per-key running counts of n records; ``pause_s`` slows the source down per record."""

    def record(i):
        if pause_s:
            time.sleep(pause_s)
        return (i % 7, i)

    src = DataGeneratorSource(
        generator_function=record,
        count=n,
        rate_limiter_strategy=RateLimiterStrategy.per_second(rate),
        type_info=PAIR,
        batch_rows=1 if pause_s else 100,
    )
    env.from_source(src, None, "numbers").key_by(lambda r: r[0]).map(
        lambda r: (r[0], 1), output_type=PAIR
    ).key_by(lambda r: r[0]).sum(1).sink_to(ChannelSink("out"))


def _reference(n: int) -> list:
    counts: dict = {}
    out = []
    for i in range(n):
        counts[i % 7] = counts.get(i % 7, 0) + 1
        out.append((i % 7, counts[i % 7]))
    return sorted(out)


def test_a_pyflink_checkpoint_setup_runs_unchanged_and_reads_back():
    env = StreamExecutionEnvironment.get_execution_environment()
    assert not env.get_checkpoint_config().is_checkpointing_enabled()
    assert env.get_checkpoint_interval() == -1
    env.set_parallelism(2)
    env.enable_checkpointing(200, CheckpointingMode.EXACTLY_ONCE)
    config = env.get_checkpoint_config()
    assert config is env.get_checkpoint_config()
    config.set_checkpointing_mode(CheckpointingMode.AT_LEAST_ONCE)
    config.set_min_pause_between_checkpoints(50)
    config.set_checkpoint_timeout(60_000)
    config.set_max_concurrent_checkpoints(1)
    config.set_tolerable_checkpoint_failure_number(3)
    config.set_externalized_checkpoint_retention(ExternalizedCheckpointRetention.RETAIN_ON_CANCELLATION)
    assert config.is_checkpointing_enabled()
    assert env.get_checkpointing_mode() is CheckpointingMode.AT_LEAST_ONCE
    assert (config.get_checkpoint_interval(), config.get_min_pause_between_checkpoints()) == (200, 50)
    assert (config.get_checkpoint_timeout(), config.get_max_concurrent_checkpoints()) == (60_000, 1)
    assert config.get_tolerable_checkpoint_failure_number() == 3
    assert (
        config.get_externalized_checkpoint_retention()
        is ExternalizedCheckpointRetention.RETAIN_ON_CANCELLATION
    )

    n = 3000
    _counting_job(env, n, rate=6000)
    client = env.execute_async(_name("pyflink-setup"))
    assert client.wait(60).name == "FINISHED"
    assert sorted(tuple(r) for r in channels.open_reader(client, "out")) == _reference(n)
    assert client.describe()["checkpoints"]["completed"] >= 1


def test_set_checkpoint_interval_turns_checkpointing_on_and_bad_values_are_refused():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.get_checkpoint_config().set_checkpoint_interval(500)
    assert env.get_checkpoint_config().is_checkpointing_enabled() and env.get_checkpoint_interval() == 500
    config = env.get_checkpoint_config()
    for call, value in [
        (config.set_checkpoint_interval, 0),
        (config.set_checkpoint_timeout, -5),
        (config.set_min_pause_between_checkpoints, -1),
        (config.set_max_concurrent_checkpoints, 0),
        (config.set_tolerable_checkpoint_failure_number, -1),
        (config.set_checkpoint_interval, 1.5),
    ]:
        with pytest.raises(ValueError):
            call(value)
    with pytest.raises(TypeError):
        config.set_checkpointing_mode("exactly_once")
    with pytest.raises(ValueError):
        env.enable_checkpointing(-10)


def test_checkpoints_start_every_interval_but_never_sooner_than_the_min_pause_after_the_last():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(50)
    env.get_checkpoint_config().set_min_pause_between_checkpoints(300)
    _counting_job(env, 100_000, rate=50_000)
    client = env.execute_async(_name("min-pause"))
    assert client.wait(60).name == "FINISHED"
    history = client._coordinator.checkpointer.history
    assert len(history) >= 3, history
    for before, after in itertools.pairwise(history):
        started = after["completed_at"] - after["duration_ms"] / 1000
        assert started - before["completed_at"] >= 0.3 - 0.01, (before, after)
    # without the pause, the 50 ms interval alone spaces them: many more in the same time
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(50)
    _counting_job(env, 100_000, rate=50_000)
    client = env.execute_async(_name("interval"))
    assert client.wait(60).name == "FINISHED"
    # more: on a busy machine a checkpoint lasts about as long as the pause, so not twice as many
    assert client._coordinator.checkpointer.completed > len(history)


def test_checkpoints_that_time_out_are_counted_and_the_job_goes_on_by_default():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    env.enable_checkpointing(20)
    env.get_checkpoint_config().set_checkpoint_timeout(10)  # the source pauses 100 ms per record
    n = 12
    _counting_job(env, n, rate=1000, pause_s=0.1)
    client = env.execute_async(_name("timeouts"))
    assert client.wait(60).name == "FINISHED"
    status = client.describe()["checkpoints"]
    assert status["failed"] >= 3 and "TimeoutError" in status["last_error"]
    assert sorted(tuple(r) for r in channels.open_reader(client, "out")) == _reference(n)


def test_more_failed_checkpoints_in_a_row_than_tolerable_fail_the_job():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    env.enable_checkpointing(20)
    config = env.get_checkpoint_config()
    config.set_checkpoint_timeout(10)
    config.set_tolerable_checkpoint_failure_number(2)
    _counting_job(env, 200, rate=1000, pause_s=0.1)
    client = env.execute_async(_name("intolerable"))
    with pytest.raises(JobExecutionError, match="3 checkpoints in a row failed") as raised:
        client.wait(60)
    assert isinstance(raised.value.__cause__, TimeoutError)
    assert client.get_job_status().result().name == "FAILED"


@pytest.mark.parametrize("retention", list(ExternalizedCheckpointRetention))
def test_a_cancelled_job_keeps_or_deletes_its_checkpoints_as_its_retention_says(retention):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing()
    env.get_checkpoint_config().set_externalized_checkpoint_retention(retention)
    _counting_job(env, 10_000_000, rate=20_000)
    name = _name("retention")
    client = env.execute_async(name)
    client.trigger_checkpoint()
    checkpoints = job_dir(name) / "checkpoints"
    assert any(checkpoints.glob("*/_metadata.json"))
    client.cancel()
    client.wait(30)
    kept = any(checkpoints.glob("*/_metadata.json"))
    assert kept == (retention is ExternalizedCheckpointRetention.RETAIN_ON_CANCELLATION)
