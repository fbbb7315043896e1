"""The one-query stage with a job on a stretch cluster (``stage(df, client, ...)`` where ``client``
comes from ``env.execute_async(name, cluster=...)``).

Each Spark task's rows form one transaction, named (query id, micro-batch id, partition) as on
one machine, and go through the cluster's one row path (``ClusterWriter.transact``): every row to
the node owning its key group, through shared memory to a node on the task's host and over Arrow
Flight to any other; each node takes its part of the transaction at most once (per key group, so
wherever the key group is now), and answers with the results that the transaction's rows caused
there once they are complete (and covered by a checkpoint, for a checkpointed job). The task
returns the results of every part, each once: a task that Spark retries, or a micro-batch it
replays after a restart of the query, gets the first attempt's results again, also after key
groups moved between nodes, a node joined, left or died (cluster.stage_parts).

Executors reach the cluster by its directory when the cluster listens on loopback (they run on
its host), else by its URL with its secret (and TLS), which the task carries.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pyarrow as pa
from pyarrow import flight
from pyspark import TaskContext

from stretch.cluster import ClusterJobClient, ClusterWriter, NodeUnreachable
from stretch.cluster.addresses import is_loopback
from stretch.cluster.output_logs import decode_schema
from stretch.spark.stage_results import in_spark_schema, latest_per_key, transaction_of


class ClusterStage:
    """A stage whose job runs on a cluster (``client``: its ClusterJobClient)."""

    def __init__(self, client: ClusterJobClient, into: str, out: str):
        cluster = client.cluster
        self.name, self.into, self.out = client.name, into, out
        self.connection = cluster.connection
        forwards = self.connection.jobs().get(self.name, {}).get("forwards")
        if forwards:
            raise ValueError(
                f"job {self.name!r} re-keys across nodes ({forwards[0]}): the results of a task's "
                "rows come from other nodes than the ones taking them, so a stage cannot return them; "
                "write with format('stretch').option('cluster', ...) and read the output channel "
                "with spark.readStream, or run the job on one node engine"
            )
        remote = not is_loopback(cluster.host)
        self.address = cluster.url if remote else cluster.address
        self.secret = cluster.secret if remote else None
        self.tls = cluster.tls if remote else None

    def input_schema(self) -> pa.Schema | None:
        with ClusterWriter(self.address, self.name, self.into, secret=self.secret, tls=self.tls) as writer:
            return writer.schema.remove_metadata() if writer.schema is not None else None

    def output_schema(self) -> pa.Schema:
        """The output channel's schema, as a node the job ran on has it (declared, or its first batch)."""
        for node in self.connection.jobs().get(self.name, {}).get("nodes", []):
            schema = decode_schema(self.connection.output_info(node, self.name, self.out)["schema"])
            if schema is not None:
                return schema.remove_metadata()
        raise ValueError(
            f"channel {self.out!r} of job {self.name!r} has no declared type and no data yet: declare "
            "the output type of the stream that feeds it"
        )

    def task(self, in_schema: pa.Schema, out_schema: pa.Schema, keys: list[str]) -> ClusterStageTask:
        return ClusterStageTask(self, in_schema, out_schema, keys)


class ClusterStageTask:
    """What each Spark task runs (pickled to the executors' Python workers)."""

    def __init__(self, target: ClusterStage, in_schema: pa.Schema, out_schema: pa.Schema, keys: list[str]):
        self.address, self.secret, self.tls = target.address, target.secret, target.tls
        self.job, self.into, self.out = target.name, target.into, target.out
        self.out_schema, self.keys = out_schema, keys
        self.stage_id = uuid.uuid4().hex  # names the tasks of batch queries (stage_results.transaction_of)

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        rows = [b for b in batches if b.num_rows]
        if not rows:
            return
        table = pa.Table.from_batches(rows)  # the writer casts it to the channel's types, by position
        query, batch_id, partition = transaction_of(TaskContext.get(), self.stage_id)
        try:
            with ClusterWriter(self.address, self.job, self.into, secret=self.secret, tls=self.tls) as writer:
                parts = writer.transact(table, self.out, query, batch_id, partition)
        except (LookupError, NodeUnreachable, flight.FlightUnavailableError) as e:
            raise RuntimeError(
                f"the stretch cluster job {self.job!r} of this stage did not take micro-batch {batch_id} "
                f"(partition {partition}): {e}"
            ) from e
        schema = self.out_schema
        results = pa.Table.from_batches(
            [in_spark_schema(b, schema) for part in parts for b in part.to_batches()], schema=schema
        )
        if self.keys:
            results = latest_per_key(results, self.keys)
        yield from results.to_batches()
