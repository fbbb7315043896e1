"""A broadcast operator's broadcast state: one copy in shared memory, versioned by gate position.

The broadcast state changes only at broadcast elements, which lie in the operator's one gate. The
first instance to reach a run of broadcast elements applies ``process_broadcast_element`` to them
(once, not once per instance) and publishes the result here, tagged with the run's gate position;
every other instance reaching that run reads the published version instead. So every element sees
exactly the broadcast elements before it in the gate, whichever instance processes it and at any
parallelism, and an instance added by a rescale reads the version in force at its epoch's position:
nothing is handed over.

Slots: ``START`` holds the state a run starts from (a restored checkpoint's, written by the
coordinator before any instance starts); a ring of version slots holds the latest versions. A slot
is reused only for a version no reader can still need: every version at or after the slowest
reader's position, and the last one before it, are kept. A writer with no free slot waits for the
slowest reader. The segment is sparse: a slot's memory is reserved when it is written.
"""

from __future__ import annotations

import time

import numpy as np

from stretch._shm import Segment

SLOT_BYTES = 64 << 20  # the largest broadcast state (pickled) one slot holds
VERSIONS = 64  # version slots
_START = 0
_LOCK = 8  # the writers' lock (offset of its word)
_WORDS = 16  # header offset of slot s's (tag, length): _WORDS * 8 + s * 16
_HEADER = 4096
_RUN_BITS = 16  # a version's tag: (gate position + 1) << _RUN_BITS | run of the entry


def tag_of(seq: int, run: int) -> int:
    """The tag of the broadcast run ``run`` of gate entry ``seq`` (ordered as the gate is)."""
    return ((seq + 1) << _RUN_BITS) | run


class BroadcastBoard:
    """One broadcast operator's versions (the same layout in every process of the job)."""

    def __init__(self, segment: Segment):
        self.segment = segment
        self.region = segment.region

    @classmethod
    def create(cls, prefix: str) -> BroadcastBoard:
        size = _HEADER + (1 + VERSIONS) * SLOT_BYTES
        return cls(Segment.create(prefix, "broadcast", size, reserve=False))

    @classmethod
    def attach(cls, name: str) -> BroadcastBoard:
        return cls(Segment.attach(name))

    @property
    def name(self) -> str:
        return self.segment.name

    # ---- the start ---------------------------------------------------------------------------
    def put_start(self, data: bytes) -> None:
        self._write(_START, 1, data)

    # ---- versions ----------------------------------------------------------------------------
    def version(self, tag: int) -> bytes | None:
        """The version published for the broadcast run ``tag``, if one is."""
        for s in range(1, 1 + VERSIONS):
            if self._tag(s) == tag:
                data = self._read(s)
                if self._tag(s) == tag:  # not reused while it was read
                    return data
        return None

    def before(self, seq: int) -> bytes | None:
        """The state in force at gate position ``seq``: the latest version before it, or the start."""
        limit = tag_of(seq, 0)
        while True:
            best, slot = 0, None
            for s in range(1, 1 + VERSIONS):
                t = self._tag(s)
                if best < t < limit:
                    best, slot = t, s
            if slot is None:
                return self._read(_START)
            data = self._read(slot)
            if self._tag(slot) == best:  # not reused while it was read
                return data

    def publish(self, tag: int, data: bytes, slowest: int, waiting) -> None:
        """Publish version ``tag``; ``slowest`` is the slowest reader's gate position (no version
        it may still need is overwritten). ``waiting()`` is called while no slot is free."""
        while True:
            keep_from = tag_of(slowest, 0)
            tags = [self._tag(s) for s in range(1, 1 + VERSIONS)]
            older = [t for t in tags if 0 < t < keep_from]
            last_older = max(older, default=0)
            free = [i for i, t in enumerate(tags) if t == 0 or (t < keep_from and t != last_older)]
            if free:
                self._write(1 + free[0], tag, data)
                return
            waiting()
            time.sleep(0.001)

    def lock(self) -> None:
        self.region.lock(_LOCK)

    def unlock(self) -> None:
        self.region.unlock(_LOCK)

    # ---- slots -------------------------------------------------------------------------------
    def _tag(self, slot: int) -> int:
        return self.region.load64(_WORDS * 8 + slot * 16)

    def _write(self, slot: int, tag: int, data: bytes) -> None:
        if len(data) > SLOT_BYTES:
            raise ValueError(
                f"the broadcast state is {len(data)} bytes pickled; a broadcast operator holds at most "
                f"{SLOT_BYTES} bytes"
            )
        r, word = self.region, _WORDS * 8 + slot * 16
        r.store64(word, 0)  # readers see no tag while the bytes change
        off = _HEADER + slot * SLOT_BYTES
        self.segment.reserve(off, max(len(data), 1), "a broadcast state")
        self.segment.bytes[off : off + len(data)] = np.frombuffer(data, dtype=np.uint8)
        r.store64(word + 8, len(data))
        r.store64(word, tag)  # publish

    def _read(self, slot: int) -> bytes | None:
        word = _WORDS * 8 + slot * 16
        if not self.region.load64(word):
            return None
        n = self.region.load64(word + 8)
        off = _HEADER + slot * SLOT_BYTES
        return bytes(self.segment.bytes[off : off + n])

    def close(self) -> None:
        self.segment.close()
