"""Where jobs keep what outlives a run: channel logs (and, later, checkpoints), per job name."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path


def state_root() -> Path:
    """``$STRETCH_STATE_DIR``, else ``$XDG_STATE_HOME/stretch``, else ``~/.local/state/stretch``."""
    explicit = os.environ.get("STRETCH_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "stretch"


def job_dir(job_name: str) -> Path:
    """A job's directory, named after the job (the name is what a restarted job shares)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job_name) or "_"
    return state_root() / "jobs" / safe


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
        self._sweep(shared)
        self.private = not self._hold(shared)
        self.path = shared
        if self.private:
            self.path = shared.parent / f"{shared.name}.run-{job_id}"
            self._hold(self.path)

    def _hold(self, path: Path) -> bool:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
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
