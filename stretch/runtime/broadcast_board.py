"""Where a broadcast operator's instances hand its broadcast state to one another.

Every instance of a broadcast process operator holds its own copy of the broadcast state: it
applies every broadcast element of the gate, in gate order, so all copies agree at any one gate
position. An instance that starts later than the others cannot rebuild its copy (the gate has
dropped what it read), so it is handed one, through this shared-memory segment (one per such
operator, made by the coordinator):

- slot ``START``: the state the run starts from (a restored checkpoint's), written by the
  coordinator before any instance starts; every instance loads it when it starts.
- one slot per epoch ``e`` (a ring of ``TABLE_RING``, as the ownership tables): the state as of
  epoch e's marker, written there by the instance that owned the broadcast operator's emitting
  key group before the marker, before it announces the epoch; an instance added at that marker
  waits for that announcement and loads it. A rescale waits for the previous one to complete, as
  the ownership tables' ring needs, so a slot is not rewritten while an instance may still read it.

The segment is sparse: a slot's memory is reserved when it is written (SharedMemoryFull names the
operator if /dev/shm has no room).
"""

from __future__ import annotations

import numpy as np

from stretch._shm import Segment
from stretch.runtime.control_block import TABLE_RING

START = 0
SLOT_BYTES = 64 << 20  # the largest broadcast state (pickled) one slot holds
_HEADER = 4096  # per slot: tag (the epoch, or 1 for START), length
_SLOTS = 1 + TABLE_RING


def _slot(epoch: int) -> int:
    return 1 + epoch % TABLE_RING


class BroadcastBoard:
    """One broadcast operator's hand-off slots (the same layout in every process of the job)."""

    def __init__(self, segment: Segment):
        self.segment = segment

    @classmethod
    def create(cls, prefix: str) -> BroadcastBoard:
        return cls(Segment.create(prefix, "broadcast", _HEADER + _SLOTS * SLOT_BYTES, reserve=False))

    @classmethod
    def attach(cls, name: str) -> BroadcastBoard:
        return cls(Segment.attach(name))

    @property
    def name(self) -> str:
        return self.segment.name

    def put_start(self, data: bytes) -> None:
        self._write(START, 1, data)

    def start(self) -> bytes | None:
        return self._read(START, 1)

    def put_epoch(self, epoch: int, data: bytes) -> None:
        self._write(_slot(epoch), epoch, data)

    def at_epoch(self, epoch: int) -> bytes | None:
        return self._read(_slot(epoch), epoch)

    def _write(self, slot: int, tag: int, data: bytes) -> None:
        if len(data) > SLOT_BYTES:
            raise ValueError(
                f"the broadcast state is {len(data)} bytes pickled; a broadcast operator holds at most "
                f"{SLOT_BYTES} bytes"
            )
        r = self.segment.region
        r.store64(slot * 16, 0)  # readers see no tag (tags are >= 1) while the bytes change
        off = _HEADER + slot * SLOT_BYTES
        self.segment.reserve(off, max(len(data), 1), "a broadcast state")
        self.segment.bytes[off : off + len(data)] = np.frombuffer(data, dtype=np.uint8)
        r.store64(slot * 16 + 8, len(data))
        r.store64(slot * 16, tag)  # publish

    def _read(self, slot: int, tag: int) -> bytes | None:
        r = self.segment.region
        if r.load64(slot * 16) != tag:
            return None
        n = r.load64(slot * 16 + 8)
        off = _HEADER + slot * SLOT_BYTES
        return bytes(self.segment.bytes[off : off + n])

    def close(self) -> None:
        self.segment.close()
