"""Spark streaming sink into a job on a stretch cluster (``.option("cluster", address)``).

With the cluster's directory (Spark on the cluster's host), executors stage their partitions as
Arrow IPC files in the cluster's staging directory (``write``); the driver's ``commit(messages,
batch_id)`` reads them all and sends the micro-batch through one ``ClusterWriter.write(..., query,
batch_id)``: every row goes to the node owning its key group, and each key group takes a (query,
batch) at most once, wherever it is by then, so a retried task (its first files are never
committed) and a replayed micro-batch are exact.

With the cluster's URL (``cluster.url``, executors on any host; the secret from
``.option("secret", ...)`` or ``$STRETCH_CLUSTER_SECRET`` where the executor runs), each executor
sends its partition straight to the owning nodes, nothing staged: one ``ClusterWriter.write``
per partition, as (query ``<query>#<partition>``, the micro-batch's id). Each key group takes a
partition's rows of a micro-batch at most once, so a retried task and a replayed micro-batch
change nothing that was taken, provided a replay splits the micro-batch into the same
partitions (as Spark's sources do for a given offset range).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage

from stretch.cluster import ClusterWriter
from stretch.cluster.addresses import is_url
from stretch.spark.options import cluster_credentials, job_and_channel
from stretch.spark.sink import StagedFiles

BATCH_ID = "streaming.sql.batchId"  # the local property Spark gives a micro-batch's tasks


@dataclass
class SentRows(WriterCommitMessage):
    rows: int = 0


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
        self.secret, self.tls = cluster_credentials(options)
        self.remote = is_url(self.address)
        # an unknown job or channel (or a wrong secret): an error now
        self._writer().close()
        self.staging = None if self.remote else str(Path(self.address) / "staging")

    def _writer(self) -> ClusterWriter:
        return ClusterWriter(self.address, self.job, self.channel, secret=self.secret, tls=self.tls)

    # ---- executors ---------------------------------------------------------------------------
    def write(self, iterator):
        if self.remote:
            return self._send(iterator)
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

    def _send(self, iterator) -> SentRows:
        """The partition straight to its nodes, as (query#partition, micro-batch)."""
        context = TaskContext.get()
        batch_id = context.getLocalProperty(BATCH_ID) if context is not None else None
        if batch_id is None:
            raise RuntimeError(f"no micro-batch id in this task (Spark's local property {BATCH_ID})")
        batches = [b for b in iterator if b.num_rows]
        if batches:
            with self._writer() as writer:
                query = f"{self.query}#{context.partitionId()}"
                writer.write(pa.Table.from_batches(batches), query=query, batch=int(batch_id))
        return SentRows(sum(b.num_rows for b in batches))

    # ---- driver ------------------------------------------------------------------------------
    def commit(self, messages, batchId: int) -> None:  # noqa: N803 (Spark calls it so)
        if self.remote:  # the executors sent every row to its node already
            return
        files = [f for m in messages if m is not None for f in m.files]
        batches = []
        for path in files:
            if os.path.getsize(path):
                with pa.memory_map(path) as source:
                    batches += list(pa.ipc.open_stream(source))
        try:
            if batches:
                with self._writer() as writer:
                    writer.write(pa.Table.from_batches(batches), query=self.query, batch=batchId)
        except Exception as e:
            raise RuntimeError(f"stretch cluster job {self.job!r} refused micro-batch {batchId}: {e}") from e
        finally:
            self.abort(messages, batchId)

    def abort(self, messages, batchId: int) -> None:  # noqa: N803
        for m in messages:
            for f in getattr(m, "files", ()):
                Path(f).unlink(missing_ok=True)
