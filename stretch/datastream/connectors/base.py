"""The two extension points: a Source yields batches into a job, a Sink writes a job's results.

A source's ``create_reader()`` runs in a worker process and yields ``pyarrow.RecordBatch`` objects
(or lists of Python records); a sink's ``create_writer()`` runs in the job's own process and gets
batches in order. Both objects travel to the worker with cloudpickle.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa


class Source:
    """Base of every source; subclasses implement ``create_reader``."""

    type_info = None

    def create_reader(self) -> Iterator:
        raise NotImplementedError


class SinkWriter:
    """Receives a sink's batches in gate order; ``producer`` is the 1-based upstream instance."""

    def write(self, batch: pa.RecordBatch, producer: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """End of stream: everything was written."""

    def abort(self) -> None:
        """The job failed or was cancelled."""


class Sink:
    """Base of every sink; subclasses implement ``create_writer``."""

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        raise NotImplementedError
