"""Rows to a node on the same host through shared memory instead of the Flight stream.

A writer stages a node's part as an Arrow IPC stream in a shared-memory segment it keeps for that
node (grown when a part does not fit, reused otherwise) and sends only the segment's name in a
Flight action; the node maps it, reads the batch without a copy, takes it as it takes a Flight
put (ownership, (query, batch) marks, journal), and answers after the rows are in its job's gate,
so the segment is free again when the call returns.

Whether a node sees the writer's segments is found by trying: a node on another host, in another
mount namespace (a private ``/dev/shm``) or of another user answers ``NO_SHARED_MEMORY``, and the
writer sends that node's parts over Flight from then on.
"""

from __future__ import annotations

import contextlib
import os

import pyarrow as pa

from stretch._shm import Segment, SharedMemoryFull, engine_prefix

NO_SHM = "NO_SHARED_MEMORY"
_SLACK = 64 << 10  # room for the stream's schema and message headers


class SharedBatches:
    """The writer's side: a segment per node that sees this host's shared memory."""

    def __init__(self):
        self._prefix = engine_prefix()  # its pid lets a later engine reap them if this process dies
        self._segments: dict[str, Segment] = {}
        self._refused: set[str] = set()

    def usable(self, node: str) -> bool:
        return node not in self._refused

    def stage(self, node: str, batch: pa.RecordBatch) -> dict | None:
        """Write ``batch`` into ``node``'s segment; returns what the node needs to read it, or None
        when /dev/shm has no room for it (the part goes over Flight)."""
        sink = pa.MockOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as w:
            w.write_batch(batch)
        size = sink.size()
        segment = self._segments.get(node)
        if segment is None or segment.size < size:
            if segment is not None:
                segment.close()
                del self._segments[node]
            try:
                segment = Segment.create(self._prefix, "rows", max(size + _SLACK, 1 << 20))
            except SharedMemoryFull:
                return None
            self._segments[node] = segment
        out = pa.FixedSizeBufferWriter(pa.py_buffer(segment.mmap))
        with pa.ipc.new_stream(out, batch.schema) as w:
            w.write_batch(batch)
        return {"segment": segment.name, "size": size}

    def refused(self, node: str) -> None:
        """The node cannot map this writer's segments: its parts go over Flight from now on."""
        self._refused.add(node)
        segment = self._segments.pop(node, None)
        if segment is not None:
            segment.close()

    def close(self) -> None:
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()


class NotVisible(LookupError):
    """The writer's segment is not in this process's /dev/shm (another host or namespace)."""


@contextlib.contextmanager
def staged_batches(name: str, size: int):
    """The node's side: the batches a writer staged, read in place; unmapped on exit (the caller
    must have copied what it keeps: the job's gate and journal copy what they take)."""
    if not name.startswith("stretch-") or "/" in name:
        raise NotVisible(f"{NO_SHM}: {name!r} is not a stretch segment")
    try:
        segment = Segment.attach(name)
    except (FileNotFoundError, PermissionError, OSError) as e:
        raise NotVisible(f"{NO_SHM}: segment {name} is not visible here (pid {os.getpid()}): {e}") from None
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(segment.mmap)[:size])
        yield list(reader.read_all().to_batches())
    finally:
        segment.close()
