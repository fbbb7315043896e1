"""Shared memory that is too small or fills up fails with a clear error, never with a bus error.

The tests that need a small /dev/shm run a script in a private mount namespace with its own
tmpfs on /dev/shm (``unshare -m``, as root), so that nothing else on the machine is affected; if
that cannot be set up here, they fail rather than pass untested.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

import stretch
from stretch import _shm as shm
from stretch.state.arena import Arena

ROOT = Path(stretch.__file__).resolve().parent.parent


def _in_small_shm(size_mb: int, code: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``code`` with a fresh ``size_mb`` MB tmpfs on /dev/shm; its output ends with the exit
    status of the Python process and what was left in that tmpfs (the shell prints both)."""
    script = (
        f"mount -t tmpfs -o size={size_mb}m tmpfs /dev/shm || exit 97\n"
        'python -c "$STRETCH_TEST_CODE"\n'
        'echo "EXIT $?"\n'
        'echo "LEFT $(ls -A /dev/shm | tr "\\n" " ")"\n'
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), STRETCH_TEST_CODE=textwrap.dedent(code))
    env.pop("PYTHONUNBUFFERED", None)
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert done.returncode == 0 and "EXIT " in done.stdout, (
        f"could not run with a private {size_mb} MB /dev/shm (unshare -m and mount need root): "
        f"status {done.returncode}\n{done.stdout}\n{done.stderr}"
    )
    return done


def _status(done: subprocess.CompletedProcess) -> int:
    return int(done.stdout.split("EXIT ", 1)[1].split()[0])


def _left(done: subprocess.CompletedProcess) -> str:
    return done.stdout.split("LEFT", 1)[1].strip()


def _assert_clear_error(done, *details: str) -> None:
    """Failed in the user's process with status 1 (an exception, not a signal), said why and
    how to give more, and left nothing behind."""
    out = done.stdout + done.stderr
    assert _status(done) == 1, f"expected an exception (status 1), got status {_status(done)}:\n{out}"
    assert "shared memory is full" in out, out
    assert "--shm-size" in out and "medium: Memory" in out, out
    for detail in details:
        assert detail in out, out
    assert _left(done) == "", f"left in /dev/shm: {_left(done)}"


def test_the_private_shm_is_the_size_asked_for():
    done = _in_small_shm(
        16,
        """
        import os
        st = os.statvfs("/dev/shm")
        print("TOTAL", st.f_blocks * st.f_frsize)
        """,
    )
    assert f"TOTAL {16 << 20}" in done.stdout


def test_a_segment_is_reserved_in_full_when_created(shm_prefix):
    s = shm.Segment.create(shm_prefix, "reserved", 8 << 20)
    try:
        assert s.resident_bytes() == 8 << 20  # allocated, though nothing was written yet
    finally:
        s.close()


def test_a_state_arena_reserves_each_allocation(shm_prefix):
    arena = Arena.create(shm_prefix, 16)
    try:
        start = arena.resident_bytes()
        off = arena.alloc(3 << 20)
        assert arena.resident_bytes() - start == 3 << 20  # reserved, not yet written
        arena.free(off, 3 << 20)
        assert arena.resident_bytes() == start
    finally:
        arena.close()


def test_a_segment_larger_than_the_free_shared_memory_is_an_error_and_leaves_nothing():
    done = _in_small_shm(
        4,
        """
        import os
        from stretch import _shm as shm
        prefix = shm.engine_prefix()
        try:
            shm.Segment.create(prefix, "big", 6 << 20)
        except shm.SharedMemoryFull as e:
            print("ERROR", e)
        print("FREE", shm.free_bytes())
        print("NAMES", sorted(os.listdir("/dev/shm")))
        """,
    )
    assert _status(done) == 0, done.stdout + done.stderr
    assert "ERROR shared memory is full: a new big segment needs 6.0 MiB more" in done.stdout
    assert "/dev/shm has 4.0 MiB free of 4.0 MiB" in done.stdout
    assert f"FREE {4 << 20}" in done.stdout  # the failed reservation holds nothing
    assert "NAMES []" in done.stdout


JOB = """
import sys
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import NumberSequenceSource

n, keys = {n}, {keys}
env = StreamExecutionEnvironment.get_execution_environment()
env.set_parallelism(2)
{config}
ds = env.from_source(NumberSequenceSource(0, n - 1), None, "numbers").map(lambda x: (x % keys, x))
final = {{}}
with ds.key_by(lambda r: r[0]).sum(1).execute_and_collect() as results:
    for key, total in results:
        final[key] = total
expected = {{}}
for x in range(n):
    expected[x % keys] = expected.get(x % keys, 0) + x
print("CORRECT", final == expected)
"""


def _job(n: int, keys: int, config: str = "") -> str:
    return JOB.format(n=n, keys=keys, config=config)


def test_a_job_runs_in_a_small_shared_memory_with_gates_sized_to_fit():
    """16 MB: default gates of 32 MiB would not fit; they are sized down to leave room."""
    done = _in_small_shm(16, _job(400_000, 1000))
    assert _status(done) == 0, done.stdout + done.stderr
    assert "CORRECT True" in done.stdout
    assert _left(done) == ""


@pytest.mark.parametrize("size_mb", [16, 64])
def test_state_that_outgrows_shared_memory_fails_the_job_with_a_clear_error(size_mb):
    """One key per record: the keyed state outgrows /dev/shm (a plain keyed sum of 3 M records
    died with SIGBUS in a 64 MB /dev/shm, Docker's default, and left its segments behind)."""
    done = _in_small_shm(size_mb, _job(3_000_000, 3_000_000))
    _assert_clear_error(done, "operator 'Sum' failed", "the keyed state (arena", f"free of {size_mb}.0 MiB")


def test_gates_that_do_not_fit_fail_the_job_at_start_with_a_clear_error():
    config = "env.engine_config.gate_bytes = 8 << 20"
    done = _in_small_shm(6, _job(1000, 10, config))
    _assert_clear_error(done, "a new gate segment needs 8.0 MiB more")
