"""Where jobs keep what outlives a run: channel logs (and, later, checkpoints), per job name."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path

# the names are stretch.state's, so that it reads checkpoints without the runtime
from stretch.state.checkpoint_layout import job_dir, job_dir_name, state_root

__all__ = [
    "JobDir",
    "channel_dir",
    "job_dir",
    "job_dir_name",
    "make_private_dir",
    "state_root",
    "write_private",
]


def make_private_dir(path: Path) -> None:
    """Create ``path`` and any missing parent owner-only (0700): state may hold pickled values,
    and ``mkdir -p`` would leave the parents open to everyone."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            p.mkdir(mode=0o700)


def write_private(path: Path, data: str | bytes) -> None:
    """Write a file owner-only (0600), atomically: readers see the old content or the new."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    tmp.replace(path)


def channel_dir(job_name: str, channel: str, direction: str = "out") -> Path:
    """An output (``out``) or input (``in``) channel's log: the two may share a name."""
    return job_dir(job_name) / "channels" / direction / channel


class JobDir:
    """A run's hold on its job's directory: exclusive while the run lasts (a lock file), so two
    runs never append to one log. A run that finds its name's directory held by another running
    job works in a private directory of its own, ``<name>.run-<job id>``, which its JobClient's
    readers still find after the run, until the next run of that name starts."""

    def __init__(self, job_name: str, job_id: str):
        shared = job_dir(job_name)
        make_private_dir(shared.parent)
        if shared.parent.stat().st_mode & 0o077:  # left open by an earlier version of stretch
            with contextlib.suppress(PermissionError):
                os.chmod(shared.parent, 0o700)
        self._sweep(shared)
        self.private = not self._hold(shared)
        self.path = shared
        if self.private:
            self.path = shared.parent / f"{shared.name}.run-{job_id}"
            self._hold(self.path)

    def _hold(self, path: Path) -> bool:
        make_private_dir(path)
        fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock = fd
        return True

    @staticmethod
    def _sweep(shared: Path) -> None:
        """Remove private directories of this name whose runs are over."""
        for old in shared.parent.glob(f"{shared.name}.run-*"):
            try:
                fd = os.open(old / "lock", os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(old, ignore_errors=True)
            except BlockingIOError:
                pass
            finally:
                os.close(fd)

    def channel(self, name: str, direction: str) -> Path:
        return self.path / "channels" / direction / name

    def release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
