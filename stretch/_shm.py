"""Shared-memory segments with owner-only permissions, unguessable names and guaranteed removal.

Every segment of one engine shares the prefix ``stretch-<uid>-<pid>-<token>``; the pid lets a
later engine recognise and reap the segments of an engine that died without cleaning up.
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
import threading
from pathlib import Path

import numpy as np
import posix_ipc

from stretch._native import Region

SHM_DIR = Path("/dev/shm")
PREFIX = "stretch"


def engine_prefix() -> str:
    """A fresh per-engine prefix: user, creating pid, and 64 random bits."""
    return f"{PREFIX}-{os.getuid()}-{os.getpid()}-{secrets.token_hex(8)}"


class Segment:
    """One mapped POSIX shared-memory segment, with a numpy byte view and native atomics."""

    def __init__(self, name: str, size: int, owner: bool):
        self.name = name
        self.size = size
        self.owner = owner
        shm = posix_ipc.SharedMemory("/" + name)
        try:
            self.mmap = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        self.bytes = np.frombuffer(self.mmap, dtype=np.uint8)
        self.region = Region(self.mmap)

    @classmethod
    def create(cls, prefix: str, kind: str, size: int) -> Segment:
        """Create a zero-filled, owner-only segment; it is unlinked at exit if not before."""
        name = f"{prefix}-{kind}-{secrets.token_hex(4)}"
        shm = posix_ipc.SharedMemory("/" + name, flags=posix_ipc.O_CREX, mode=0o600, size=size)
        shm.close_fd()
        _created.add(name)
        try:
            return cls(name, size, owner=True)
        except BaseException:
            unlink(name)
            raise

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment created by another process of the same engine."""
        size = os.stat(SHM_DIR / name).st_size
        return cls(name, size, owner=False)

    def view(self, dtype, offset: int = 0, count: int = -1) -> np.ndarray:
        """A typed, zero-copy view of part of the segment."""
        return np.frombuffer(self.mmap, dtype=dtype, count=count, offset=offset)

    def release_pages(self, offset: int, length: int) -> None:
        """Return whole pages in [offset, offset+length) to the OS; they read as zeros afterwards."""
        page = mmap.PAGESIZE
        start = -(-offset // page) * page
        end = ((offset + length) // page) * page
        if end > start:
            self.mmap.madvise(mmap.MADV_REMOVE, start, end - start)

    def resident_bytes(self) -> int:
        """Bytes of memory the segment really occupies (sparse segments occupy only touched pages)."""
        return os.stat(SHM_DIR / self.name).st_blocks * 512

    def close(self) -> None:
        """Unmap; owners also unlink. Views still alive keep the mapping, which is harmless."""
        self.region.release()
        self.bytes = None
        try:
            self.mmap.close()
        except BufferError:
            pass  # a zero-copy view still refers to it; the mapping dies with the last view
        if self.owner:
            unlink(self.name)


_created: set[str] = set()
_lock = threading.Lock()


def unlink(name: str) -> None:
    """Remove a segment by name; missing segments are fine."""
    with _lock:
        _created.discard(name)
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass


def unlink_prefix(prefix: str) -> None:
    """Remove every segment under a prefix (an engine's whole footprint)."""
    for path in SHM_DIR.glob(prefix + "-*"):
        unlink(path.name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_dead_engines() -> list[str]:
    """Unlink the segments of this user's engines whose creating process no longer exists."""
    reaped = []
    mine = f"{PREFIX}-{os.getuid()}-"
    for path in SHM_DIR.glob(mine + "*"):
        try:
            pid = int(path.name[len(mine) :].split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            unlink(path.name)
            reaped.append(path.name)
    return reaped


_creator_pid = os.getpid()


@atexit.register
def _unlink_created() -> None:
    if os.getpid() != _creator_pid:
        return  # a forked child must not remove its parent's segments
    for name in list(_created):
        unlink(name)
