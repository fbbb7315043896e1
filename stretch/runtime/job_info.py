"""A job's info file in the runtime directory: how ``stretch`` and ``stretch.jobs`` find it.

While the job runs the file names its control socket. When the job ends, the file becomes its
*ended record* (its final status, how it ended, no socket), kept while the job's process lives:
``stretch scale`` of a job that finished says so ("job 'clicks' has finished: it cannot be
rescaled"), as the job's own client does, instead of not knowing the job. The records go when the
process exits (at exit, or after SIGTERM), or, if it was killed, at the next sweep of the runtime
directory (``control_socket.local_jobs``); a process keeps those of its last ``KEEP_ENDED`` jobs.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
from pathlib import Path

KEEP_ENDED = 64  # ended records a process keeps: a process that runs jobs all day is not a registry

_lock = threading.Lock()
_ended: list[Path] = []  # this process's ended records, oldest first
_owner: int | None = None  # the pid that registered the exit hook (a forked child must not unlink)


def write(path: Path, info: dict) -> None:
    """Write the info file whole: a reader never sees half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


def keep_ended(path: Path, info: dict) -> None:
    """Replace the job's info file by its ended record ``info`` (which has ``ended``), kept until
    this process exits."""
    global _owner
    write(path, info)
    with _lock:
        if _owner != os.getpid():
            _owner = os.getpid()
            _ended.clear()
            atexit.register(forget_ended)
        _ended.append(path)
        dropped = _ended[:-KEEP_ENDED]
        del _ended[:-KEEP_ENDED]
    for old in dropped:
        with contextlib.suppress(OSError):
            old.unlink()


def forget_ended() -> None:
    """Remove this process's ended records (at its exit)."""
    with _lock:
        paths = list(_ended) if _owner == os.getpid() else []
        _ended.clear()
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()
