"""A writer's own event time on a cluster: each writer of an event-time channel is an input split
with its own watermark, as each split of a Flink source is.

The writer runs the job's own timestamp assigner on the rows it writes and the job's watermark
rule on their timestamps (runtime.event_time.WatermarkGenerator, the one a source task of one
engine runs), sends its watermark *before* a write with every part of it (a node judges those rows
by it, as one engine judges a batch by the watermark before it), and after the write to every node
of the cluster, so nodes that got none of its rows move on too (cluster.node_watermarks). Closing
the writer tells every node it is gone for good: it no longer holds their watermark back.
"""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa

from stretch.common.batch_decoding import from_batch
from stretch.runtime.batch import resolve_field
from stretch.runtime.event_time import WatermarkGenerator, timestamps_of
from stretch.runtime.outputs import NO_KEY, describe_failure

MIN_TS = -(2**63)


class TimestampAssignerFailed(ValueError):
    """The job's timestamp assigner failed on a record: nothing of the write was sent."""


class WriterClock:
    """The watermark of one writer (``writer``: its id, fresh per writer unless given) of a
    channel read with ``strategy``."""

    def __init__(self, strategy, operator: str = "", writer: str | None = None):
        self.strategy = strategy
        self.operator = operator
        self.writer = writer or uuid.uuid4().hex
        self.generator = WatermarkGenerator(strategy)

    @property
    def watermark(self) -> int:
        return self.generator.emitted

    def timestamps(self, batch: pa.RecordBatch) -> np.ndarray:
        """Each row's event timestamp, by the job's own assigner."""
        a = self.strategy.timestamp_assigner
        if isinstance(a, str):
            return timestamps_of(batch.column(resolve_field(batch.schema, a)))
        records = from_batch(batch)
        try:
            return np.array([a.extract_timestamp(r, MIN_TS) for r in records], dtype=np.int64)
        except Exception:
            for r in records:
                try:
                    a.extract_timestamp(r, MIN_TS)
                except Exception as e:
                    raise TimestampAssignerFailed(
                        describe_failure(self.operator, r, NO_KEY, e, "timestamp assigner")
                    ) from e
            raise

    def before(self) -> dict:
        """What goes with every part of a write: the watermark before its rows."""
        return {"writer": self.writer, "watermark": self.watermark}

    def after(self, ts: np.ndarray, round: str | None = None) -> dict:
        """The write's rows were taken: the progress every node hears."""
        self.generator.on_timestamps(ts, round)
        return {"writer": self.writer, "watermark": self.watermark, "active": True}

    def closing(self) -> dict:
        return {"writer": self.writer, "watermark": self.watermark, "active": False, "closed": True}
