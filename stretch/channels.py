"""Write to a running job's input channels and read its output channels, from any process.

>>> writer = open_writer(job, "clicks")          # job: a JobClient, a job id (prefix) or name
>>> writer.write([("alice", 3), ("bob", 1)])       # records, or a pyarrow RecordBatch / Table
>>> writer.end()                                   # end of stream: the job's input is complete
>>> for record in open_reader(job, "totals"):      # in order, until the job's output ends
...     print(record)

Only the request to join goes through the job's control socket. Input data moves through the
channel's shared-memory log directly; output channels are durable logs of Arrow files under the
job's state directory (``stretch.runtime.channel_log``), read by offset, with their live end in
shared memory so that readers wake as soon as the job appends.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from stretch.common.batch_decoding import from_batch
from stretch.common.records import schema_for
from stretch.common.typeinfo import TypeInformation
from stretch.jobs import JobGone, JobNotFound, find
from stretch.runtime.channel_log import ChannelLog, LogTail
from stretch.runtime.channel_writers import ChannelAppender
from stretch.runtime.state_dir import channel_dir


class ChannelWriter(ChannelAppender):
    """Appends records to a job's input channel (blocking while the channel is full)."""

    def __init__(self, job, name: str):
        self.job = find(job)
        reply = self.job.join_channel(name, "writer")
        super().__init__(name, reply, lambda schema: self.job.channel_shape(name, schema))

    def end(self) -> None:
        """Mark the end of the channel's stream: the job finishes once it has processed it."""
        self.check_open()
        try:
            self.job.end_channel(self.name)
        except (JobGone, RuntimeError):
            self.check_open()  # the job ended meanwhile: say how
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.end()


def locate_output(job, name: str, kept: str | None = None) -> dict:
    """Where output channel ``name`` of ``job`` is: the running job's answer (``log``, the live
    ``tail``, ``run_start``, ``type``), else the log the job of that name kept after its run
    (else ``kept``: the log directory of the run whose job id ``job`` is), whose ``run_start`` is
    the first result of the last run that wrote it (None in a log that never recorded one)."""
    try:
        return find(job).join_channel(name, "reader")
    except (JobNotFound, JobGone):
        if not isinstance(job, str):
            raise
    path = Path(kept) if kept is not None else channel_dir(job, name)
    if not (path / "index").exists():
        raise LookupError(f"no running stretch job {job!r} and no channel {name!r} kept for it") from None
    with OutputLog(str(path)) as log:
        run_start = log.run_start
    return {"log": str(path), "tail": None, "run_start": run_start, "type": None}


class OutputLog:
    """An output channel's durable log, read by offset (what Spark's source reads): offsets
    ``start`` .. ``end`` are readable; a reader registered by name keeps what it has not committed
    from being trimmed."""

    def __init__(self, directory: str):
        self.directory = directory
        self._log = ChannelLog(directory, create=False)

    @property
    def start(self) -> int:
        return self._log.start_offset

    @property
    def end(self) -> int:
        return self._log.readable_end

    @property
    def run_start(self) -> int | None:
        """The first offset of the latest run that wrote the log (None: not recorded)."""
        return self._log.run_start

    def read(self, start: int, end: int) -> Iterator[pa.RecordBatch]:
        """Batches ``start`` .. ``end`` (exclusive), in order."""
        return self._log.read(start, end)

    def register(self, reader: str, offset: int) -> None:
        self._log.register(reader, offset)

    def commit(self, reader: str, offset: int) -> None:
        self._log.commit(reader, offset)

    def close(self) -> None:
        self._log.close()

    def __enter__(self) -> OutputLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def output_schema(job, name: str, where: dict | None = None) -> pa.Schema:
    """An output channel's schema: the type the job declares for it, else its first batch's
    (``where``: the channel's ``locate_output`` answer, if known)."""
    where = where if where is not None else locate_output(job, name)
    if where.get("type"):
        return schema_for(TypeInformation.from_json(where["type"])).remove_metadata()
    with OutputLog(where["log"]) as log:
        if log.end > log.start:
            (first,) = log.read(log.start, log.start + 1)
            return first.schema.remove_metadata()
    raise ValueError(
        f"channel {name!r} of job {job!r} has no declared type and no data yet: declare the output type "
        "of the stream that feeds it"
    )


