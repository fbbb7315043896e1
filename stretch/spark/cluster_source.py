"""Spark reads a cluster job's output and keyed state (``.option("cluster", address)``).

On a cluster every node runs the job as ``<job>@<node>``, with an output log of its own, so an
offset is one per node (``{"nodes": {node: offset}}``) and a micro-batch's range splits into each
node's log ranges. The nodes are those the job ever ran on (``job_nodes``): a node that was
removed keeps its log, whose last results a reader still reads; a node that joins is read from
its first result. Keyed state is read per node, each node's key groups as its partitions (a key
lives on one node).

``startingOffsets`` (``run``, default: each node's first result of the cluster's run of the job;
``earliest``; ``latest``; or per node, ``{"nodes": {node: offset}}`` as Spark shows this source's
offsets, the nodes it does not name from ``run``) and, in batch, ``endingOffsets`` (``latest``,
default; or per node, exclusive, the nodes it does not name to their end) follow each node's log
as the single-machine reader's follow its one log (``source.log_offset``, ``source.log_range``).

With the cluster's directory, executors (on the cluster's host) read the logs' files and the
state arenas directly. With its URL (``cluster.url`` and the secret: ``.option("secret", ...)`` or
``$STRETCH_CLUSTER_SECRET``), they ask each node over Flight for its log ranges and its keyed
state, and the driver for the log of a node that was removed (see cluster.output_logs).
"""

from __future__ import annotations

import json
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
from stretch.spark.source import arrow_schema_of, log_offset, log_range, read_range, split
from stretch.spark.state_source import KeyGroups, read_key_groups

_PER_NODE = '{"nodes": {"<node>": <offset>, ...}}'


def node_offsets(option: str, value: str, words: tuple[str, ...], nodes: list[str], job: str) -> str | dict:
    """A cluster read's option ``option``: one of ``words`` for every node, or a JSON object
    ``{"nodes": {node: offset}}`` of some of the job's ``nodes`` (the dict of them); anything
    else is refused saying what is accepted, a node the job never ran on naming its nodes."""
    if value in words:
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    per_node = parsed.get("nodes") if isinstance(parsed, dict) and list(parsed) == ["nodes"] else None
    if not isinstance(per_node, dict) or not all(type(o) is int for o in per_node.values()):
        raise ValueError(f"{option} must be {', '.join(words)} or {_PER_NODE} on a cluster, got {value!r}")
    for node in per_node:
        if node not in nodes:
            raise ValueError(
                f"{option} names node {node!r}, which job {job!r} never ran on: it ran on {', '.join(nodes)}"
            )
    return per_node


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
        self.known = self.logs()  # an unknown cluster or job: an error now
        self.starting = node_offsets(
            "startingOffsets",
            options.get("startingOffsets", "run"),
            ("run", "earliest", "latest"),
            list(self.known),
            self.job,
        )

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

    def described(self, node: str) -> str:
        return f"channel {self.channel!r} of job {self.job!r} on node {node!r}"

    def offsets(self, option: str, chosen: str | dict, logs: dict[str, dict], default: str) -> dict[str, int]:
        """Each node's offset for ``chosen`` (a ``node_offsets`` answer; ``default`` for the nodes
        it does not name), refused below what the node's log holds."""
        out = {}
        for node, info in logs.items():
            value = chosen.get(node, default) if isinstance(chosen, dict) else chosen
            out[node] = log_offset(
                option, value, info["start"], info["end"], info["first"], self.described(node)
            )
        return out

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
    from ``startingOffsets`` (default: each node's first result of its current run)."""

    def initialOffset(self) -> dict:
        return {"nodes": self.offsets("startingOffsets", self.starting, self.logs(), "run")}

    def latestOffset(self, start=None, limit=None) -> dict:
        """Each node's end, or where the query is if that is further (a start past the end:
        nothing is read until the log passes it)."""
        at = (start or {}).get("nodes", {})
        return {"nodes": {node: max(end, at.get(node, end)) for node, end in self.ends().items()}}

    def partitions(self, start: dict, end: dict) -> list:
        return self.ranges(start["nodes"], end["nodes"])

    def commit(self, end: dict) -> None:
        pass


class ClusterBatchReader(_ClusterChannel, DataSourceReader):
    """``spark.read.format("stretch").option("cluster", address)``: what every node's log holds
    from ``startingOffsets`` to ``endingOffsets``. Per node, an offset past the log's end reads up
    to its end (nothing, if the range starts there); an ending before the starting, or an offset
    below what the log still holds, is refused naming the node and the offsets its log holds."""

    def __init__(self, options, schema):
        super().__init__(options, schema)
        ending = node_offsets(
            "endingOffsets", options.get("endingOffsets", "latest"), ("latest",), list(self.known), self.job
        )
        given = ending if isinstance(ending, dict) else {}
        start = self.offsets("startingOffsets", self.starting, self.known, "run")
        end = self.offsets("endingOffsets", ending, self.known, "latest")
        self.bounds = {
            node: log_range(
                start[node], end[node], node in given, info["start"], info["end"], self.described(node)
            )
            for node, info in self.known.items()
        }

    def partitions(self) -> list:
        return self.ranges(
            {node: a for node, (a, _) in self.bounds.items()},
            {node: b for node, (_, b) in self.bounds.items()},
        )


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
