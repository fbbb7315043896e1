"""The two extension points: a Source yields batches into a job, a Sink writes a job's results.

A source's ``create_reader(context)`` runs in a worker process and yields ``pyarrow.RecordBatch``
objects (or lists of Python records). A sink's ``create_writer()`` runs where its ``runs_in`` says:
``"job"`` (a thread of the job's own process, fed in order), ``"instance"`` (chained into each
producing instance, like Flink's chained sinks), or ``"reader"`` (consumed by a reader outside the
job, such as the collect iterator or an output channel). Both travel to workers with cloudpickle.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa


class Source:
    """Base of every source; subclasses implement ``create_reader``.

    A restarted source (a recovery, a restore) must continue where a checkpoint left it. By
    default its position counts the items it yielded, and a restart reads the same items again and
    skips that many; a ``seekable`` source starts at ``context.position`` itself.
    """

    type_info = None
    seekable = False
    bounded = True  # its input ends (BATCH execution mode needs every source bounded)

    def create_reader(self, context=None) -> Iterator:
        """Yield the source's batches; ``context`` reaches the job's channels (see ChannelSource)
        and, for a seekable source, holds the ``position`` to start at."""
        raise NotImplementedError

    def advance(self, position: int, item) -> int:
        """The position after ``item``."""
        return position + 1


class RecordPositionedSource(Source):
    """A seekable source whose position counts records: a restart starts at the record, without
    reading again what it skips and whatever the batch sizes (which may depend on settings)."""

    seekable = True

    def advance(self, position: int, item) -> int:
        return position + (item.num_rows if isinstance(item, pa.RecordBatch) else len(item))

    @staticmethod
    def resume_at(context) -> int:
        """The first record to yield."""
        return getattr(context, "position", 0)


class SinkWriter:
    """Receives a sink's batches in gate order; ``producer`` is the 1-based upstream instance."""

    def open(self, producer: int) -> None:
        """A chained sink's writer learns the instance it runs in (1-based), before any record."""

    def write(self, batch: pa.RecordBatch, producer: int) -> None:
        raise NotImplementedError

    def write_records(self, records, producer: int) -> None:
        """Chained sinks get records as they are in flight; the default takes them as a batch."""
        self.write(records.data_batch(), producer)

    def flush(self, wait: bool = True) -> None:
        """A chained sink's instance finished a gate entry: hand on anything held back; ``wait``
        (it is about to say it reached an epoch's position) until it was taken. Most sinks hold
        nothing."""

    def watermark(self, value: int) -> None:
        """A chained sink's instance passed watermark ``value``: every record before it was
        written. Most sinks ignore it."""

    def close(self) -> None:
        """End of stream: everything was written."""

    def abort(self) -> None:
        """The job failed or was cancelled."""


class Sink:
    """Base of every sink; subclasses implement ``create_writer``."""

    runs_in = "job"

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        raise NotImplementedError
