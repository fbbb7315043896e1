"""Spark streaming sink into a job on a stretch cluster (``.option("cluster", address)``).

Executors stage their partitions as Arrow IPC files in the cluster's staging directory
(``write``); the driver's ``commit(messages, batch_id)`` reads them all and sends the micro-batch
through one ``ClusterWriter.write(..., query, batch_id)``: every row goes to the node owning its
key group, and each key group takes a (query, batch) at most once, wherever it is by then, so a
retried task (its first files are never committed) and a replayed micro-batch are exact.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamArrowWriter

from stretch.cluster import ClusterWriter
from stretch.spark.options import job_and_channel
from stretch.spark.sink import StagedFiles


class ClusterStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, options, schema):
        self.address = options.get("cluster")
        self.job, self.channel = job_and_channel(options)
        self.query = options.get("query") or options.get("checkpointLocation")
        if not self.query:
            raise ValueError(
                'writing to stretch exactly once needs a stable query identity: set .option("checkpointLocation", ...) '
                'or .option("query", ...)'
            )
        ClusterWriter(self.address, self.job, self.channel).close()  # unknown job or channel: an error now
        self.staging = str(Path(self.address) / "staging")

    # ---- executors ---------------------------------------------------------------------------
    def write(self, iterator) -> StagedFiles:
        path = os.path.join(self.staging, f"{uuid.uuid4().hex}.arrows")
        out = None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            for batch in iterator:
                if batch.num_rows:
                    if out is None:
                        out = pa.ipc.new_stream(f, batch.schema)
                    out.write_batch(batch)
            if out is not None:
                out.close()
        return StagedFiles([path])

    # ---- driver ------------------------------------------------------------------------------
    def commit(self, messages, batchId: int) -> None:  # noqa: N803 (Spark calls it so)
        files = [f for m in messages if m is not None for f in m.files]
        batches = []
        for path in files:
            if os.path.getsize(path):
                with pa.memory_map(path) as source:
                    batches += list(pa.ipc.open_stream(source))
        try:
            if batches:
                with ClusterWriter(self.address, self.job, self.channel) as writer:
                    writer.write(pa.Table.from_batches(batches), query=self.query, batch=batchId)
        except Exception as e:
            raise RuntimeError(f"stretch cluster job {self.job!r} refused micro-batch {batchId}: {e}") from e
        finally:
            self.abort(messages, batchId)

    def abort(self, messages, batchId: int) -> None:  # noqa: N803
        for m in messages:
            for f in m.files if m is not None else ():
                Path(f).unlink(missing_ok=True)
