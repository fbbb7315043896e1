"""Every way a job's process can end leaves no process and no shared-memory segment behind (or the
next engine start reaps what a killed one left); under overload memory stays bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stretch.runtime.control_socket import running_jobs

JOB = textwrap.dedent(
    """
    import sys, time
    import numpy as np, pyarrow as pa
    from stretch.common import Types
    from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
    from stretch.datastream.connectors import DiscardingSink
    from stretch.datastream.connectors.datagen import DataGeneratorSource

    class Slow(KeyedProcessFunction):
        def process_element(self, value, ctx):
            time.sleep(0.0002)  # about 5,000 records/s per instance: far below what the source makes
            yield value

    def batch(i, n):
        idx = np.arange(i, i + n, dtype=np.int64)
        return pa.record_batch([pa.array(idx % 1000), pa.array(idx)], names=["f0", "f1"])

    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    if sys.argv[2] == "checkpointed":
        env.enable_checkpointing(200)
    pair = Types.TUPLE([Types.LONG(), Types.LONG()])
    src = DataGeneratorSource(batch_function=batch, count=None, batch_rows=4096, type_info=pair)
    env.from_source(src, None, "flood").key_by(lambda r: r[0]).process(Slow(), output_type=pair).sink_to(
        DiscardingSink()
    )
    client = env.execute_async(sys.argv[1])
    print("started", flush=True)
    client.wait()
    """
)


def _descendants(pid: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(p.name))
    out, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _segments_of(pid: int) -> list[str]:
    return [
        p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("stretch-") and f"-{pid}-" in p.name
    ]


def _pss_bytes(pids) -> int:
    """Memory of these processes together (proportional set size: shared pages counted once)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def _start(tmp_path, mode: str):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    name = f"exit-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, str(script), name, mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 30
    while not any(j.get("name") == name for j in running_jobs()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc, name


@pytest.mark.parametrize("mode", ["plain", "checkpointed"])
def test_sigterm_of_the_job_process_ends_everything_and_removes_every_segment(tmp_path, mode):
    from stretch.runtime.control_socket import runtime_dir

    proc, name = _start(tmp_path, mode)
    (info,) = [j for j in running_jobs() if j["name"] == name]
    try:
        time.sleep(0.5)
        family = _descendants(proc.pid)
        assert family and _segments_of(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        deadline = time.monotonic() + 10
        while (_alive(family) or _segments_of(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(family) == []
        assert _segments_of(proc.pid) == []
        assert not (runtime_dir() / f"{info['job_id']}.json").exists()  # nor the job's ended record
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigkill_of_the_job_process_ends_its_workers_and_the_next_engine_reaps_its_segments(tmp_path):
    from stretch import _shm as shm
    from stretch.runtime.control_socket import runtime_dir

    proc, name = _start(tmp_path, "checkpointed")
    (info,) = [j for j in running_jobs() if j["name"] == name]
    left = [
        runtime_dir() / f"{info['job_id']}.json",
        Path(info["socket"]),
        runtime_dir() / "staging" / info["job_id"],
    ]
    assert all(p.exists() for p in left)
    family = _descendants(proc.pid)
    proc.kill()
    proc.wait(30)
    deadline = time.monotonic() + 10
    while _alive(family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive(family) == []  # workers and zygote follow their parent (parent-death signal)
    shm.reap_dead_engines()  # what every engine start does first
    assert _segments_of(proc.pid) == []
    running_jobs()  # and this: the dead job's info, socket and staging directory go too
    assert [p for p in left if p.exists()] == []


def test_memory_stays_bounded_under_overload(tmp_path):
    """The source could make ~100x what the operator processes; gates are fixed-size, so the
    source is held back (backpressure) and the job's memory stays flat. Bound: the job's
    processes together (proportional set size) stay within 1 GiB and grow by < 64 MiB after
    warm-up; measured: about 380 MiB, flat, for seven processes."""
    proc, name = _start(tmp_path, "checkpointed")
    try:
        family = {proc.pid} | _descendants(proc.pid)
        time.sleep(1.5)
        samples = []
        for _ in range(20):
            samples.append(_pss_bytes(family))
            time.sleep(0.15)
        status = subprocess.run(
            [sys.executable, "-m", "stretch.cli", "status", name, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        depth = json.loads(status.stdout)["operators"][0]["gate_depth"]
        assert depth > 0  # the backlog waits in the fixed-size gate: the source is held back
        assert max(samples) < 1 << 30, f"resident memory {max(samples) / 2**20:.0f} MiB"
        assert max(samples[10:]) - min(samples[:10]) < 64 << 20, [s >> 20 for s in samples]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
