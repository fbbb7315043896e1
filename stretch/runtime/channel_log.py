"""A channel's durable log: Arrow IPC batches in segment files, addressed by offset.

One process appends (the job); any process on the machine reads by offset, so Spark executors can
read a range of a channel in parallel and a restarted reader continues where it committed. Offset
``n`` is the channel's ``n``-th batch, for good: offsets survive job restarts because the log
reopens its directory and continues its index.

Layout of the directory: ``seg-<first offset>.arrows`` files, each a run of complete Arrow IPC
streams (one per batch); ``index`` with one (segment, position, length) record of int64 per batch,
written after the batch itself so a reader never sees an entry before its data; ``commits.json``
with each registered reader's committed offset; ``ended`` once the stream is complete;
``run_start`` with the offset of the latest run's first batch (readers by name start there, also
after the run: the log holds earlier runs' batches before it). Whole
segments are deleted when every registered reader has committed past them, or, oldest first, when
the log outgrows ``max_bytes``.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from stretch._shm import Segment
from stretch.runtime.state_dir import make_private_dir, write_private

_ENTRY = 3  # int64 words per index entry: segment first offset, position, length
_IOV_MAX = 1024  # buffers one writev takes (Linux's IOV_MAX)


def _write_all(fd: int, buffers) -> None:
    """Write ``buffers`` in order, in as few calls as the kernel takes them in."""
    views = [memoryview(b).cast("B") for b in buffers]
    i = 0
    while i < len(views):
        done = os.writev(fd, views[i : i + _IOV_MAX])
        while i < len(views) and done >= views[i].nbytes:
            done -= views[i].nbytes
            i += 1
        if done:  # a buffer written in part
            views[i] = views[i][done:]


class ChannelLog:
    def __init__(
        self,
        directory: str | os.PathLike,
        max_bytes: int = 1 << 30,
        segment_bytes: int = 64 << 20,
        create: bool = True,
    ):
        """``create=False`` opens an existing log only (readers), else LookupError."""
        self.dir = Path(directory)
        self._index = self.dir / "index"
        if create:  # the appending side
            make_private_dir(self.dir)
            self._index.touch(mode=0o600, exist_ok=True)
            size = self._index.stat().st_size
            if size % (8 * _ENTRY):  # an entry torn by a crash: the batch never counted
                os.truncate(self._index, size - size % (8 * _ENTRY))
        elif not self._index.exists():
            raise LookupError(f"no channel log at {self.dir}")
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self._segment: tuple[int, object] | None = None  # (first offset, open file) being appended to
        self._reading: tuple[int, object] | None = None  # (first offset, open file) of the segment read last
        self._index_file = None  # the index, open for reading
        self._index_append = None  # the index, open for appending
        self.pinned: int | None = None  # retention keeps every batch from here on (a checkpoint's)

    # ---- offsets ---------------------------------------------------------------------------
    def _entries(self, start: int, end: int) -> np.ndarray:
        """Index entries ``start`` .. ``end`` (fewer if the index is shorter)."""
        if self._index_file is None:  # kept open: a live reader reads one entry a batch
            self._index_file = os.fdopen(os.open(self._index, os.O_RDONLY), "rb", buffering=0)
        raw = os.pread(self._index_file.fileno(), max(0, end - start) * 8 * _ENTRY, start * 8 * _ENTRY)
        n = len(raw) // (8 * _ENTRY)
        return np.frombuffer(raw[: n * 8 * _ENTRY], dtype=np.int64).reshape(n, _ENTRY)

    @property
    def end_offset(self) -> int:
        """The offset the next batch will get (= batches ever appended)."""
        return self._index.stat().st_size // (8 * _ENTRY)

    @property
    def readable_end(self) -> int:
        """Where readers stop: the end, or for a checkpointed job's output, the end of what its
        latest complete checkpoint covers (batches after it may still be rolled back)."""
        end = self.end_offset
        try:
            return min(end, int((self.dir / "committed").read_text()))
        except (FileNotFoundError, ValueError):
            return end

    def set_committed(self, offset: int | None) -> None:
        """Make readers stop at ``offset`` (None: at the end; a log written without checkpoints)."""
        path = self.dir / "committed"
        if offset is None:
            path.unlink(missing_ok=True)
            return
        write_private(path, str(offset))

    @property
    def start_offset(self) -> int:
        """The oldest offset still held."""
        segments = self._segments()
        return segments[0] if segments else self.end_offset

    @property
    def ended(self) -> bool:
        return (self.dir / "ended").exists()

    @property
    def run_start(self) -> int | None:
        """The offset of the latest run's first batch (``begin_run``); None in a log that no run
        recorded it in (one written before runs recorded it)."""
        try:
            return int((self.dir / "run_start").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _segments(self) -> list[int]:
        return sorted(int(p.name[4:-7]) for p in self.dir.glob("seg-*.arrows"))

    def _path(self, first: int) -> Path:
        return self.dir / f"seg-{first:020d}.arrows"

    # ---- writing (the job) -----------------------------------------------------------------
    def append(self, batch: pa.RecordBatch) -> int:
        """Append one batch; returns its offset."""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        return self.append_ipc(sink.getvalue())

    def append_ipc(self, data) -> int:
        """Append one batch given as a complete Arrow IPC stream (as gates hold them)."""
        return self.append_ipcs([data])

    def append_ipcs(self, streams) -> int:
        """Append batches given as complete Arrow IPC streams, the data in one write and their
        index entries in another (a writer of a record at a time leaves many small ones queued);
        returns the first one's offset. The index is written last: a batch is in the log once its
        entry is."""
        offset = self.end_offset
        if self._segment is None or self._segment[1].tell() >= self.segment_bytes:
            if self._segment is not None:
                self._segment[1].close()
            fd = os.open(self._path(offset), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._segment = (offset, os.fdopen(fd, "ab", buffering=0))
            self._retain()  # at each new segment: whole segments are what retention deletes
        first, f = self._segment
        position = f.tell()
        sizes = np.array([memoryview(data).nbytes for data in streams], dtype=np.int64)
        _write_all(f.fileno(), streams)
        entries = np.empty((len(streams), _ENTRY), dtype=np.int64)
        entries[:, 0] = first
        entries[:, 1] = position + np.cumsum(sizes) - sizes
        entries[:, 2] = sizes
        if self._index_append is None:
            self._index_append = os.fdopen(
                os.open(self._index, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab", buffering=0
            )
        _write_all(self._index_append.fileno(), [entries.tobytes()])
        return offset

    def truncate(self, offset: int) -> None:
        """Drop the batches from ``offset`` on (output that a failed run appended but never
        committed); the next append gets ``offset`` again."""
        if offset >= self.end_offset:
            return
        first, position, _ = self._entries(offset, offset + 1)[0].tolist()
        self.close()
        for seg in self._segments():
            if seg > first:
                self._path(seg).unlink(missing_ok=True)
        if position:
            os.truncate(self._path(first), position)
        else:
            self._path(first).unlink(missing_ok=True)
        os.truncate(self._index, offset * 8 * _ENTRY)

    def resume(self) -> None:
        """A new run appends to the log: it is no longer complete."""
        (self.dir / "ended").unlink(missing_ok=True)

    def begin_run(self, offset: int) -> None:
        """A run's output starts at ``offset``: recorded so that its readers find its first result
        after the run too, not the earlier runs' before it."""
        write_private(self.dir / "run_start", str(offset))

    def end(self) -> None:
        """The stream is complete: readers stop at the end offset."""
        (self.dir / "ended").touch(mode=0o600)

    def close(self) -> None:
        if self._segment is not None:
            self._segment[1].close()
            self._segment = None
        if self._reading is not None:
            self._reading[1].close()
            self._reading = None
        if self._index_file is not None:
            self._index_file.close()
            self._index_file = None
        if self._index_append is not None:
            self._index_append.close()
            self._index_append = None

    # ---- reading (anyone) ------------------------------------------------------------------
    def read(self, start: int, end: int | None = None):
        """Batches ``start`` .. ``end`` (exclusive; default: what is there now), in order."""
        end = self.end_offset if end is None else end
        entries = self._entries(start, end)
        if start + len(entries) < end:
            raise LookupError(f"channel log {self.dir}: offset {end} is past the end ({self.end_offset})")
        for first, position, length in entries.tolist():
            yield pa.ipc.open_stream(self._read_at(first, position, length, start)).read_next_batch()

    def _read_at(self, first: int, position: int, length: int, start: int) -> pa.Buffer:
        """``length`` bytes at ``position`` of segment ``first``, read in one call: a live reader's
        segment has grown since its last read, and mapping it again for each batch cost three
        times the copy. A deleted segment means ``start`` is no longer retained."""
        if self._reading is None or self._reading[0] != first:
            if self._reading is not None:
                self._reading[1].close()
                self._reading = None
            try:
                self._reading = (first, os.fdopen(os.open(self._path(first), os.O_RDONLY), "rb", buffering=0))
            except FileNotFoundError:
                raise LookupError(
                    f"channel log {self.dir}: offset {start} is no longer retained "
                    f"(oldest held: {self.start_offset})"
                ) from None
        return pa.py_buffer(os.pread(self._reading[1].fileno(), length, position))

    # ---- retention -------------------------------------------------------------------------
    def commits(self) -> dict[str, int]:
        try:
            return json.loads((self.dir / "commits.json").read_text())
        except FileNotFoundError:
            return {}

    def register(self, reader: str, offset: int | None = None) -> None:
        """A reader whose uncommitted batches are kept (from ``offset``, default the start)."""
        start = self.start_offset if offset is None else offset
        self._update(lambda commits: commits.setdefault(reader, start))

    def commit(self, reader: str, offset: int) -> None:
        """``reader`` is done with every batch below ``offset`` (the job deletes what every
        reader is done with when it next starts a segment; readers never delete)."""
        self._update(lambda commits: commits.__setitem__(reader, max(commits.get(reader, 0), offset)))

    def _update(self, change) -> None:
        """Read, change and replace commits.json under a lock: readers may commit at once."""
        lock = os.open(self.dir / "commits.lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            commits = self.commits()
            change(commits)
            write_private(self.dir / "commits.json", json.dumps(commits))
        finally:
            os.close(lock)

    def _retain(self) -> None:
        """Delete whole segments every reader committed past, then the oldest beyond the bound;
        never one holding a pinned offset or any after it."""
        segments = self._segments()
        current = self._segment[0] if self._segment is not None else None
        commits = self.commits()
        floor = min(commits.values()) if commits else None
        sizes = {s: self._path(s).stat().st_size for s in segments}
        total = sum(sizes.values())
        for i, s in enumerate(segments):
            if s == current or i == len(segments) - 1:  # never the segment being appended to
                break
            following = segments[i + 1] if i + 1 < len(segments) else self.end_offset
            if self.pinned is not None and following > self.pinned:
                break
            if (floor is not None and following <= floor) or total > self.max_bytes:
                self._path(s).unlink(missing_ok=True)
                total -= sizes[s]
            else:
                break


class LogTail:
    """The live end of a channel log, in shared memory: readers on this machine sleep on a futex
    until the job appends, instead of polling the files. It lives as long as the job's run."""

    _END, _STATE, _FUTEX, _SLEEPING, _PID, _POKES = 0, 8, 16, 20, 24, 32
    RUNNING, ENDED, FAILED = 0, 1, 2
    _POLL = 0.05

    def __init__(self, segment):
        self.segment = segment
        self.region = segment.region

    @classmethod
    def create(cls, prefix: str, end: int) -> LogTail:
        tail = cls(Segment.create(prefix, "tail", 64))
        tail.region.store64(cls._END, end)
        tail.region.store64(cls._PID, os.getpid())
        return tail

    @classmethod
    def attach(cls, name: str) -> LogTail:
        return cls(Segment.attach(name))

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def end(self) -> int:
        return self.region.load64(self._END)

    @property
    def state(self) -> int:
        """RUNNING, ENDED or FAILED; FAILED also when the job's process died without saying so."""
        state = self.region.load64(self._STATE)
        if state == self.RUNNING:
            try:
                os.kill(self.region.load64(self._PID), 0)
            except ProcessLookupError:
                return self.FAILED
        return state

    def publish(self, end: int, state: int = RUNNING) -> None:
        r = self.region
        r.store64(self._END, end)
        if state != self.RUNNING:
            r.store64(self._STATE, state)
        r.fetch_add32(self._FUTEX, 1)
        if r.load32(self._SLEEPING):
            r.wake32(self._FUTEX)

    def poke(self) -> None:
        """Wake the readers waiting for more without adding any: their ``wait`` returns False at
        once, so a source idle on its channel looks now, not at its next timeout, for what its job
        asks of it (a checkpoint barrier)."""
        r = self.region
        r.fetch_add32(self._POKES, 1)
        r.fetch_add32(self._FUTEX, 1)
        if r.load32(self._SLEEPING):
            r.wake32(self._FUTEX)

    def wait(self, offset: int, timeout: float | None = None) -> bool:
        """Until the log holds ``offset`` or its run stopped; False on timeout or a ``poke``."""
        r = self.region
        deadline = None if timeout is None else time.monotonic() + timeout
        pokes = r.load32(self._POKES)
        r.fetch_add32(self._SLEEPING, 1)
        try:
            while True:
                seen = r.load32(self._FUTEX)
                if r.load64(self._END) > offset or self.state != self.RUNNING:
                    return True
                if r.load32(self._POKES) != pokes:
                    return False
                left = self._POLL if deadline is None else min(self._POLL, deadline - time.monotonic())
                if left <= 0:
                    return False
                r.wait32(self._FUTEX, seen, left)
        finally:
            r.fetch_add32(self._SLEEPING, 0xFFFFFFFF)

    def close(self) -> None:
        self.segment.close()
