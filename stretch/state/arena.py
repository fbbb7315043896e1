"""The state arena: one keyed operator's whole state store in one sparse shared-memory segment.

The segment is reserved large (sparse: only touched pages use memory), so it never has to be
remapped, and every process addresses the same structures by byte offset. Space is handed out by
an atomic bump pointer, and its memory allocated in /dev/shm before it is written (a full /dev/shm
then fails that allocation with a clear error, not the first write with a bus error); space given
up by a structure that grew is returned to the OS page by page (``MADV_REMOVE``), so memory in use
tracks the live state.

Layout: a header page, a registry of declared states (JSON, written under a robust mutex), then a
directory with one fixed-size header per key group (see ``_table_kernels``), then the data.
"""

from __future__ import annotations

import json
import mmap
import os

import numpy as np

from stretch._shm import Segment, SharedMemoryFull
from stretch.state import _table_kernels as K
from stretch.state.memory_segment import MemorySegment

_MAGIC = 0x53545245_4152454E  # "STREAREN"
_A_MAGIC, _A_RESERVE, _A_BUMP, _A_KEY_MODE, _A_MAXP, _A_REGISTRY_LEN = 0, 8, 16, 24, 32, 40
_A_REGISTRY_VERSION = 48  # bumped by every change of the registry (a rename keeps its length)
_A_LOCK = 64
_REGISTRY_OFF, _REGISTRY_SIZE = 4096, 61440
DIR_OFF = 65536
PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
DEFAULT_RESERVE = int(os.environ.get("STRETCH_ARENA_RESERVE", str(1 << 40)))


