"""Suite-wide guards: every test leaves no shared-memory segment of this process and no child process.

A test that forgets to unlink a segment or to join a helper process fails at teardown with a list of
what it left; the leftovers are then removed (segments unlinked, children killed and reaped) so that
the next test starts clean and is judged on its own.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

_SHM = Path("/dev/shm")


@pytest.fixture(autouse=True, scope="session")
def _state_dir(tmp_path_factory):
    """Jobs keep their channel logs in a directory of the test session, not the user's."""
    os.environ["STRETCH_STATE_DIR"] = str(tmp_path_factory.mktemp("stretch-state"))
    yield
    os.environ.pop("STRETCH_STATE_DIR", None)


_GRACE = 2.0  # seconds a child may take to finish exiting after its test


def _own_segments() -> list[str]:
    """Segments named like an engine prefix created by this (test) process."""
    return sorted(p.name for p in _SHM.glob(f"stretch-{os.getuid()}-{os.getpid()}-*"))


# Children that outlive single tests on purpose (the suite's Spark JVM); their fixture ends them.
EXPECTED_CHILDREN: set[int] = set()


@pytest.fixture(scope="session")
def spark(expected_children):
    """One local Spark session for every test of this process that needs one (the Spark tests, the
    docs' Spark examples), started when the first asks: starting a JVM takes 15 to 25 s, so a
    session per file or package would cost minutes of the suite (files of one package are not run
    in a row under xdist). It ends with its JVM when the process's tests are done."""
    from tests.spark.session import local_spark

    with local_spark(expected_children, "stretch tests", log_level="ERROR") as session:
        yield session


@pytest.fixture(scope="session")
def expected_children() -> set[int]:
    """Add the pid of a child that a wider-scoped fixture starts and ends itself."""
    return EXPECTED_CHILDREN


def _children() -> dict[int, str]:
    """pid -> state letter of every process whose parent is this process (zombies included),
    except the expected ones, and of every worker of this process's zygote: the zygote is shared
    by the jobs of the process and ends with it, a job's workers end with the job."""
    from stretch.runtime import zygote

    me = os.getpid()
    parents = {me, zygote.shared_pid()}
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        pid = int(entry.name)
        if len(fields) >= 2 and int(fields[1]) in parents and pid not in EXPECTED_CHILDREN | parents:
            found[pid] = fields[0]
    return found


def _live_children() -> dict[int, str]:
    deadline = time.monotonic() + _GRACE
    children = _children()
    while children and time.monotonic() < deadline:
        time.sleep(0.02)
        children = _children()
    return children


def _kill_and_reap(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


@pytest.fixture(autouse=True)
def _no_leftover_segments_or_children():
    yield
    problems = []
    children = _live_children()
    if children:
        listing = ", ".join(
            f"{pid} ({'zombie: never joined' if st == 'Z' else st})" for pid, st in children.items()
        )
        problems.append(f"child processes left running or unjoined: {listing}")
        _kill_and_reap(children)
    segments = _own_segments()
    if segments:
        problems.append(f"shared-memory segments left in /dev/shm: {segments}")
        from stretch import _shm as shm

        for name in segments:
            shm.unlink(name)
    if problems:
        pytest.fail("test did not clean up after itself: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def shm_prefix():
    """A fresh engine prefix whose segments are all unlinked when the test ends."""
    from stretch import _shm as shm

    prefix = shm.engine_prefix()
    try:
        yield prefix
    finally:
        shm.unlink_prefix(prefix)


class Forked:
    """Helper processes forked from the test process; whatever is still alive at teardown is killed."""

    def __init__(self):
        import multiprocessing

        self._ctx = multiprocessing.get_context("fork")
        self.procs = []

    def start(self, target, *args):
        p = self._ctx.Process(target=target, args=args, daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def join(self, procs=None, timeout: float = 30.0) -> None:
        """Join processes (default: all), failing if one hangs past the deadline or exits non-zero."""
        procs = self.procs if procs is None else procs
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.01))
        hung = [p.pid for p in procs if p.is_alive()]
        assert not hung, f"helper processes {hung} did not finish within {timeout} s"
        failed = {p.pid: p.exitcode for p in procs if p.exitcode != 0}
        assert not failed, f"helper processes exited abnormally (pid: exit code): {failed}"

    def cleanup(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)


@pytest.fixture
def forked():
    """Start helper processes with ``forked.start(fn, *args)`` (fork start method); killed at teardown."""
    f = Forked()
    try:
        yield f
    finally:
        f.cleanup()


@pytest.fixture(autouse=True)
def _ship_test_code_by_value():
    """Functions defined in test modules travel to workers by value, as a user's script's do.

    cloudpickle would otherwise ship them by reference, making every worker import the test
    module, and with it pytest: a second or more per worker that tests would measure as a stall.
    """
    import sys

    import cloudpickle

    for name, module in list(sys.modules.items()):
        ours = name == "tests" or name.startswith(("tests.", "test_"))
        if ours and getattr(module, "__file__", None) and name not in _by_value:
            cloudpickle.register_pickle_by_value(module)
            _by_value.add(name)
    yield


_by_value: set[str] = set()
