"""Writing rows into a job on a cluster: split each batch by owning node, send each node its part.

A writer reads the cluster's address (its directory: routing table, node endpoints, secret), and
computes every row's key group with stretch's own hash, the one the nodes' engines use. A node
refuses a part that holds a key group it does not own (``NOT_OWNER``: the key group moved, or is
moving); the writer then reloads the routing table and sends that part again, split anew, so no
row is lost or sent twice. With ``query`` and ``batch`` (a Spark micro-batch), each key group of
a node takes a (query, batch) at most once, so a replayed micro-batch changes nothing wherever
its key groups are now (the marks move with the key groups).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from pyarrow import flight

from stretch.cluster.node import NOT_MEMBER, NOT_OWNER, SECRET_HEADER, column_of
from stretch.cluster.routing import RoutingStore, RoutingTable
from stretch.cluster.tls import ClusterTLS
from stretch.common.records import schema_for, to_batch
from stretch.common.typeinfo import TypeInformation
from stretch.state.key_groups import key_groups_of

MEMBERS_FILE = "members.json"


@dataclass(frozen=True)
class Members:
    """The nodes that take a broadcast channel's rows (``members.json``), version ``version``: a
    node that joins is a member once it holds the broadcast state of the others."""

    version: int
    nodes: tuple[str, ...]

    @classmethod
    def load(cls, address: str | Path) -> Members:
        try:
            raw = json.loads((Path(address) / MEMBERS_FILE).read_text())
        except FileNotFoundError:
            raise LookupError(f"the cluster at {address} has no broadcast membership") from None
        return cls(int(raw["version"]), tuple(raw["nodes"]))


class NotOwner(RuntimeError):
    """A node refused rows of key groups it does not own (now)."""


class ClusterConnection:
    """Flight clients of a cluster's nodes, each call carrying the cluster's secret."""

    def __init__(self, address: str | Path):
        self.directory = Path(address)
        secret = (self.directory / "secret").read_text().strip()
        self.options = flight.FlightCallOptions(headers=[(SECRET_HEADER.encode(), secret.encode())])
        self.store = RoutingStore(self.directory)
        tls = ClusterTLS.of_cluster(self.directory)
        self._tls_options = tls.client_options() if tls is not None else {}
        self._clients: dict[str, flight.FlightClient] = {}
        self._locations: dict[str, str] = {}

    def locations(self) -> dict[str, str]:
        self._locations = json.loads((self.directory / "nodes.json").read_text())
        return self._locations

    def members(self) -> Members:
        """The cluster's broadcast membership now (``members.json``)."""
        return Members.load(self.directory)

    def client(self, node: str) -> flight.FlightClient:
        c = self._clients.get(node)
        if c is None:
            location = self._locations.get(node) or self.locations().get(node)
            if location is None:
                raise LookupError(f"cluster at {self.directory} has no node {node!r}")
            c = self._clients[node] = flight.FlightClient(location, **self._tls_options)
        return c

    def action(self, node: str, kind: str, body: bytes | dict = b"") -> dict:
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        (result,) = list(self.client(node).do_action(flight.Action(kind, raw), self.options))
        return json.loads(result.body.to_pybytes())

    def put(self, node: str, command: dict, table: pa.Table) -> None:
        descriptor = flight.FlightDescriptor.for_command(json.dumps(command).encode())
        writer, _ = self.client(node).do_put(descriptor, table.schema, self.options)
        try:
            writer.write_table(table)
        finally:
            writer.close()

    def get(self, node: str, ticket: str) -> pa.Table:
        return self.client(node).do_get(flight.Ticket(ticket.encode()), self.options).read_all()

    def driver_action(self, kind: str, body: dict | None = None) -> dict:
        """Ask the cluster's driver (``cluster.driver``) for a node change."""
        try:
            location = json.loads((self.directory / "driver.json").read_text())["location"]
        except FileNotFoundError:
            raise LookupError(f"the cluster at {self.directory} has no running driver") from None
        with flight.FlightClient(location, **self._tls_options) as driver:
            raw = json.dumps(body or {}).encode()
            (result,) = list(driver.do_action(flight.Action(kind, raw), self.options))
        return json.loads(result.body.to_pybytes())

    def forget(self, node: str) -> None:
        c = self._clients.pop(node, None)
        if c is not None:
            c.close()

    def close(self) -> None:
        for node in list(self._clients):
            self.forget(node)


