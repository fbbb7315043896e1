"""Spark streaming sink into a job's input channel, exactly once per micro-batch.

Executors stage their partitions as Arrow IPC files in the job's staging directory (``write``);
the driver's ``commit(messages, batch_id)`` asks the job to publish them all, in order, as one
transaction named (query, batch id); ``abort`` discards them. The job publishes a transaction at
most once (``stretch.runtime.publisher``), so a failed task that Spark retries (its first
attempt's files are never committed) and a micro-batch that a restarted query replays from its
checkpoint do not duplicate rows.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage

from stretch.jobs import find
from stretch.spark.options import job_and_channel
from stretch.spark.schemas import channel_schema, check_fits


@dataclass
class StagedFiles(WriterCommitMessage):
    files: list[str] = field(default_factory=list)


class StretchStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, options, schema):
        self.job, self.channel = job_and_channel(options)
        # a replayed batch is recognised by (query, batch id): the query must have a stable name
        self.query = options.get("query") or options.get("checkpointLocation")
        if not self.query:
            raise ValueError(
                'writing to stretch exactly once needs a stable query identity: set .option("checkpointLocation", ...) '
                'or .option("query", ...)'
            )
        reply = find(self.job).join_channel(self.channel, "writer")  # unknown job or channel: an error now
        self.schema = channel_schema(self.job, self.channel)
        check_fits(schema, self.schema, f"channel {self.channel!r} of job {self.job!r}")
        self.staging = reply["staging"]

    # ---- executors ---------------------------------------------------------------------------
    def write(self, iterator) -> StagedFiles:
        path = os.path.join(self.staging, f"{uuid.uuid4().hex}.arrows")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f, pa.ipc.new_stream(f, self.schema) as out:
            for batch in iterator:
                if batch.num_rows:
                    columns = [c.cast(t.type) for c, t in zip(batch.columns, self.schema)]
                    out.write_batch(pa.RecordBatch.from_arrays(columns, schema=self.schema))
        return StagedFiles([path])

    # ---- driver ------------------------------------------------------------------------------
    def commit(self, messages, batchId: int) -> None:  # noqa: N803 (Spark calls it so)
        files = [f for m in messages if m is not None for f in m.files]
        try:
            find(self.job).publish(self.channel, self.query, batchId, files)
        except (LookupError, RuntimeError, ValueError, ConnectionError) as e:
            raise RuntimeError(f"stretch job {self.job!r} refused micro-batch {batchId}: {e}") from e

    def abort(self, messages, batchId: int) -> None:  # noqa: N803
        files = [f for m in messages if m is not None for f in m.files]
        find(self.job).discard(self.channel, files)
