"""Spark reads a cluster job's output and keyed state (``.option("cluster", address)``).

On a cluster every node runs the job as ``<job>@<node>``, with an output log of its own, so an
offset is one per node (``{"nodes": {node: offset}}``) and a micro-batch's range splits into each
node's log ranges. The nodes are those the job ever ran on (``job_nodes``): a node that was
removed keeps its log, whose last results a reader still reads; a node that joins is read from
its first result. Keyed state is read per node from its arena, each node's key groups as the
partitions (a key lives on one node).
"""

from __future__ import annotations

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader

from stretch.channels import OutputLog, locate_output
from stretch.cluster import job_nodes
from stretch.jobs import find
from stretch.spark.options import job_and_channel
from stretch.spark.source import arrow_schema_of, read_range, split
from stretch.spark.state_source import KeyGroups, read_key_groups


class _ClusterChannel:
    def __init__(self, options, schema):
        self.address = options.get("cluster")
        self.job, self.channel = job_and_channel(options)
        self.parts = int(options.get("partitions", 2))
        self.arrow_schema = arrow_schema_of(schema)
        self.nodes()  # an unknown cluster or job: an error now

    def nodes(self) -> dict[str, str]:
        """node -> the directory of its output log."""
        return {
            n: locate_output(f"{self.job}@{n}", self.channel)["log"]
            for n in job_nodes(self.address, self.job)
        }

    def ends(self) -> dict[str, int]:
        out = {}
        for node, directory in self.nodes().items():
            with OutputLog(directory) as log:
                out[node] = log.end
        return out

    def ranges(self, start: dict, end: dict) -> list:
        directories = self.nodes()
        out = []
        for node, stop in end.items():
            first = start.get(node)
            if first is None:  # a node that joined since: from its log's first result
                with OutputLog(directories[node]) as log:
                    first = log.start
            out += split(directories[node], first, stop, self.parts)
        return out


class ClusterStreamReader(_ClusterChannel, DataSourceStreamReader):
    """``spark.readStream.format("stretch").option("cluster", address)``: every node's results,
    from each node's first result of its current run."""

    def initialOffset(self) -> dict:
        starts = {}
        for node in job_nodes(self.address, self.job):
            reply = locate_output(f"{self.job}@{node}", self.channel)
            if reply["run_start"] is not None:
                starts[node] = reply["run_start"]
            else:
                with OutputLog(reply["log"]) as log:
                    starts[node] = log.start
        return {"nodes": starts}

    def latestOffset(self, start=None, limit=None) -> dict:
        return {"nodes": self.ends()}

    def partitions(self, start: dict, end: dict) -> list:
        return self.ranges(start["nodes"], end["nodes"])

    def read(self, partition):
        return read_range(partition, self.arrow_schema)

    def commit(self, end: dict) -> None:
        pass


class ClusterBatchReader(_ClusterChannel, DataSourceReader):
    """``spark.read.format("stretch").option("cluster", address)``: what every node's log holds."""

    def partitions(self) -> list:
        return self.ranges({}, self.ends())

    def read(self, partition):
        return read_range(partition, self.arrow_schema)


class ClusterStateReader(DataSourceReader):
    """``spark.read.format("stretch").option("cluster", address).option("state", operator)``:
    the operator's keyed state on every node that runs the job now."""

    def __init__(self, options, schema):
        self.names = [f.name for f in schema.fields]
        self.locations = []
        for node in job_nodes(options["cluster"], options["job"]):
            try:
                job = find(f"{options['job']}@{node}")
            except LookupError:  # a removed node: its key groups live elsewhere now
                continue
            reply = job.state_location(options["state"])
            self.locations.append((reply["arena"], reply["max_parallelism"]))

    def partitions(self) -> list[KeyGroups]:
        return [KeyGroups(arena, 0, max_parallelism) for arena, max_parallelism in self.locations]

    def read(self, partition: KeyGroups):
        return read_key_groups(partition, self.names)