def job_nodes(address: str | Path, job: str) -> list[str]:
    """The nodes job ``job`` ran on, in the order they joined (removed nodes too: their output
    logs stay readable); each runs it as ``<job>@<node>``."""
    try:
        jobs = json.loads((Path(address) / "jobs.json").read_text())
    except FileNotFoundError:
        raise LookupError(f"no stretch cluster at {address}") from None
    nodes = jobs.get(job, {}).get("nodes")
    if not nodes:
        raise LookupError(f"the cluster at {address} runs no job {job!r} (jobs: {sorted(jobs)})")
    return nodes


class ClusterWriter:
    """Writes records into input channel ``channel`` of job ``job`` on the cluster at ``address``.

    ``key``: the field the job keys the channel by (the cluster knows it for jobs it was given).

    A broadcast channel (the rows of a job's ``broadcast(descriptor)`` stream) is not split: every
    node of the broadcast membership (``members.json``) takes the whole batch, each (query, batch)
    at most once per node. A node that joins copies the broadcast state of a member first; from
    then until the membership names it, that member refuses writers of the older membership, which
    load it again and send the rows to the nodes that have not taken them, the new one included.
    """

    def __init__(self, address: str | Path, job: str, channel: str, key=None, retry_for: float = 60.0):
        self.connection = ClusterConnection(address)
        self.job, self.channel = job, channel
        info = json.loads((self.connection.directory / "jobs.json").read_text()).get(job, {})
        self.key = key if key is not None else info.get("inputs", {}).get(channel)
        self.broadcast = channel in info.get("broadcast", ())  # every node takes every row
        if self.key is None and not self.broadcast:
            raise LookupError(f"no job {job!r} with input channel {channel!r} on the cluster; give key=")
        declared = info.get("types", {}).get(channel)
        self.type_info = TypeInformation.from_json(declared) if declared else None
        self.schema = schema_for(self.type_info) if self.type_info is not None else None
        self.retry_for = retry_for
        self.table: RoutingTable = self.connection.store.load()
        self.refusals = 0  # parts sent again because their key groups had moved
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
            owners = np.asarray(self.table.owners)[kgs]
            for node in np.unique(owners):
                rows = part.filter(pa.array(owners == node))
                try:
                    self.connection.put(str(node), command, pa.Table.from_batches([rows]))
                except (flight.FlightServerError, flight.FlightUnavailableError, LookupError) as e:
                    if NOT_OWNER not in str(e) and not isinstance(
                        e, (flight.FlightUnavailableError, LookupError)
                    ):
                        raise
                    if time.monotonic() > deadline:
                        raise NotOwner(
                            f"rows of job {self.job!r} found no owner within {self.retry_for} s: {e}"
                        ) from e
                    self.refusals += 1
                    self._reload()
                    pending.append(rows)

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
                    if NOT_MEMBER not in str(e) and not isinstance(
                        e, (flight.FlightUnavailableError, LookupError)
                    ):
                        raise
                    if time.monotonic() > deadline:
                        raise NotOwner(
                            f"broadcast rows of job {self.job!r} did not reach every node within "
                            f"{self.retry_for} s: {e}"
                        ) from e
                    self.refusals += 1
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
        latest = self.connection.store.load()
        if latest.version == self.table.version:
            time.sleep(0.002)
        self.table = latest
        self.connection.locations()

    def close(self) -> None:
        """Close the connections to the nodes (a ``with`` block does it at its end)."""
        self.connection.close()

    def __enter__(self) -> ClusterWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
