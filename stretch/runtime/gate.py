"""The gate: an operator's shared input queue.

A bounded log of Arrow record batches in one shared-memory segment. Any number of producers
append (serialised by a robust inter-process mutex); every reader (operator instance) reads every
entry in the same order with its own cursor, zero-copy; space is reclaimed behind the slowest
active cursor, and a full gate blocks producers (backpressure) instead of dropping or growing.
Control records (end of stream, watermarks, checkpoints, transaction marks) travel in the same
log, so they are ordered with the data.

Besides its sequence number, every entry has a *position*: the gate counts one position per row of
a data entry (one for an entry without rows), so a position names a point between two rows of the
log. Rescales, live updates and barriers take effect at a position (``runtime.frontier``), which
may fall inside a batch.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import pyarrow as pa

from stretch._shm import Segment, free_bytes


class Kind(IntEnum):
    """What an entry of the gate holds."""

    DATA = 1
    END_OF_STREAM = 2
    WATERMARK = 4
    CHECKPOINT = 5
    MARK = 6  # a position marker; with arg1 > 0: the end of input transaction arg1 (arg0 marks expected)
    IDLE = 7  # a producer (arg0) has no records for now: it does not hold the watermark back
    LEAVE = 8  # a producer (arg0) was scaled away: it never holds the watermark back again


class GateClosed(Exception):
    """The gate was closed (its job ended) while a caller waited on it or appended to it; the
    message says why, where the job said so."""


@dataclass(frozen=True)
class Entry:
    """One entry read from a gate; `batch` is a zero-copy view valid until the cursor moves past."""

    seq: int
    kind: Kind
    batch: pa.RecordBatch | None
    arg0: int
    arg1: int
    input_index: int
    start: int  # the entry's first position (see the module's doc)

    @property
    def end(self) -> int:
        """The position after the entry: one per row, one for an entry without rows."""
        return self.start + max(self.batch.num_rows if self.batch is not None else 0, 1)


_MAGIC = 0x53545245_47415445  # "STREGATE"
# Header words (byte offsets). Futex words are 32-bit; everything else 64-bit.
_H_MAGIC, _H_SLOTS, _H_DATA, _H_READERS = 0, 8, 16, 24
_H_LOCK = 64
_H_TAIL, _H_DATA_TAIL, _H_CLOSED, _H_POSITION = 128, 136, 144, 152
_H_END = 160  # 1 + the position of the end-of-stream entry, 0 before one is appended
_H_READ_NS = 168  # the readers' recent work per row, ns x 1024 (0: not known yet)
_H_READ_MEASURED = 176  # 1 once that work was measured (before: a guess, or nothing)
_H_READERS_CLAIM = 184  # whether its readers claim pieces: 0 not known yet, 1 they do, 2 they do not
_H_PUB_FUTEX, _H_READERS_SLEEPING = 192, 196
_H_SPACE_FUTEX, _H_PRODUCERS_SLEEPING = 256, 260
_H_REASON_LEN, _H_REASON = 272, 280  # why the gate was closed: UTF-8 text, up to the reader cursors
_REASON_BYTES = 224
_H_READERS_OFF = 512
_READER_STRIDE = 64  # one cache line per cursor: no false sharing between instances
_SLOT_WORDS = 9  # seq, kind, pos, len, arg0, arg1, input_index, rows, start (position)
_ALIGN = 64
_INACTIVE = -1
_POLL = 0.05  # futex waits re-check at this period; wakes are normally immediate
SMALL_ROWS = 256
"""A data entry of fewer rows is small: its reader's fixed costs a call outweigh its rows'."""
JOINED_ROWS = 4096
"""The most rows of small entries ``read_joined`` reads as one, unless told fewer."""
IPC_OPTIONS = pa.ipc.IpcWriteOptions()
"""Arrow's defaults, made once: without options each stream writer reads two environment
variables and builds its own (a few microseconds an append)."""
DEFAULT_DATA_BYTES = 32 << 20
MIN_DEFAULT_DATA_BYTES = 1 << 20


_local_locks: dict[str, threading.Lock] = {}
_local_locks_guard = threading.Lock()


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def default_data_bytes() -> int:
    """A gate's data size when none is given: 32 MiB, or an eighth of what /dev/shm has free if
    that is less (at least 1 MiB), so that a small /dev/shm (a container's 64 MB) keeps room for
    the job's other gates and its state. A gate's memory is allocated in full when it is made."""
    eighth = free_bytes() // 8 // (64 << 10) * (64 << 10)
    return max(MIN_DEFAULT_DATA_BYTES, min(DEFAULT_DATA_BYTES, eighth))


class Gate:
    """Producer and reader side of one gate segment (the same class in every process)."""

    def __init__(self, segment: Segment):
        self.segment = segment
        r = self.region = segment.region
        if r.load64(_H_MAGIC) != _MAGIC:
            raise ValueError(f"segment {segment.name} is not a gate")
        self.slot_capacity = r.load64(_H_SLOTS)
        self.data_capacity = r.load64(_H_DATA)
        self.max_readers = r.load64(_H_READERS)
        self._slots_off = _H_READERS_OFF + self.max_readers * _READER_STRIDE
        self._data_off = _align(self._slots_off + self.slot_capacity * _SLOT_WORDS * 8)
        self._slots = segment.view(np.int64, self._slots_off, self.slot_capacity * _SLOT_WORDS).reshape(
            self.slot_capacity, _SLOT_WORDS
        )
        self._cursors = segment.view(np.int64, _H_READERS_OFF, self.max_readers * _READER_STRIDE // 8)[
            :: _READER_STRIDE // 8
        ]
        self._data = segment.bytes[self._data_off : self._data_off + self.data_capacity]
        self._data_buffer = pa.py_buffer(self._data)
        self.max_entry_bytes = self.data_capacity // 4
        with _local_locks_guard:
            self._local_lock = _local_locks.setdefault(segment.name, threading.Lock())

    @property
    def name(self) -> str:
        return self.segment.name

    @classmethod
    def create(
        cls,
        prefix: str,
        kind: str = "gate",
        slot_capacity: int = 64,
        data_bytes: int | None = None,
        max_readers: int = 64,
    ) -> Gate:
        """Lay out a new gate (``data_bytes`` default: ``default_data_bytes()``); every reader
        cursor starts inactive. Raises SharedMemoryFull if /dev/shm has no room for it."""
        if data_bytes is None:
            data_bytes = default_data_bytes()
        slots_off = _H_READERS_OFF + max_readers * _READER_STRIDE
        data_off = _align(slots_off + slot_capacity * _SLOT_WORDS * 8)
        seg = Segment.create(prefix, kind, data_off + data_bytes)
        r = seg.region
        r.store64(_H_SLOTS, slot_capacity)
        r.store64(_H_DATA, data_bytes)
        r.store64(_H_READERS, max_readers)
        for i in range(max_readers):
            r.store64(_H_READERS_OFF + i * _READER_STRIDE, _INACTIVE)
        r.store64(_H_MAGIC, _MAGIC)
        return cls(seg)

    @classmethod
    def attach(cls, name: str) -> Gate:
        return cls(Segment.attach(name))

    # ---- state -------------------------------------------------------------------------
    @property
    def tail(self) -> int:
        """Sequence number the next appended entry will get (entries below it are readable)."""
        return self.region.load64(_H_TAIL)

    @property
    def position(self) -> int:
        """The position the next appended entry will start at (see the module's doc)."""
        return self.region.load64(_H_POSITION)

    @property
    def end_position(self) -> int | None:
        """The position of the end-of-stream entry, once one is appended: the last position any
        reader reads."""
        end = self.region.load64(_H_END)
        return end - 1 if end else None

    def start_of(self, seq: int) -> int:
        """The first position of entry ``seq``, or ``position`` if ``seq`` is the tail.

        The entry must be readable and not reclaimed (at or after some active cursor)."""
        if seq >= self.tail:
            return self.position
        s = self._slots[seq % self.slot_capacity]
        if s[0] != seq:
            raise RuntimeError(f"gate {self.name}: entry {seq} was overwritten (found {s[0]})")
        return int(s[8])

    def seq_at(self, position: int) -> int:
        """The entry that holds ``position`` (the tail if it is the next entry's): where a reader
        that starts there opens its cursor. Entries from there to the tail must not be reclaimed.

        A binary search over the entries still in the ring (their ends grow with their sequence
        numbers): an epoch placed at the readers' frontier under a backlog looks for a position
        hundreds of entries behind the tail."""
        tail = self.tail
        lo, hi = max(0, tail - self.slot_capacity), tail
        while lo < hi:
            mid = (lo + hi) // 2
            s = self._slots[mid % self.slot_capacity]
            if s[0] == mid and s[8] + max(int(s[7]), 1) > position:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def rows_from(self, position: int) -> int:
        """The records queued from ``position`` to the tail: the rows of the data entries there,
        not the positions (a watermark, a marker, a barrier takes one and holds no record). The
        entries from ``position`` on must not be reclaimed, as for ``seq_at``; read from their
        slots, without decoding a batch."""
        seqs = np.arange(self.seq_at(position), self.tail)
        slots = self._slots[seqs % self.slot_capacity]  # one pass: a rescale places its epoch meanwhile
        if (slots[:, 0] != seqs).any():
            raise RuntimeError(f"gate {self.name}: entries from position {position} were overwritten")
        rows, starts = slots[:, 7], slots[:, 8]
        return int(np.where(rows > 0, rows - np.maximum(position - starts, 0), 0).sum())

    @property
    def closed(self) -> bool:
        return self.region.load64(_H_CLOSED) != 0

    @property
    def closed_reason(self) -> str:
        """Why the gate was closed, as its closer said (empty if it did not)."""
        n = self.region.load64(_H_REASON_LEN)
        return bytes(self.segment.bytes[_H_REASON : _H_REASON + n]).decode(errors="replace")

    def close(self, reason: str = "") -> None:
        """Mark closed (saying why, for producers in other processes) and wake every sleeper, so
        nobody waits on a dead job and nobody appends to one."""
        if not self.closed:
            text = reason.encode()[:_REASON_BYTES]
            self.segment.bytes[_H_REASON : _H_REASON + len(text)] = np.frombuffer(text, np.uint8)
            self.region.store64(_H_REASON_LEN, len(text))
        self.region.store64(_H_CLOSED, 1)
        self.region.fetch_add32(_H_PUB_FUTEX, 1)
        self.region.fetch_add32(_H_SPACE_FUTEX, 1)
        self.region.wake32(_H_PUB_FUTEX)
        self.region.wake32(_H_SPACE_FUTEX)

    def active_cursors(self) -> np.ndarray:
        c = self._cursors
        return c[c >= 0]

    @property
    def logger_slot(self) -> int:
        """The reader slot of the job's input logger, if it logs this gate: the last one."""
        return self.max_readers - 1

    @property
    def pin_slot(self) -> int:
        """The reader slot that holds entries while the coordinator copies them (the one before the
        logger's)."""
        return self.max_readers - 2

    @property
    def read_ns_per_row(self) -> float:
        """How long its readers recently worked per row (0: not known yet): producers size the
        blocks they lay batches out in by it (``key_group_runs.block_rows``)."""
        return self.region.load64(_H_READ_NS) / 1024

    @property
    def read_rate_measured(self) -> bool:
        """Whether ``read_ns_per_row`` was measured, not guessed (before its readers had read)."""
        return bool(self.region.load64(_H_READ_MEASURED))

    @property
    def readers_claim(self) -> bool | None:
        """Whether the operator reading the gate claims pieces of its work from inside a call
        (``runtime.frontier``), so that what one entry holds bounds what an epoch waits for; None
        before one of its instances said."""
        word = self.region.load64(_H_READERS_CLAIM)
        return None if word == 0 else word == 1

    def note_readers_claim(self, claim: bool) -> None:
        self.region.store64(_H_READERS_CLAIM, 1 if claim else 2)

    def note_read_rate(self, ns_per_row: float, measured: bool = True) -> None:
        self.region.store64(_H_READ_NS, max(1, int(ns_per_row * 1024)))
        self.region.store64(_H_READ_MEASURED, int(measured))

    def instance_readers(self) -> int:
        """How many operator instances read the gate: active cursors, not the logger's or a pin."""
        return int(np.count_nonzero(self._cursors[: self.pin_slot] >= 0))

    def depth(self) -> int:
        """Entries appended but not yet read by the slowest active reader. The tail is read
        before the cursors: read after, an append that the slowest reader's step let in would be
        counted against the cursor from before that step (one more than the gate holds)."""
        tail = self.tail
        active = self.active_cursors()
        return max(0, int(tail - active.min())) if active.size else 0

    # ---- readers (registered by the coordinator) ---------------------------------------
    def open_reader(self, reader: int, at: int | None = None) -> int:
        """Activate a cursor at `at` (default: the current tail); returns the position."""
        if not 0 <= reader < self.max_readers:
            raise ValueError(f"reader slot {reader} outside 0..{self.max_readers - 1}")
        pos = self.tail if at is None else at
        self.region.store64(_H_READERS_OFF + reader * _READER_STRIDE, pos)
        return pos

    def close_reader(self, reader: int) -> None:
        """Deactivate a cursor so it no longer holds back reclamation."""
        self.region.store64(_H_READERS_OFF + reader * _READER_STRIDE, _INACTIVE)
        self._wake_producers()

    def cursor(self, reader: int) -> int:
        return self.region.load64(_H_READERS_OFF + reader * _READER_STRIDE)

    # ---- producer side -----------------------------------------------------------------
    def append_batch(
        self,
        batch: pa.RecordBatch,
        producer: int = 0,
        input_index: int = 0,
        timeout: float | None = None,
        txn: int = 0,
    ) -> int:
        """Append a batch (split if larger than a quarter of the gate); returns its last seq.

        ``producer`` (1-based instance index, 0 unknown) travels with the entry as ``arg0``, and
        ``txn`` (the input transaction whose processing made the batch, 0 for none) as ``arg1``.
        """
        seq = -1
        for piece, size in self._pieces(batch):
            seq = self._append(Kind.DATA, size, piece, producer, txn, input_index, timeout)
        return seq

    def _pieces(self, batch: pa.RecordBatch) -> list[tuple[pa.RecordBatch, int]]:
        """Slices of the batch that each fit one entry; raises before anything is appended."""
        size = _ipc_size(batch)
        if size <= self.max_entry_bytes:
            return [(batch, size)]
        if batch.num_rows <= 1:
            raise ValueError(
                f"a single record of {size} bytes does not fit a gate of {self.data_capacity} bytes "
                f"(limit {self.max_entry_bytes}); raise the gate size or split the record"
            )
        half = batch.num_rows // 2
        return self._pieces(batch.slice(0, half)) + self._pieces(batch.slice(half))

    def append_control(self, kind: Kind, arg0: int = 0, arg1: int = 0, input_index: int = 0) -> int:
        """Append a control record; it is read in order with the data around it."""
        return self._append(kind, 0, None, arg0, arg1, input_index, None)

    def _append(self, kind, size, batch, arg0, arg1, input_index, timeout) -> int:
        r = self.region
        if r.load64(_H_CLOSED):
            raise GateClosed(self.closed_reason or f"gate {self.name} is closed")
        local = self._local_lock  # threads of one process: the shared mutex is per process
        if not local.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError("gate producer lock not acquired in time")
        if not r.lock(_H_LOCK, timeout):
            local.release()
            raise TimeoutError("gate producer lock not acquired in time")
        try:
            seq = r.load64(_H_TAIL)
            pos = r.load64(_H_DATA_TAIL)
            if size and pos % self.data_capacity + size > self.data_capacity:
                pos = (pos // self.data_capacity + 1) * self.data_capacity  # skip the wrap tail
            self._wait_for_space(seq, pos, size, timeout)
            slot = self._slots[seq % self.slot_capacity]
            if size:
                start = pos % self.data_capacity
                sink = pa.FixedSizeBufferWriter(pa.py_buffer(self._data[start : start + size]))
                with pa.ipc.new_stream(sink, batch.schema, options=IPC_OPTIONS) as writer:
                    writer.write_batch(batch)
                rows = batch.num_rows
            else:
                rows = 0
            start = r.load64(_H_POSITION)
            slot[:] = (seq, int(kind), pos, size, arg0, arg1, input_index, rows, start)
            r.store64(_H_POSITION, start + max(rows, 1))
            if kind is Kind.END_OF_STREAM and not r.load64(_H_END):
                r.store64(_H_END, start + 1)
            r.store64(_H_DATA_TAIL, _align(pos + size))
            r.store64(_H_TAIL, seq + 1)  # publish (seq_cst store after the slot and data writes)
        finally:
            r.unlock(_H_LOCK)
            local.release()
        r.fetch_add32(_H_PUB_FUTEX, 1)
        if r.load32(_H_READERS_SLEEPING):
            r.wake32(_H_PUB_FUTEX)
        return seq

    def _has_space(self, seq: int, pos: int, size: int) -> bool:
        active = self.active_cursors()
        if not active.size:
            return True  # nobody reads: entries are dropped, as by a closed subscription
        low = int(active.min())
        if seq - low >= self.slot_capacity:
            return False
        if low >= seq:
            return True
        low_pos = int(self._slots[low % self.slot_capacity, 2])
        return pos + size - low_pos <= self.data_capacity

    def _wait_for_space(self, seq: int, pos: int, size: int, timeout: float | None) -> None:
        r = self.region
        if self._has_space(seq, pos, size):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        r.fetch_add32(_H_PRODUCERS_SLEEPING, 1)
        try:
            while True:
                seen = r.load32(_H_SPACE_FUTEX)
                if self._has_space(seq, pos, size):
                    return
                if self.closed:
                    raise GateClosed(self.closed_reason or f"gate {self.name} is closed")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"gate {self.name} stayed full for {timeout} s")
                r.wait32(_H_SPACE_FUTEX, seen, _POLL)
        finally:
            r.fetch_add32(_H_PRODUCERS_SLEEPING, 0xFFFFFFFF)

    # ---- reader side -------------------------------------------------------------------
    def wake_count(self) -> int:
        """A count of publications and nudges, for ``wait(since=...)``."""
        return self.region.load32(_H_PUB_FUTEX)

    def nudge(self) -> None:
        """Wake every reader waiting for an entry, without appending one: something they check
        besides the gate changed (an epoch placed where they wait, see runtime.frontier)."""
        r = self.region
        r.fetch_add32(_H_PUB_FUTEX, 1)
        r.wake32(_H_PUB_FUTEX)

    def wait(self, seq: int, timeout: float | None = None, since: int | None = None) -> bool:
        """Block until entry `seq` is readable; False on timeout, or as soon as the gate was nudged
        after ``since`` (a ``wake_count()`` the caller read before its own checks). Raises GateClosed."""
        r = self.region
        if seq < r.load64(_H_TAIL):
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        r.fetch_add32(_H_READERS_SLEEPING, 1)
        try:
            while True:
                seen = r.load32(_H_PUB_FUTEX)
                if seq < r.load64(_H_TAIL):
                    return True
                if r.load64(_H_CLOSED):
                    raise GateClosed(self.closed_reason or f"gate {self.name} is closed")
                if since is not None and seen != since:
                    return False
                left = _POLL if deadline is None else min(_POLL, deadline - time.monotonic())
                if left <= 0:
                    return False
                r.wait32(_H_PUB_FUTEX, seen, left)
        finally:
            r.fetch_add32(_H_READERS_SLEEPING, 0xFFFFFFFF)

    def read(self, seq: int, copy: bool = False) -> Entry:
        """The entry at `seq` (must be readable and not yet passed by this reader's cursor).

        Its batch is a view of the gate, valid until the cursor moves past it, unless ``copy``.
        """
        s = self._slots[seq % self.slot_capacity]
        if s[0] != seq:
            raise RuntimeError(f"gate {self.name}: entry {seq} was overwritten (found {s[0]})")
        kind = Kind(int(s[1]))
        batch = None
        if kind is Kind.DATA:
            data = self._payload(s)
            if copy:
                data = pa.py_buffer(data.to_pybytes())
            batch = pa.ipc.open_stream(data).read_next_batch()
        return Entry(seq, kind, batch, int(s[4]), int(s[5]), int(s[6]), int(s[8]))

    def peek(self, seq: int) -> tuple[Kind, int, int]:
        """An entry's kind, ``arg0`` (a data entry's producer) and rows, without decoding its batch:
        what a reader that copies the entry's bytes (``payload``) needs to know of it."""
        s = self._slots[seq % self.slot_capacity]
        if s[0] != seq:
            raise RuntimeError(f"gate {self.name}: entry {seq} was overwritten (found {s[0]})")
        return Kind(int(s[1])), int(s[4]), int(s[7])

    def read_joined(self, seq: int, most: int = JOINED_ROWS) -> tuple[Entry, int]:
        """Entry ``seq``, joined, if it is a small data entry, by the small data entries already
        queued right behind it of the same transaction and schema (never waiting for one): one
        entry over their positions, its batch a copy; and the last one's seq. A writer that writes
        a record at a time makes an entry each, and each entry costs its reader a call (hundreds of
        microseconds through a keyed operator): under load, the entries waiting are read as one,
        up to ``most`` rows."""
        entry = self.read(seq)
        batch, end = entry.batch, entry.end
        if entry.kind is not Kind.DATA or not 0 < batch.num_rows < SMALL_ROWS:
            return entry, seq
        parts, rows, tail = [batch], batch.num_rows, self.tail
        while seq + 1 < tail and rows < most:
            slot = self._slots[(seq + 1) % self.slot_capacity]  # judged before decoding: the entry
            # that ends a join is read again as the next one
            if (
                slot[1] != Kind.DATA
                or slot[5] != entry.arg1
                or slot[8] != end
                or not 0 < slot[7] < SMALL_ROWS
            ):
                break
            following = self.read(seq + 1)
            part = following.batch
            if not part.schema.equals(batch.schema, check_metadata=True):
                break
            parts.append(part)
            rows += part.num_rows
            end, seq = following.end, seq + 1
        if len(parts) == 1:
            return entry, seq
        batch = pa.concat_batches(parts)
        return Entry(entry.seq, Kind.DATA, batch, entry.arg0, entry.arg1, entry.input_index, entry.start), seq

    def payload(self, seq: int) -> pa.Buffer:
        """A data entry's Arrow IPC stream bytes, as appended (a view, like ``read``'s batch)."""
        return self._payload(self._slots[seq % self.slot_capacity])

    def _payload(self, slot) -> pa.Buffer:
        return self._data_buffer.slice(int(slot[2]) % self.data_capacity, int(slot[3]))

    def advance(self, reader: int, seq: int) -> None:
        """Move a reader's cursor to `seq` (everything below is consumed) and wake producers."""
        self.region.store64(_H_READERS_OFF + reader * _READER_STRIDE, seq)
        self._wake_producers()

    def _wake_producers(self) -> None:
        r = self.region
        if r.load32(_H_PRODUCERS_SLEEPING):
            r.fetch_add32(_H_SPACE_FUTEX, 1)
            r.wake32(_H_SPACE_FUTEX)


def _ipc_size(batch: pa.RecordBatch) -> int:
    """The bytes of the batch as a one-batch Arrow IPC stream (schema message, batch message, end
    marker), computed: writing it to a mock stream to count them took ~40 us an append, whatever
    the batch's size. Dictionary columns add dictionary messages: those are counted by writing."""
    schema = batch.schema
    if not _has_dictionary(schema.types):
        return schema.serialize().size + pa.ipc.get_record_batch_size(batch) + _END_MARKER
    sink = pa.MockOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(batch)
    return sink.size()


_END_MARKER = 8  # an IPC stream's end: continuation token and a zero length


def _has_dictionary(types) -> bool:
    return any(
        pa.types.is_dictionary(t)
        or (t.num_fields and _has_dictionary(t.field(i).type for i in range(t.num_fields)))
        for t in types
    )
