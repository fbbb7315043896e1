"""The durable log of an input channel, kept by the job from the channel's gate.

A logger thread of the job reads the gate that a channel's writers append to (with a reader slot
of its own, so the gate keeps nothing it has not logged: a slow disk slows the writers, never
loses data) and copies each data entry's Arrow IPC bytes, as they are, to the channel's log. The
log's order is the gate's order, the order the job processes the channel in; its offsets
continue across runs of the job.

A write returns once its batch is in the gate, milliseconds before the logger copies it. So that
a ``kill -9`` of the job's process in between loses nothing, each logger records its gate and
log in this user's runtime directory (where the next job to start finds it, whatever its state
directory) and commits how far it got in a small segment (``LogProgress``); the next job to
start on the machine copies what a dead run's gate still holds past that point into the log
(``salvage_dead_runs``) before it reaps the dead run's segments.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from pathlib import Path

from stretch import _shm as shm
from stretch._shm import Segment
from stretch.runtime.channel_log import ChannelLog, LogTail
from stretch.runtime.control_socket import runtime_dir
from stretch.runtime.gate import SMALL_ROWS, Gate, GateClosed, Kind
from stretch.runtime.state_dir import write_private

LINGER_S = 0.001
"""How long the logger waits for more when few small entries are queued: a writer of a record at a
time queues an entry each, and a copy of each on its own costs the writer's process (where the job
runs) its writes and its GIL for every record. A checkpointed job reads the log that much later."""
LINGER_ENTRIES = 64


def records_dir() -> Path:
    """Where running loggers record their gate, progress and log (one file each)."""
    path = runtime_dir() / "unlogged"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


class LogProgress:
    """How far a logger got, committed as one pair: the log held ``log_end`` batches when every
    gate entry below ``next_seq`` was in it. Two slots and a selector, so that a process killed
    between two stores leaves the previous pair whole."""

    _SELECT, _PAIRS = 0, 8  # pair i at _PAIRS + 16 * i: (log_end, next_seq)

    def __init__(self, segment: Segment):
        self.segment = segment
        self.region = segment.region

    @classmethod
    def create(cls, prefix: str, log_end: int, next_seq: int) -> LogProgress:
        progress = cls(Segment.create(prefix, "logged", 64))
        progress.commit(log_end, next_seq)
        return progress

    @classmethod
    def attach(cls, name: str) -> LogProgress:
        return cls(Segment.attach(name))

    def commit(self, log_end: int, next_seq: int) -> None:
        r = self.region
        slot = 1 - r.load64(self._SELECT)
        r.store64(self._PAIRS + 16 * slot, log_end)
        r.store64(self._PAIRS + 16 * slot + 8, next_seq)
        r.store64(self._SELECT, slot)

    def committed(self) -> tuple[int, int]:
        r = self.region
        slot = r.load64(self._SELECT)
        return r.load64(self._PAIRS + 16 * slot), r.load64(self._PAIRS + 16 * slot + 8)


class InputLogger(threading.Thread):
    def __init__(
        self,
        name: str,
        gate: Gate,
        reader: int,
        log: ChannelLog,
        progress: LogProgress,
        producer: int | None = None,
        tail: LogTail | None = None,
    ):
        """``producer``: log only this producer's entries (a gate that other stages also feed).
        ``tail``: where the log's end is published (a checkpointed job's source reads the log)."""
        super().__init__(name=f"stretch-log-{name}", daemon=True)
        self.gate, self.reader, self.log, self.producer, self.tail = gate, reader, log, producer, tail
        self.progress = progress
        gate.open_reader(reader, 0)
        self.record = records_dir() / f"{progress.segment.name}.json"
        record = {"gate": gate.name, "producer": producer, "progress": progress.segment.name}
        write_private(self.record, json.dumps({**record, "log": str(log.dir), "pid": os.getpid()}))

    def run(self) -> None:
        """Copy what is queued, all of it at once: a writer of a record at a time queues an entry
        a record, and each append to the log costs its writes however small the batch."""
        gate, seq, end = self.gate, self.gate.cursor(self.reader), self.log.end_offset
        try:
            while True:
                if not gate.wait(seq, timeout=0.2):
                    continue
                if gate.tail - seq < LINGER_ENTRIES and 0 < gate.peek(seq)[2] < SMALL_ROWS:
                    time.sleep(LINGER_S)  # more come meanwhile, copied in the same writes
                streams, ended, tail = [], False, gate.tail
                while seq < tail and not ended:
                    kind, producer, _ = gate.peek(seq)
                    if kind is Kind.DATA and self.producer in (None, producer):
                        streams.append(gate.payload(seq))
                    ended = kind is Kind.END_OF_STREAM
                    seq += 1
                if streams:
                    end = self.log.append_ipcs(streams) + len(streams)
                    if self.tail is not None:
                        self.tail.publish(end)
                self.progress.commit(end, seq)  # before the cursor lets the gate reuse the entries
                gate.advance(self.reader, seq)
                if ended:
                    self.log.end()
                    if self.tail is not None:
                        self.tail.publish(self.log.end_offset, LogTail.ENDED)
                    return
        except GateClosed:
            pass
        finally:
            self.log.close()
            with contextlib.suppress(FileNotFoundError):
                self.record.unlink()


def salvage_dead_runs() -> int:
    """Copy into their logs the batches that dead runs' channel gates still hold unlogged (see
    the module's doc); returns how many were copied."""
    return sum(salvage(path) for path in records_dir().glob("*.json"))


def salvage(record_path: Path) -> int:
    """One logger's record: what its dead run's gate holds past its committed progress."""
    try:
        fd = os.open(record_path, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # two jobs starting at once salvage a log once
        if not record_path.exists():  # the other one did
            return 0
        record = json.loads(os.read(fd, 1 << 16))
        if shm.pid_alive(record["pid"]):
            return 0
        try:
            gate, progress = Gate.attach(record["gate"]), LogProgress.attach(record["progress"])
        except FileNotFoundError:  # reaped already, or its run ended and removed them
            record_path.unlink()
            return 0
        try:
            copied = _copy_unlogged(gate, progress, record["producer"], Path(record["log"]))
        finally:
            gate.segment.close()
            progress.segment.close()
        record_path.unlink()
        return copied
    finally:
        os.close(fd)


def _copy_unlogged(gate: Gate, progress: LogProgress, producer: int | None, log_dir: Path) -> int:
    # No retention bound here: it could delete batches a checkpoint still needs (the job pins them).
    log = ChannelLog(log_dir, max_bytes=1 << 62)
    try:
        log_end, start = progress.committed()
        already = log.end_offset - log_end  # killed between an append and its commit: its batches
        copied = 0
        for seq in range(start, gate.tail):
            entry = gate.read(seq)
            if entry.kind is Kind.DATA and producer in (None, entry.arg0):
                if already:
                    already -= 1
                    continue
                log.append_ipc(gate.payload(seq))
                copied += 1
            elif entry.kind is Kind.END_OF_STREAM:
                log.end()
                break
        return copied
    finally:
        log.close()
