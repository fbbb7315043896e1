"""Shared-memory segments with owner-only permissions, unguessable names and guaranteed removal.

Every segment of one engine shares the prefix ``stretch-<uid>-<pid>-<token>``; the pid lets a
later engine recognise and reap the segments of an engine that died without cleaning up.

Memory of a segment is reserved (``posix_fallocate``) before it is used: on a full /dev/shm (a
container's is 64 MB unless given more) touching an unbacked page of a mapping kills the process
with SIGBUS, while a reservation fails with ``SharedMemoryFull``, an error that says what is
needed, what is free and how to give more.
"""

from __future__ import annotations

import atexit
import errno
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


class SharedMemoryFull(MemoryError):
    """/dev/shm has no room for memory that a segment needs (instead of a bus error on first use)."""


def free_bytes() -> int:
    """Bytes that can still be allocated in /dev/shm."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def _full(what: str, needed: int) -> SharedMemoryFull:
    st = os.statvfs(SHM_DIR)
    return SharedMemoryFull(
        f"shared memory is full: {what} needs {_size(needed)} more, but {SHM_DIR} has {_size(free_bytes())} "
        f"free of {_size(st.f_blocks * st.f_frsize)}. Give it more: `docker run --shm-size=1g` (Docker's "
        "default is 64 MB); on Kubernetes, mount an emptyDir with `medium: Memory` (and a sizeLimit) at "
        "/dev/shm; on a host, `mount -o remount,size=1g /dev/shm`. Or make the job need less: smaller "
        "gates (EngineConfig.gate_bytes, sink_gate_bytes), fewer keyed operators or less state."
    )


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
        self._fd: int | None = None  # opened by the first reserve()
        self.bytes = np.frombuffer(self.mmap, dtype=np.uint8)
        self.region = Region(self.mmap)

    @classmethod
    def create(cls, prefix: str, kind: str, size: int, reserve: bool = True) -> Segment:
        """Create a zero-filled, owner-only segment; it is unlinked at exit if not before.

        ``reserve``: allocate all of its memory now (else the caller reserves each part before
        using it, as the sparse state arena does); raises SharedMemoryFull if it does not fit.
        """
        name = f"{prefix}-{kind}-{secrets.token_hex(4)}"
        shm = posix_ipc.SharedMemory("/" + name, flags=posix_ipc.O_CREX, mode=0o600, size=size)
        shm.close_fd()
        _created.add(name)
        try:
            segment = cls(name, size, owner=True)
        except BaseException:
            unlink(name)
            raise
        if reserve:
            try:
                segment.reserve(0, size, f"a new {kind} segment")
            except BaseException:
                segment.close()
                raise
        return segment

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment created by another process of the same engine."""
        size = os.stat(SHM_DIR / name).st_size
        return cls(name, size, owner=False)

    def view(self, dtype, offset: int = 0, count: int = -1) -> np.ndarray:
        """A typed, zero-copy view of part of the segment."""
        return np.frombuffer(self.mmap, dtype=dtype, count=count, offset=offset)

    def reserve(self, offset: int, length: int, what: str = "") -> None:
        """Allocate the memory of [offset, offset+length) now, so that using it cannot fault.

        Raises SharedMemoryFull (naming ``what``) if /dev/shm lacks the room; nothing of the
        range stays allocated then.
        """
        if length <= 0:
            return
        if self._fd is None:
            with _lock:  # threads of one process may reserve at once: open one descriptor
                if self._fd is None:
                    self._fd = os.open(SHM_DIR / self.name, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.posix_fallocate(self._fd, offset, length)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise _full(what or f"shared-memory segment {self.name}", length) from None
            raise

    def release_pages(self, offset: int, length: int) -> None:
        """Return whole pages in [offset, offset+length) to the OS; they read as zeros afterwards."""
        release_pages(self.mmap, offset, length)

    def resident_bytes(self) -> int:
        """Bytes of memory the segment really occupies (sparse segments occupy only touched pages)."""
        return os.stat(SHM_DIR / self.name).st_blocks * 512

    def close(self) -> None:
        """Unmap; owners also unlink. Views still alive keep the mapping, which is harmless."""
        self.region.release()
        self.bytes = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            self.mmap.close()
        except BufferError:
            pass  # a zero-copy view still refers to it; the mapping dies with the last view
        if self.owner:
            unlink(self.name)


def release_pages(mapping: mmap.mmap, offset: int, length: int) -> None:
    """Give the whole pages inside [offset, offset+length) of a shared mapping back to the OS."""
    page = mmap.PAGESIZE
    start = -(-offset // page) * page
    end = ((offset + length) // page) * page
    if end > start:
        mapping.madvise(mmap.MADV_REMOVE, start, end - start)


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


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists (an engine's, or a job's a client holds)."""
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
        if not pid_alive(pid):
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
