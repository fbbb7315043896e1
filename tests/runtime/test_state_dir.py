"""A job's directory is its name's alone: names that read alike never share checkpoints or channel
logs, and everything a job keeps is its owner's only (directories 0700, files 0600)."""

from __future__ import annotations

import random
import stat

import pyarrow as pa
import pytest

from stretch import channels
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink
from stretch.datastream.connectors.datagen import DataGeneratorSource, RateLimiterStrategy
from stretch.runtime.channel_log import ChannelLog
from stretch.runtime.checkpointing import CheckpointStore
from stretch.runtime.state_dir import job_dir, job_dir_name, state_root

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])
KEYS = 7


def test_job_names_map_to_directories_one_to_one():
    names = [
        "clicks per user",
        "clicks_per_user",
        "clicks/per/user",
        "clicks.per.user",
        "clicks per user.run-1",
        "Clicks per user",
        "",
        "_",
        "é",
        "ü",
        "x" * 300,
        "x" * 301,
    ]
    dirs = [job_dir_name(n) for n in names]
    assert len(set(dirs)) == len(names)
    assert dirs == [job_dir_name(n) for n in names]  # the same name finds its directory again
    for name, d in zip(names, dirs):
        assert "." not in d and "/" not in d and len(d) < 100
    assert dirs[0].startswith("clicks_per_user-")  # readable in ls
    assert dirs[3].startswith("clicks_per_user-")


def _running_sums(env, n: int, rate: int):
    src = DataGeneratorSource(
        generator_function=lambda i: (i % KEYS, i),
        count=n,
        rate_limiter_strategy=RateLimiterStrategy.per_second(rate),
        batch_rows=500,
        type_info=PAIR,
    )
    summed = (
        env.from_source(src, None, "numbers").key_by(lambda r: r[0]).reduce(lambda a, b: (a[0], a[1] + b[1]))
    )
    summed.map(lambda r: r, output_type=PAIR).sink_to(ChannelSink("out"))


def _reference(n: int) -> list:
    acc, out = {}, []
    for i in range(n):
        acc[i % KEYS] = acc.get(i % KEYS, 0) + i
        out.append((i % KEYS, acc[i % KEYS]))
    return sorted(out)


def _start(name: str, n: int, rate: int, restore: bool = False):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing()  # on demand
    _running_sums(env, n, rate)
    return env.execute_async(name, restore=restore)


def _kept(name: str) -> list:
    return sorted(tuple(r) for r in channels.open_reader(name, "out", from_offset=0))


def test_names_that_read_alike_keep_their_own_checkpoints_and_output():
    tag = f"{random.randrange(1 << 40):x}"
    spaced, underscored = f"clicks per user {tag}", f"clicks_per_user_{tag}"
    n_spaced, n_underscored = 20_000, 3_000
    first = _start(spaced, n_spaced, rate=20_000)
    try:
        first.trigger_checkpoint()
    finally:
        first.cancel()  # its checkpoint stays, to restore it
        first.wait(30)
    other = _start(underscored, n_underscored, rate=1_000_000)
    assert other.wait(60).name == "FINISHED"  # a finished job drops its own checkpoints only
    assert CheckpointStore(job_dir(spaced) / "checkpoints").completed()
    restored = _start(spaced, n_spaced, rate=1_000_000, restore=True)
    assert restored.wait(60).name == "FINISHED"
    assert restored._coordinator.restored_from
    assert _kept(spaced) == _reference(n_spaced)
    assert _kept(underscored) == _reference(n_underscored)


def _modes(root) -> dict:
    """Permission bits of the root and of everything below it, by path."""
    found = {root: stat.S_IMODE(root.stat().st_mode)}
    for p in root.rglob("*"):
        found[p] = stat.S_IMODE(p.lstat().st_mode)
    return found


def test_everything_a_job_keeps_is_owner_only(tmp_path, monkeypatch):
    monkeypatch.setenv("STRETCH_STATE_DIR", str(tmp_path / "state"))  # made by the job
    name = f"private {random.randrange(1 << 40):x}"
    client = _start(name, 50_000_000, rate=50_000)
    try:
        client.trigger_checkpoint()
        log = ChannelLog(job_dir(name) / "channels" / "out" / "out", create=False)
        log.register("query")  # a reader's commit file, as a Spark query keeps one
        log.commit("query", 1)
    finally:
        client.cancel()
        client.wait(30)
    modes = _modes(state_root())
    files = [p for p in modes if p.is_file()]
    assert any(p.name == "_metadata.json" for p in files) and any(p.suffix == ".arrow" for p in files)
    assert any(p.name == "index" for p in files) and any(p.name == "commits.json" for p in files)
    assert any(p.name == "commits.lock" for p in files) and any(p.suffix == ".arrows" for p in files)
    loose = {str(p): oct(m) for p, m in modes.items() if m != (0o600 if p.is_file() else 0o700)}
    assert not loose


def test_a_channel_log_made_on_its_own_is_owner_only(tmp_path):
    log = ChannelLog(tmp_path / "a" / "b" / "log")
    log.append(pa.record_batch({"x": [1, 2]}))
    log.set_committed(1)
    log.register("q")
    log.commit("q", 1)
    log.end()
    log.close()
    modes = _modes(tmp_path / "a")
    assert {p.name for p in modes if p.is_file()} >= {"index", "committed", "commits.json", "ended"}
    assert {str(p): oct(m) for p, m in modes.items() if m != (0o600 if p.is_file() else 0o700)} == {}


@pytest.mark.parametrize("mode", [0o755, 0o775])
def test_a_jobs_directory_left_open_is_closed(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("STRETCH_STATE_DIR", str(tmp_path))
    jobs = tmp_path / "jobs"
    jobs.mkdir(mode=0o700)
    jobs.chmod(mode)
    from stretch.runtime.state_dir import JobDir

    held = JobDir("anything", "1")
    try:
        assert stat.S_IMODE(jobs.stat().st_mode) == 0o700
        assert stat.S_IMODE(held.path.stat().st_mode) == 0o700
    finally:
        held.release()
