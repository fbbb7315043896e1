"""A writer's own event time on a cluster: each writer of an event-time channel is an input split
with its own watermark, as each split of a Flink source is.

The writer runs the job's own timestamp assigner on the rows it writes and the job's watermark
rule on their timestamps (runtime.event_time.WatermarkGenerator, the one a source task of one
engine runs), sends its watermark *before* a write with every part of it (a node judges those rows
by it, as one engine judges a batch by the watermark before it), and after the write to every node
of the cluster, so nodes that got none of its rows move on too (cluster.node_watermarks). Closing
the writer tells every node it is gone for good: it no longer holds their watermark back.

A forward's writer (``CarriedClock``) is an input split too: the producing instance it sends for,
whose records keep their timestamps and whose watermark is the instance's own.
"""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa

from stretch.common.batch_decoding import from_batch
from stretch.runtime.batch import TS_COLUMN, resolve_field
from stretch.runtime.event_time import CARRIED, WatermarkGenerator, timestamps_of
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


class CarriedClock:
    """The watermark of a writer that forwards a producing instance's records (cluster
    .forward_sink): the records come with their timestamps (``__ts``), and the watermark is the
    instance's own, as it passes it (``advance``), never moved by the rows: in Flink's model the
    instance is the next operator's input split. A writer named ``<split>#<incarnation>`` takes
    the place of the placeholder ``<split>`` the driver announced for it (cluster.forward_ends)."""

    def __init__(self, writer: str | None = None):
        self.writer = writer or uuid.uuid4().hex
        self.replaces = self.writer.split("#", 1)[0] if "#" in self.writer else None
        self.watermark = MIN_TS

    def timestamps(self, batch: pa.RecordBatch) -> np.ndarray:
        names = batch.schema.names
        if TS_COLUMN not in names:
            return np.empty(0, np.int64)
        return batch.column(names.index(TS_COLUMN)).to_numpy(zero_copy_only=False)

    def before(self) -> dict:
        return {"writer": self.writer, "watermark": self.watermark, "replaces": self.replaces}

    def after(self, ts: np.ndarray, round: str | None = None) -> None:
        """Rows move no carried watermark: nothing to tell the nodes."""
        return None

    def advance(self, watermark: int) -> dict:
        self.watermark = max(self.watermark, int(watermark))
        return {**self.before(), "active": True}

    def closing(self) -> dict:
        return {**self.before(), "active": False, "closed": True}


def clock_for(strategy, operator: str = "", writer: str | None = None):
    """The clock of a writer of a channel read with ``strategy``: carried (a forward's) or the
    writer's own."""
    if strategy.timestamp_assigner == CARRIED:
        return CarriedClock(writer)
    return WriterClock(strategy, operator, writer)
