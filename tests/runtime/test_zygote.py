"""The zygote and its workers run the parent's ``stretch``, whatever the current directory holds,
and import the user's own modules from the parent's path."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import stretch
from stretch.datastream import StreamExecutionEnvironment
from stretch.runtime.zygote import package_root

N = 20_000


def _decoy_checkout(directory: Path) -> Path:
    """A folder like a source checkout whose ``stretch`` package cannot be imported."""
    (directory / "stretch").mkdir(parents=True)
    (directory / "stretch" / "__init__.py").write_text(
        "raise ImportError('the decoy stretch package of the current directory was imported')\n"
    )
    return directory


def _expected() -> dict[int, int]:
    sums: dict[int, int] = {}
    for x in range(N):
        sums[x % 7] = sums.get(x % 7, 0) + x * 3
    return sums


_USER_MODULE = """
def triple(x):
    return (x % 7, x * 3)
"""

_SCRIPT = """
import stretch
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import NumberSequenceSource

import user_helpers  # a module of the script's folder: its function travels by reference

env = StreamExecutionEnvironment.get_execution_environment()
env.set_parallelism(2)
ds = env.from_source(NumberSequenceSource(0, {n} - 1), None, "numbers").map(user_helpers.triple)
final = {{}}
with ds.key_by(lambda r: r[0]).sum(1).execute_and_collect() as results:
    for key, total in results:
        final[key] = total
print("STRETCH", stretch.__file__)
print("RESULT", sorted(final.items()))
"""


def _user_folder(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "user_helpers.py").write_text(_USER_MODULE)
    (directory / "job.py").write_text(_SCRIPT.format(n=N))
    return directory / "job.py"


def _run(script: Path, cwd: Path, pythonpath: Path) -> tuple[str, str]:
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    done = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"job script failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    return lines["STRETCH"], lines["RESULT"]


def test_package_root_is_where_this_process_imported_stretch():
    assert Path(package_root()) / "stretch" / "__init__.py" == Path(stretch.__file__).resolve()


def test_a_job_started_in_a_folder_with_another_stretch_runs_the_parents(tmp_path, monkeypatch):
    decoy = _decoy_checkout(tmp_path / "checkout")
    monkeypatch.chdir(decoy)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    ds = env.from_collection(list(range(N))).map(lambda x: (x % 7, x * 3))
    with ds.key_by(lambda r: r[0]).sum(1).execute_and_collect() as results:
        final = dict(results)
    assert final == _expected()


def test_an_installed_stretch_runs_from_a_source_checkout_and_from_elsewhere(tmp_path):
    """As after a regular (not editable) install: the package lives in a site directory of its
    own (its files laid out as a wheel lays them out, compiled extension included), and the
    script is run from a source checkout whose ``stretch/`` has no extension, and from its folder."""
    site = tmp_path / "site-packages"
    shutil.copytree(Path(stretch.__file__).parent, site / "stretch")  # numba's cache comes along
    script = _user_folder(tmp_path / "user")
    decoy = _decoy_checkout(tmp_path / "checkout")
    expected = repr(sorted(_expected().items()))
    for cwd in (decoy, script.parent):
        where, result = _run(script, cwd, site)
        assert where == str(site / "stretch" / "__init__.py")
        assert result == expected


def test_ctrl_c_is_the_programs_alone_the_zygote_and_workers_ignore_it(capfd):
    """A terminal's Ctrl-C reaches the whole process group; the job's own processes must neither
    die of it nor print tracebacks: the user's program decides (its KeyboardInterrupt ends the job)."""
    from stretch import channels
    from stretch.common import Types
    from stretch.datastream.connectors.channel import ChannelSink, ChannelSource

    record = Types.TUPLE([Types.LONG(), Types.LONG()])
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.from_source(ChannelSource("in", record), None, "in").key_by(lambda r: r[0]).sum(1).sink_to(
        ChannelSink("out")
    )
    client = env.execute_async("ctrl-c")
    try:
        co = client._coordinator
        pids = [co.workers.zygote.process.pid] + [w.pid for w in co.workers.all() if w.pid]
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        sent = [(i % 5, i) for i in range(1000)]
        with channels.open_writer(client, "in") as writer:
            writer.write(sent)
        results = list(channels.open_reader(client, "out"))
    finally:
        client.wait(60)
    sums: dict[int, int] = {}
    expected = []
    for k, v in sent:  # the rolling sum, per key
        sums[k] = sums.get(k, 0) + v
        expected.append((k, sums[k]))
    assert sorted(results) == sorted(expected)
    assert "KeyboardInterrupt" not in capfd.readouterr().err


def _sums(n: int) -> dict[int, int]:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    final: dict[int, int] = {}
    with (
        env.from_collection([(x % 7, x) for x in range(n)])
        .key_by(lambda r: r[0])
        .sum(1)
        .execute_and_collect() as it
    ):
        for key, total in it:
            final[key] = total
    return final


def test_jobs_of_a_process_share_its_zygote_and_one_that_died_is_replaced():
    from stretch.runtime import zygote

    want = {k: sum(x for x in range(500) if x % 7 == k) for k in range(7)}
    assert _sums(500) == want
    first = zygote.shared_pid()
    assert first is not None and _sums(500) == want and zygote.shared_pid() == first
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while zygote.shared_pid() == first:  # its keeper thread reaps it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _sums(500) == want  # a new zygote, started for this job
    assert zygote.shared_pid() not in (None, first)


def _collector_view(_) -> tuple[int, int]:
    import gc

    return gc.get_freeze_count(), len(gc.get_objects())


def test_a_workers_collections_skip_what_it_got_from_the_zygote():
    """The modules the zygote imported are frozen out of a worker's collections (a full one
    would otherwise scan them all, about 100 ms): they outnumber what the collector sees."""
    env = StreamExecutionEnvironment.get_execution_environment()
    with env.from_collection([0]).map(_collector_view).execute_and_collect() as it:
        ((frozen, collected),) = list(it)
    assert frozen > 50_000
    assert frozen > 2 * collected
