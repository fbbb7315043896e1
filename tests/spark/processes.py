"""Killing a second process that runs a Spark query, at a moment a test chooses."""

from __future__ import annotations

import time
from pathlib import Path


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def kill_when(process, ready, timeout: float = 120.0) -> None:
    """SIGKILL ``process`` once ``ready()`` holds, then wait until its Spark JVM has gone too."""
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert time.monotonic() < deadline and process.poll() is None, "the query never got going"
            time.sleep(0.05)
        jvms = children_of(process.pid)
    finally:
        process.kill()
        process.wait()
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in jvms):  # the JVM ends with its parent
        assert time.monotonic() < deadline
        time.sleep(0.1)