def run_start(where: dict, start: int) -> int:
    """Where a reader of the run's results starts: the run's first result (``where``: the
    channel's ``locate_output`` answer), or, where retention dropped it or the log never recorded
    a run, the oldest batch the log holds (``start``)."""
    first = where.get("run_start")
    return start if first is None else max(first, start)


def input_schema(job, name: str) -> pa.Schema | None:
    """An input channel's schema, where the job declares its record type (None: untyped)."""
    reply = find(job).join_channel(name, "writer")
    return (
        schema_for(TypeInformation.from_json(reply["type"])).remove_metadata() if reply.get("type") else None
    )


class ChannelReader:
    """Reads a job's output channel in order, by offset: from the first result of the job's
    current run (after the run, of its last run), or from ``from_offset`` (an offset of the
    channel's log, which outlives runs: earlier runs' results are before the run's first).

    While the job runs, a reader sleeps on the log's live tail in shared memory; after the run,
    ``job`` may be the job's name and the reader reads what the log retained.
    """

    def __init__(self, job, name: str, from_offset: int | None = None, where: dict | None = None):
        self.name = name
        reply = where if where is not None else locate_output(job, name)  # where: a locate_output answer
        self.log = ChannelLog(reply["log"], create=False)
        self._tail = None
        if reply["tail"]:
            try:
                self._tail = LogTail.attach(reply["tail"])
            except FileNotFoundError:  # the run ended just now: its log is complete
                pass
        self.offset = run_start(reply, self.log.start_offset) if from_offset is None else from_offset

    def read_batch(self, timeout: float | None = None) -> pa.RecordBatch | None:
        """The next batch, None at the end of the stream; TimeoutError if none came in time."""
        while True:
            tail = self._tail
            # while the run goes on, its live tail says how far readers may read (the log's files
            # say it too, at the cost of a stat and a read of each batch)
            live = tail is not None and tail.state == LogTail.RUNNING
            if self.offset < (tail.end if live else self.log.readable_end):
                (batch,) = self.log.read(self.offset, self.offset + 1)
                self.offset += 1
                return batch
            if tail is None or tail.state == LogTail.ENDED:
                if tail is None and not self.log.ended:
                    raise RuntimeError(f"the job producing channel {self.name!r} stopped before its end")
                if self.offset >= self.log.readable_end:
                    return None
                continue
            if tail.state == LogTail.FAILED:
                if self.offset >= self.log.readable_end:
                    raise RuntimeError(f"the job producing channel {self.name!r} stopped before its end")
                continue
            if not tail.wait(self.offset, timeout):
                raise TimeoutError(f"nothing arrived on channel {self.name!r} within {timeout} s")

    def close(self) -> None:
        """Let go of the log and its live tail (iterating to the end closes the reader too)."""
        self.log.close()
        if self._tail is not None:
            self._tail.close()
            self._tail = None

    def __iter__(self):
        try:
            while (batch := self.read_batch()) is not None:
                yield from from_batch(batch)
        finally:
            self.close()


def open_writer(job, name: str) -> ChannelWriter:
    """A writer into input channel ``name`` of ``job`` (a JobClient, a job id or unique prefix, or a
    running job's name); as a context manager it ends the channel's stream when the block ends
    without an error."""
    return ChannelWriter(job, name)


def open_reader(job, name: str, from_offset: int | None = None) -> ChannelReader:
    """A reader of output channel ``name`` of ``job``: iterate it for the records, in order, until
    the stream ends; it starts at the current run's first result (after the run, by the job's
    name: its last run's), or at ``from_offset``, any offset the log retains (earlier runs' too)."""
    return ChannelReader(job, name, from_offset)