def _page_round(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class Arena:
    """Typed views, allocation and the state registry of one operator's state segment."""

    def __init__(self, segment: Segment):
        self.segment = segment
        r = self.region = segment.region
        if r.load64(_A_MAGIC) != _MAGIC:
            raise ValueError(f"segment {segment.name} is not a state arena")
        self.max_parallelism = r.load64(_A_MAXP)
        mm = segment.mmap
        self.a8 = np.frombuffer(mm, dtype=np.uint8)
        self.a64 = self.a8.view(np.int64)
        self.views = {
            np.dtype(np.int64): (self.a64, 3),
            np.dtype(np.float64): (self.a8.view(np.float64), 3),
            np.dtype(np.int32): (self.a8.view(np.int32), 2),
            np.dtype(np.float32): (self.a8.view(np.float32), 2),
            np.dtype(np.int16): (self.a8.view(np.int16), 1),
            np.dtype(np.int8): (self.a8.view(np.int8), 0),
            np.dtype(np.uint8): (self.a8, 0),
        }
        self.a32 = self.views[np.dtype(np.int32)][0]
        self.dir_w = DIR_OFF // 8
        self.headers = self.a64[self.dir_w : self.dir_w + self.max_parallelism * K.KG_WORDS].reshape(
            self.max_parallelism, K.KG_WORDS
        )
        self._registry_cache: list[dict] = []
        self._registry_version = -1

    @property
    def name(self) -> str:
        return self.segment.name

    @classmethod
    def create(cls, prefix: str, max_parallelism: int, reserve: int = DEFAULT_RESERVE) -> Arena:
        seg = Segment.create(prefix, "state", size=reserve, reserve=False)  # sparse: reserved as used
        return cls._initialise(seg, max_parallelism, reserve)

    @classmethod
    def in_memory(cls, max_parallelism: int, reserve: int) -> Arena:
        """An arena in this process's memory, not /dev/shm, that no other process attaches (a
        checkpoint's key groups restored to be read), with ``reserve`` bytes for structures."""
        size = cls.directory_bytes(max_parallelism) + _page_round(reserve)
        return cls._initialise(MemorySegment(size), max_parallelism, size)

    @staticmethod
    def directory_bytes(max_parallelism: int) -> int:
        """What an arena takes before its first structure: header page, registry, directory."""
        return _page_round(DIR_OFF + max_parallelism * K.KG_WORDS * 8)

    @classmethod
    def _initialise(cls, seg, max_parallelism: int, reserve: int) -> Arena:
        first = cls.directory_bytes(max_parallelism)
        try:
            seg.reserve(0, first, "a state arena's key-group directory")
        except BaseException:
            seg.close()
            raise
        r = seg.region
        r.store64(_A_RESERVE, reserve)
        r.store64(_A_MAXP, max_parallelism)
        r.store64(_A_BUMP, first)
        r.store64(_A_MAGIC, _MAGIC)
        return cls(seg)

    @classmethod
    def attach(cls, name: str) -> Arena:
        return cls(Segment.attach(name))

    # ---- allocation --------------------------------------------------------------------
    def alloc(self, nbytes: int, reserve: int | None = None) -> int:
        """Hand out zero-filled, page-aligned space; returns its byte offset.

        Its first ``reserve`` bytes (all if None) are reserved in /dev/shm now; a structure that
        fills up row by row reserves the rest as it takes it (``reserve``), so that memory held
        follows the rows in use, not the capacity handed out.
        """
        size = _page_round(max(nbytes, 1))
        off = self.region.fetch_add64(_A_BUMP, size)
        if off + size > self.segment.size:
            raise MemoryError(
                f"state arena {self.name} is exhausted ({self.segment.size} bytes reserved); "
                "set STRETCH_ARENA_RESERVE higher"
            )
        self.reserve(off, size if reserve is None else min(reserve, size))
        return off

    def reserve(self, off: int, nbytes: int) -> None:
        """Reserve the memory of [off, off + nbytes) before it is first written (a full /dev/shm
        is then this error, not a bus error at the write); reserving twice is harmless."""
        if nbytes <= 0:
            return
        try:
            self.segment.reserve(off, nbytes)
        except SharedMemoryFull:  # say again, with what the state holds (not measured each time)
            held = self.resident_bytes() / (1 << 20)
            self.segment.reserve(off, nbytes, f"the keyed state (arena {self.name}, holding {held:.1f} MiB)")

    def free(self, off: int, nbytes: int) -> None:
        """Give the pages of an abandoned structure back to the OS."""
        if off and nbytes:
            self.segment.release_pages(off, _page_round(nbytes))

    def populate(self, ranges) -> bool:
        """Map the pages of these (offset, length) ranges into this process's page tables now.

        A fresh worker otherwise takes a page fault on its first touch of each state page; spare
        workers do this while idle, so an instance added by a rescale starts at full speed. Only
        live structures are given: populating a hole of the sparse segment would allocate it.
        Returns False where the kernel lacks MADV_POPULATE_READ (before Linux 5.14).
        """
        mm = self.segment.mmap
        try:
            for off, length in ranges:
                start = off // PAGE * PAGE
                if length > 0:
                    mm.madvise(_MADV_POPULATE_READ, start, _page_round(off + length) - start)
        except OSError:
            return False
        return True

    def resident_bytes(self) -> int:
        return self.segment.resident_bytes()

    # ---- key mode ----------------------------------------------------------------------
    def key_mode(self) -> int:
        return self.region.load64(_A_KEY_MODE)

    def claim_key_mode(self, mode: int) -> int:
        """Set the operator's key mode if unset; returns the mode in force."""
        self.region.cas64(_A_KEY_MODE, 0, mode)
        return self.region.load64(_A_KEY_MODE)

    # ---- state registry ----------------------------------------------------------------
    def registry(self) -> list[dict]:
        """Declared states in id order: dicts with name, kind, storage and type description."""
        if self.region.load64(_A_REGISTRY_VERSION) != self._registry_version:
            self.region.lock(_A_LOCK)  # a declaration rewrites the bytes in place: read it whole
            try:
                self._load_registry()
            finally:
                self.region.unlock(_A_LOCK)
        return self._registry_cache

    def _load_registry(self) -> list[dict]:
        version = self.region.load64(_A_REGISTRY_VERSION)
        if version != self._registry_version:
            n = self.region.load64(_A_REGISTRY_LEN)
            self._registry_cache = json.loads(
                bytes(self.a8[_REGISTRY_OFF : _REGISTRY_OFF + n]) if n else b"[]"
            )
            self._registry_version = version
        return self._registry_cache

    def _store_registry(self, states: list[dict]) -> None:
        raw = json.dumps(states).encode()
        if len(raw) > _REGISTRY_SIZE:
            raise ValueError("too many or too large state declarations for one operator")
        self.a8[_REGISTRY_OFF : _REGISTRY_OFF + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        self.region.store64(_A_REGISTRY_LEN, len(raw))
        self.region.store64(_A_REGISTRY_VERSION, self.region.load64(_A_REGISTRY_VERSION) + 1)

    def rename_state(self, old: str, new: str) -> bool:
        """Give state ``old`` the name ``new``, its data untouched (a built-in whose state another
        built-in takes over); False if there is no ``old`` or already a ``new``."""
        self.region.lock(_A_LOCK)
        try:
            states = self._load_registry()
            names = [e["name"] for e in states]
            if old not in names or new in names:
                return False
            renamed = [{**e, "name": new} if e["name"] == old else e for e in states]
            self._store_registry(renamed)
            return True
        finally:
            self.region.unlock(_A_LOCK)

    def register_state(self, entry: dict) -> int:
        """Id of the state named entry['name'], declaring it if new; a conflicting redeclaration fails."""
        self.region.lock(_A_LOCK)
        try:
            states = self._load_registry()
            for sid, existing in enumerate(states):
                if existing["name"] == entry["name"]:
                    if existing != entry:
                        raise ValueError(
                            f"state {entry['name']!r} was declared as {existing} and is now declared "
                            f"as {entry}; one name must keep one kind and type"
                        )
                    return sid
            if len(states) >= K.MAX_STATES:
                raise ValueError(f"an operator can declare at most {K.MAX_STATES} states")
            self._store_registry([*states, entry])
            return len(states)
        finally:
            self.region.unlock(_A_LOCK)

    def state_base_w(self, sid: int) -> int:
        """Word offset of state `sid`'s column words in key group 0's header (add kg * KG_WORDS)."""
        return self.dir_w + K.STATE_BASE + sid * K.STATE_WORDS

    def close(self) -> None:
        self.views.clear()
        self.a8 = self.a64 = self.a32 = self.headers = None
        self.segment.close()
