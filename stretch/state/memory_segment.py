"""A segment in this process's own memory, for an arena no other process attaches.

Reading a checkpoint restores its key groups into an arena to read them as a running job's
state is read; that arena lives in anonymous memory rather than /dev/shm, so a reader (a Spark
executor, say) needs no room there, and one that dies leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

from stretch._native import Region
from stretch._shm import release_pages


class MemorySegment:
    """What ``Arena`` uses of a ``stretch._shm.Segment``, over anonymous memory (zero-filled; a
    page takes memory once touched)."""

    owner = True

    def __init__(self, size: int):
        self.name = "in-memory"
        self.size = size
        self.mmap = mmap.mmap(-1, size)
        self.bytes = np.frombuffer(self.mmap, dtype=np.uint8)
        self.region = Region(self.mmap)

    def reserve(self, offset: int, length: int, what: str = "") -> None:
        """Nothing to do: anonymous pages are allocated as they are touched."""

    def release_pages(self, offset: int, length: int) -> None:
        release_pages(self.mmap, offset, length)

    def resident_bytes(self) -> int:
        return 0  # not measured: only the size in error messages uses it

    def close(self) -> None:
        self.region.release()
        self.bytes = None
        with contextlib.suppress(BufferError):  # a view still alive keeps the mapping until it dies
            self.mmap.close()
