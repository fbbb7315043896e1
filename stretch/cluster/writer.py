"""Writing rows into a job on a cluster: split each batch by owning node, send each node its part.

A writer opens the cluster by its address: its directory on the same host (routing table, node
endpoints, secret in files), or its driver's URL from anywhere (``grpc://host:port``: the driver
answers the routing table, the nodes' endpoints and the jobs' input keys; the caller gives the
secret). It computes every row's key group with stretch's own hash, the one the nodes' engines
use. A node refuses a part that holds a key group it does not own (``NOT_OWNER``: the key group
moved, or is moving); the writer then reloads the routing table and sends that part again, split
anew, so no row is lost or sent twice. With ``query`` and ``batch`` (a Spark micro-batch), each
key group of a node takes a (query, batch) at most once, so a replayed micro-batch changes
nothing wherever its key groups are now (the marks move with the key groups).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from pyarrow import flight

from stretch.cluster.client import ClusterConnection, Members, NotOwner
from stretch.cluster.node_plans import column_of
from stretch.cluster.protocol import NOT_MEMBER, NOT_OWNER
from stretch.cluster.routing import RoutingTable
from stretch.cluster.shm_transport import NO_SHM, SharedBatches
from stretch.cluster.tls import ClusterTLS
from stretch.common.records import schema_for, to_batch
from stretch.common.typeinfo import TypeInformation
from stretch.state.key_groups import key_groups_of


class ClusterWriter:
    """Writes records into input channel ``channel`` of job ``job`` on the cluster at ``address``
    (its directory, or its URL with ``secret`` and, for TLS, ``tls``: see ClusterConnection).

    ``key``: the field the job keys the channel by (the cluster knows it for jobs it was given).

    A broadcast channel (the rows of a job's ``broadcast(descriptor)`` stream) is not split: every
    node of the broadcast membership (``members.json``) takes the whole batch, each (query, batch)
    at most once per node. A node that joins copies the broadcast state of a member first; from
    then until the membership names it, that member refuses writers of the older membership, which
    load it again and send the rows to the nodes that have not taken them, the new one included.
    """

    def __init__(
        self,
        address: str | Path,
        job: str,
        channel: str,
        key=None,
        retry_for: float = 60.0,
        secret: str | None = None,
        tls: ClusterTLS | None = None,
    ):
        self.connection = ClusterConnection(address, secret, tls)
        self.job, self.channel = job, channel
        info = self.connection.jobs().get(job, {})
        self.key = key if key is not None else info.get("inputs", {}).get(channel)
        self.broadcast = channel in info.get("broadcast", ())  # every node takes every row
        if self.key is None and not self.broadcast:
            raise LookupError(f"no job {job!r} with input channel {channel!r} on the cluster; give key=")
        declared = info.get("types", {}).get(channel)
        self.type_info = TypeInformation.from_json(declared) if declared else None
        self.schema = schema_for(self.type_info) if self.type_info is not None else None
        self.retry_for = retry_for
        self.table: RoutingTable = self.connection.routing()
        self.refusals = 0  # parts sent again because their key groups had moved
        self.shared = SharedBatches()  # parts for nodes on this host go through shared memory
        self.members: Members | None = None  # a broadcast channel's nodes, loaded at its first write

    def write(self, data, query: str | None = None, batch: int | None = None) -> None:
        """Send records (a RecordBatch, a Table or a list of tuples/Rows) to their nodes.

        ``query`` and ``batch``: the (query, micro-batch) they belong to; a (query, batch) that a
        key group already took is dropped there, so a replay is exact. Give all rows of a
        micro-batch in one call: a node takes a key group's rows of a micro-batch all at once.
        """
        if (query is None) != (batch is None):
            raise ValueError("give both query and batch (a micro-batch), or neither")
        if isinstance(data, pa.Table):  # one batch: a key group's rows of a micro-batch go together
            parts = data.combine_chunks().to_batches()[:1]
        elif isinstance(data, pa.RecordBatch):
            parts = [data]
        else:
            parts = [to_batch(list(data), self.type_info)]
        command = {"op": "write", "job": self.job, "channel": self.channel, "query": query, "batch": batch}
        pending = [self._shaped(p) for p in parts if p.num_rows]
        deadline = time.monotonic() + self.retry_for
        if self.broadcast:
            for part in pending:
                self._to_every_node(part, command, deadline)
            return
        while pending:
            part = pending.pop(0)
            kgs = key_groups_of(column_of(part, self.key), len(self.table.owners))
            nodes, index = np.unique(np.asarray(self.table.owners), return_inverse=True)
            owners = index[kgs]
            for i in np.unique(owners):
                node = str(nodes[i])
                rows = part if len(nodes) == 1 else part.filter(pa.array(owners == i))
                try:
                    self._send(node, command, rows)
                except (flight.FlightServerError, flight.FlightUnavailableError, LookupError) as e:
                    self._refused(e, NOT_OWNER, deadline, "found no owner")
                    self._reload()
                    pending.append(rows)

    def _refused(self, e: Exception, marker: str, deadline: float, what: str) -> None:
        """A part a node refused (``marker``: it moved on) or could not take (gone, unknown) is sent
        again after a reload, until ``deadline``; any other error is the caller's."""
        if marker not in str(e) and not isinstance(e, (flight.FlightUnavailableError, LookupError)):
            raise e
        if time.monotonic() > deadline:
            raise NotOwner(f"rows of job {self.job!r} {what} within {self.retry_for} s: {e}") from e
        self.refusals += 1

    def _send(self, node: str, command: dict, rows: pa.RecordBatch) -> None:
        """One node's part: through shared memory if the node sees this host's, else over Flight."""
        staged = self.shared.stage(node, rows) if self.shared.usable(node) else None
        if staged is not None:
            try:
                self.connection.action(node, "write_shared", {**command, **staged})
                return
            except flight.FlightServerError as e:
                if NO_SHM not in str(e):
                    raise
                self.shared.refused(node)
        self.connection.put(node, command, pa.Table.from_batches([rows]))

    def _to_every_node(self, part: pa.RecordBatch, command: dict, deadline: float) -> None:
        """Rows of a broadcast channel to every node of the cluster's broadcast membership. A node
        that refuses (it knows a newer membership: a node joined, or it left) or is gone makes the
        writer load the membership again and send to the nodes that have not taken the rows yet."""
        if self.members is None:
            self.members = self.connection.members()
        table = pa.Table.from_batches([part])
        done: set[str] = set()
        while True:
            pending = [n for n in self.members.nodes if n not in done]
            if not pending:
                return
            for node in pending:
                try:
                    self.connection.put(node, {**command, "members": self.members.version}, table)
                except (flight.FlightServerError, flight.FlightUnavailableError, LookupError) as e:
                    self._refused(e, NOT_MEMBER, deadline, "did not reach every node")
                    latest = self.connection.members()
                    if latest.version == self.members.version:
                        time.sleep(0.002)
                    self.members = latest
                    self.connection.locations()
                    break
                done.add(node)

    def _shaped(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """A batch in the channel's declared schema (columns by position: Spark's names and
        Arrow types, such as string for large_string, differ from the job's)."""
        if self.schema is None or batch.schema.equals(self.schema):
            return batch
        if batch.num_columns != len(self.schema):
            raise ValueError(
                f"channel {self.channel!r} of job {self.job!r} takes {len(self.schema)} columns "
                f"({self.schema}), got {batch.num_columns} ({batch.schema})"
            )
        columns = [c.cast(f.type) for c, f in zip(batch.columns, self.schema)]
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)

    def _reload(self) -> None:
        """The latest routing table; waits a little if it has not changed (a move under way)."""
        latest = self.connection.routing()
        if latest.version == self.table.version:
            time.sleep(0.002)
        self.table = latest
        self.connection.locations()

    def close(self) -> None:
        """Close the connections to the nodes (a ``with`` block does it at its end)."""
        self.shared.close()
        self.connection.close()

    def __enter__(self) -> ClusterWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
