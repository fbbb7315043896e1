"""The ``stretch`` data source for Spark's Python Data Source API (``pyspark.sql.datasource``)."""

from __future__ import annotations

from pyspark.sql.datasource import DataSource

from stretch.channels import output_schema
from stretch.cluster.addresses import is_url
from stretch.cluster.client import ClusterConnection, job_runs, node_job, node_output
from stretch.cluster.output_logs import decode_schema
from stretch.jobs import JobNotFound
from stretch.spark.checkpoint_source import CheckpointStateReader, checkpoint_schema
from stretch.spark.cluster_sink import ClusterStreamWriter
from stretch.spark.cluster_source import ClusterBatchReader, ClusterStateReader, ClusterStreamReader
from stretch.spark.options import cluster_credentials
from stretch.spark.schemas import spark_ddl
from stretch.spark.sink import StretchStreamWriter
from stretch.spark.source import StretchBatchReader, StretchStreamReader
from stretch.spark.state_source import StretchStateReader, state_ddl, state_schema


class StretchDataSource(DataSource):
    """``format("stretch")`` with options ``job`` (a job name or id) and ``channel``; with
    ``cluster`` (a cluster's address: its directory, or its URL with option ``secret``), the job
    of that name on the cluster's nodes; with ``checkpoint`` (a path) and ``state``, an
    operator's state in a checkpoint (``stretch.spark.checkpoint_source``)."""

    @classmethod
    def name(cls) -> str:
        return "stretch"

    def _required(self, key: str) -> str:
        value = self.options.get(key)
        if not value:
            raise ValueError(f'format("stretch") needs .option("{key}", ...)')
        return value

    def schema(self):
        """What a read returns, so that Spark needs no schema from the user: an output channel's
        records, or (``option("state", operator)``) an operator's keyed state."""
        if self.options.get("checkpoint"):
            return checkpoint_schema(self.options)
        job = self._required("job")
        if is_url(self.options.get("cluster")):
            return self._remote_schema(job)
        if self.options.get("cluster"):
            return self._node_schema(job)
        if self.options.get("state"):
            return state_schema(job, self.options["state"])
        return spark_ddl(output_schema(job, self._required("channel")))

    def _node_schema(self, job: str) -> str:
        """The schema as this cluster's run of the job on one of its nodes has it (a running one,
        for its state): found by the run's job id, never another cluster's job of that name."""
        address = self.options["cluster"]
        with ClusterConnection(address) as connection:
            entry, nodes = job_runs(connection, job, address)
        for node in nodes:
            if not self.options.get("state"):
                channel = self._required("channel")
                return spark_ddl(output_schema(job, channel, where=node_output(entry, job, node, channel)))
            try:
                return state_schema(node_job(entry, job, node), self.options["state"])
            except JobNotFound:
                continue
        raise JobNotFound(f"no node of the cluster at {address} runs job {job!r} now")

    def _remote_schema(self, job: str) -> str:
        """The schema as a node of the cluster at a URL answers it (the driver, for a removed one)."""
        address = self.options["cluster"]
        secret, tls = cluster_credentials(self.options)
        with ClusterConnection(address, secret, tls) as connection:
            nodes = connection.jobs().get(job, {}).get("nodes") or []
            if not nodes:
                raise JobNotFound(f"the cluster at {address} runs no job {job!r}")
            if self.options.get("state"):
                running = [n for n in nodes if n in connection.locations()]
                if not running:
                    raise JobNotFound(f"no node of the cluster at {address} runs job {job!r} now")
                body = {"job": job, "operator": self.options["state"]}
                return state_ddl(decode_schema(connection.action(running[0], "state_schema", body)["schema"]))
            channel = self._required("channel")
            for node in nodes:
                schema = decode_schema(connection.output_info(node, job, channel)["schema"])
                if schema is not None:
                    return spark_ddl(schema)
        raise ValueError(
            f"channel {channel!r} of job {job!r} has no declared type and no data yet: declare the output type "
            "of the stream that feeds it"
        )

    def writer(self, schema, overwrite: bool):
        """A batch write (``df.write.format("stretch")``) is refused, saying what to use instead:
        a channel takes a stream, exactly once per micro-batch, which a batch write cannot name."""
        job, channel = self.options.get("job") or "<job>", self.options.get("channel") or "<channel>"
        raise ValueError(
            'format("stretch") takes no batch write (df.write): write a streaming DataFrame into the job\'s '
            f'input channel with .writeStream.format("stretch").option("job", "{job}").option("channel", '
            f'"{channel}").option("checkpointLocation", ...).start(), or pass any DataFrame, batch or '
            f'streaming, through the job with stretch.spark.stage(df, "{job}", into="{channel}", out=...), '
            "which returns the job's results for its rows"
        )

    def streamWriter(self, schema, overwrite: bool):
        if self.options.get("cluster"):  # a job on a stretch cluster: rows go to their key groups' nodes
            return ClusterStreamWriter(self.options, schema)
        return StretchStreamWriter(self.options, schema)

    def streamReader(self, schema):
        if self.options.get("checkpoint"):
            raise ValueError("a checkpoint's state is read in batch: spark.read, not spark.readStream")
        if self.options.get("cluster"):
            return ClusterStreamReader(self.options, schema)
        return StretchStreamReader(self.options, schema)

    def reader(self, schema):
        if self.options.get("checkpoint"):
            return CheckpointStateReader(self.options, schema)
        cluster = bool(self.options.get("cluster"))
        if self.options.get("state"):
            return (ClusterStateReader if cluster else StretchStateReader)(self.options, schema)
        return (ClusterBatchReader if cluster else StretchBatchReader)(self.options, schema)
