"""A job running on a cluster, as its user holds it: the JobClient calls, over every node."""

from __future__ import annotations

import json

import pyarrow as pa

from stretch import channels
from stretch.cluster.client import node_output
from stretch.cluster.writer import ClusterWriter
from stretch.datastream.job_client import RescaleReport
from stretch.errors import JobExecutionError
from stretch.state.key_groups import key_group


class ClusterJobClient:
    """A job running on every node of a cluster: the JobClient calls, over all nodes."""

    def __init__(self, cluster, name: str):  # the StretchCluster that runs the job
        self.cluster, self.name = cluster, name

    def get_job_id(self) -> str:
        """The job's name: on a cluster it names the job on every node (there as ``<name>@<node>``)."""
        return self.name

    def writer(self, channel: str, key=None) -> ClusterWriter:
        """A writer into the job's input channel ``channel``, each row to the node owning its key group."""
        return self.cluster.writer(self.name, channel, key)

    def open_reader(self, channel: str):
        """This run's records of output channel ``channel``, from every node the job ran on
        (removed ones too), node after node. A node's part ends where the job ended there: read
        after ``end`` and ``wait`` (a running job's results: Spark's ``readStream`` with
        ``option("cluster", ...)``). Reads the logs' files: on the nodes' host."""
        entry = self.cluster.connection.jobs().get(self.name, {})
        starts = entry.get("starts", {})
        for node in entry.get("nodes", []):
            start = starts.get(node, {}).get(channel)
            where = node_output(entry, self.name, node, channel)
            yield from channels.ChannelReader(f"{self.name}@{node}", channel, start, where)

    def end(self, channel: str) -> None:
        """End input channel ``channel`` on every node (and on nodes that join later): the job
        finishes there once it processed it."""
        self.cluster.jobs.end(self.name, channel)

    def wait(self, timeout: float | None = None) -> dict[str, str]:
        """Each node's status of the job once it ended (``FINISHED``, ``CANCELED``), or when
        ``timeout`` (seconds, per node) passed; raises ``JobExecutionError`` if it failed on a
        node, with that node's error (as ``JobClient.wait`` raises the job's error)."""
        replies = {
            node: self.cluster.connection.action(node, "wait", {"job": self.name, "timeout": timeout})
            for node in self.cluster.nodes
        }
        failed = {node: r["error"] for node, r in replies.items() if r.get("error")}
        if not failed and self.name in self.cluster.failures:  # its source failed (cluster.sources)
            raise JobExecutionError(f"job {self.name!r} failed: {self.cluster.failures[self.name]['error']}")
        if failed:
            node, error = next(iter(failed.items()))
            raise JobExecutionError(
                f"job {self.name!r} failed on node {node}"
                + (f" (and on {', '.join(list(failed)[1:])})" if len(failed) > 1 else "")
                + f": {error}"
            )
        return {node: r["status"] for node, r in replies.items()}

    def cancel(self) -> None:
        """Cancel the job on every node (and the reading of its sources)."""
        self.cluster.sources.cancel(self.name)
        for node in self.cluster.nodes:
            self.cluster.connection.action(node, "cancel", {"job": self.name})

    def describe(self) -> dict[str, dict]:
        """Each node's ``describe()`` of the job (a node being added shows once it runs the job)."""
        return {
            node: status["jobs"][self.name]
            for node, status in self.cluster.status().items()
            if self.name in status["jobs"]
        }

    def trigger_checkpoint(self) -> dict[str, dict]:
        """Checkpoint every node now (``StretchCluster.checkpoint``)."""
        return self.cluster.checkpoint()

    def rescale(
        self, operator_name: str, parallelism: int, timeout: float | None = None, *, node: str
    ) -> RescaleReport:
        """A live rescale of ``operator_name`` inside one node (copy-free, as on one machine)."""
        if node not in self.cluster.nodes:
            raise LookupError(f"no node {node!r} in the cluster (nodes: {self.cluster.nodes})")
        body = {"job": self.name, "operator": operator_name, "parallelism": parallelism, "timeout": timeout}
        return RescaleReport(**self.cluster.connection.action(node, "rescale", body))

    def query_state(self, operator: str, key=None, key_groups=None) -> pa.Table:
        """An operator's keyed state over all nodes (one row per key; no rows before any key).

        ``key`` narrows it to one key (asked of the node owning its key group), ``key_groups`` to
        some key groups (each asked of its owner), as ``JobClient.query_state``."""
        owners = self.cluster.table.owners
        if key is not None:
            key_groups = [key_group(key, len(owners))]
        asked: dict[str, list[int] | None] = dict.fromkeys(self.cluster.nodes)
        if key_groups is not None:
            asked = {self.cluster.nodes[0]: []}  # no key group: a table without rows, of the schema
            for kg in map(int, key_groups):
                asked.setdefault(owners[kg], []).append(kg)
        every = [
            self.cluster.connection.get(
                node, "state:" + json.dumps({"job": self.name, "operator": operator, "key_groups": groups})
            )
            for node, groups in asked.items()
        ]
        tables = [t for t in every if t.num_rows]  # a node without keys may not know their type
        table = pa.concat_tables(tables) if tables else every[0]
        if key is not None:
            table = table.filter(pa.array([k == key for k in table.column("key").to_pylist()], pa.bool_()))
        return table
