"""Spark reads a cluster job's output and keyed state (``.option("cluster", address)``).

On a cluster every node runs the job as ``<job>@<node>``, with an output log of its own, so an
offset is one per node (``{"nodes": {node: offset}}``) and a micro-batch's range splits into each
node's log ranges. The nodes are those the job ever ran on (``job_nodes``): a node that was
removed keeps its log, whose last results a reader still reads; a node that joins is read from
its first result. Keyed state is read per node, each node's key groups as its partitions (a key
lives on one node).

With the cluster's directory, executors (on the cluster's host) read the logs' files and the
state arenas directly. With its URL (``cluster.url`` and the secret: ``.option("secret", ...)`` or
``$STRETCH_CLUSTER_SECRET``), they ask each node over Flight for its log ranges and its keyed
state, and the driver for the log of a node that was removed (see cluster.output_logs).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition

from stretch.channels import OutputLog
from stretch.cluster.addresses import is_url
from stretch.cluster.client import ClusterConnection, job_runs, node_job, node_output
from stretch.jobs import find
from stretch.spark.options import cluster_credentials, job_and_channel
from stretch.spark.schemas import spark_values
from stretch.spark.source import arrow_schema_of, read_range, split
from stretch.spark.state_source import KeyGroups, read_key_groups


@dataclass
class NodeLogRange(InputPartition):
    """Batches ``start`` .. ``end`` of node ``node``'s output log, read over Flight."""

    node: str
    start: int
    end: int


@dataclass
class NodeState(InputPartition):
    """An operator's keyed state on node ``node``, read over Flight."""

    node: str


class _Cluster:
    def __init__(self, options):
        self.address = options.get("cluster")
        self.secret, self.tls = cluster_credentials(options)
        self.remote = is_url(self.address)

    def connection(self) -> ClusterConnection:
        return ClusterConnection(self.address, self.secret, self.tls)


class _ClusterChannel(_Cluster):
    def __init__(self, options, schema):
        super().__init__(options)
        self.job, self.channel = job_and_channel(options)
        self.parts = int(options.get("partitions", 2))
        self.arrow_schema = arrow_schema_of(schema)
        self.logs()  # an unknown cluster or job: an error now

    def logs(self) -> dict[str, dict]:
        """node -> its log's ``start``, ``end``, ``run_start`` and ``first``, the first result
        of the cluster's run of the job there (a log keeps earlier runs of the name before it)
        (and ``log``, its directory, on this host)."""
        out = {}
        with self.connection() as c:
            entry, nodes = job_runs(c, self.job, self.address)
            if self.remote:
                for node in nodes:
                    out[node] = c.output_info(node, self.job, self.channel)
        if not self.remote:
            for node in nodes:
                reply = node_output(entry, self.job, node, self.channel)
                with OutputLog(reply["log"]) as log:
                    out[node] = {
                        "start": log.start,
                        "end": log.end,
                        "run_start": reply["run_start"],
                        "log": reply["log"],
                    }
        for node, info in out.items():
            recorded = entry.get("starts", {}).get(node, {}).get(self.channel)
            fallback = info["run_start"] if info["run_start"] is not None else info["start"]
            info["first"] = max(info["start"], recorded if recorded is not None else fallback)
        return out

    def ends(self) -> dict[str, int]:
        return {node: info["end"] for node, info in self.logs().items()}

    def ranges(self, start: dict, end: dict) -> list:
        logs = self.logs()
        out = []
        for node, stop in end.items():
            first = start.get(node)
            if first is None:  # a node that joined since: from its first result of this run
                first = logs[node]["first"]
            if self.remote:
                n = max(1, min(self.parts, stop - first))
                bounds = [first + (stop - first) * i // n for i in range(n + 1)]
                out += [NodeLogRange(node, a, b) for a, b in pairwise(bounds) if b > a]
            else:
                out += split(logs[node]["log"], first, stop, self.parts)
        return out

    def read(self, partition):
        if not isinstance(partition, NodeLogRange):
            yield from read_range(partition, self.arrow_schema)
            return
        with self.connection() as c:
            table = c.output_range(partition.node, self.job, self.channel, partition.start, partition.end)
        for batch in table.to_batches():
            columns = [spark_values(col).cast(f.type) for col, f in zip(batch.columns, self.arrow_schema)]
            yield pa.RecordBatch.from_arrays(columns, schema=self.arrow_schema)


class ClusterStreamReader(_ClusterChannel, DataSourceStreamReader):
    """``spark.readStream.format("stretch").option("cluster", address)``: every node's results,
    from each node's first result of its current run."""

    def initialOffset(self) -> dict:
        return {"nodes": {node: info["first"] for node, info in self.logs().items()}}

    def latestOffset(self, start=None, limit=None) -> dict:
        return {"nodes": self.ends()}

    def partitions(self, start: dict, end: dict) -> list:
        return self.ranges(start["nodes"], end["nodes"])

    def commit(self, end: dict) -> None:
        pass


class ClusterBatchReader(_ClusterChannel, DataSourceReader):
    """``spark.read.format("stretch").option("cluster", address)``: what every node's log holds."""

    def partitions(self) -> list:
        return self.ranges({}, self.ends())


class ClusterStateReader(_Cluster, DataSourceReader):
    """``spark.read.format("stretch").option("cluster", address).option("state", operator)``:
    the operator's keyed state on every node that runs the job now."""

    def __init__(self, options, schema):
        super().__init__(options)
        self.names = [f.name for f in schema.fields]
        self.job, self.operator = options["job"], options["state"]
        self.locations = []
        with self.connection() as c:
            entry, nodes = job_runs(c, self.job, self.address)
            running = c.locations() if self.remote else None
        if self.remote:
            self.nodes = [n for n in nodes if n in running]
            return
        for node in nodes:
            try:
                job = find(node_job(entry, self.job, node))
            except LookupError:  # a removed node: its key groups live elsewhere now
                continue
            reply = job.state_location(self.operator)
            self.locations.append((reply["arena"], reply["max_parallelism"]))

    def partitions(self) -> list:
        if self.remote:
            return [NodeState(node) for node in self.nodes]
        return [KeyGroups(arena, 0, max_parallelism) for arena, max_parallelism in self.locations]

    def read(self, partition):
        if not isinstance(partition, NodeState):
            yield from read_key_groups(partition, self.names)
            return
        with self.connection() as c:
            table = c.get(partition.node, f"state:{self.job}:{self.operator}")
        if table.num_rows:
            columns = [spark_values(table.column(n).combine_chunks()) for n in self.names]
            yield pa.RecordBatch.from_arrays(columns, names=self.names)
