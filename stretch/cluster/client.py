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

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from pyarrow import flight

from stretch.cluster.addresses import is_url
from stretch.cluster.node_plans import column_of
from stretch.cluster.protocol import NOT_MEMBER, NOT_OWNER, SECRET_ENV, SECRET_HEADER
from stretch.cluster.routing import RoutingStore, RoutingTable
from stretch.cluster.shm_transport import NO_SHM, SharedBatches
from stretch.cluster.tls import TLS_ENV, ClusterTLS
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


class NodeUnreachable(flight.FlightUnavailableError):
    """A node did not answer: its process died, or its host is unreachable (the message names it)."""


class NotOwner(RuntimeError):
    """A node refused rows of key groups it does not own (now)."""


class ClusterConnection:
    """Flight clients of a cluster's nodes (and driver), each call carrying the cluster's secret.

    ``address``: the cluster's directory (same host; the secret and TLS paths are read there) or
    its driver's URL (``cluster.url``; the secret is ``secret``, else ``$STRETCH_CLUSTER_SECRET``,
    and for ``grpc+tls://`` this caller's certificate is ``tls``, else ``$STRETCH_CLUSTER_TLS``).
    """

    def __init__(self, address: str | Path, secret: str | None = None, tls: ClusterTLS | None = None):
        self.address = str(address)
        self.url = self.address if is_url(address) else None
        if self.url is None:
            self.directory: Path | None = Path(address)
            self.store: RoutingStore | None = RoutingStore(self.directory)
            if not secret:
                try:
                    secret = (self.directory / "secret").read_text().strip()
                except FileNotFoundError:
                    raise LookupError(f"no stretch cluster at {self.address}") from None
            tls = tls if tls is not None else ClusterTLS.of_cluster(self.directory)
        else:
            self.directory = self.store = None
            secret = secret or os.environ.get(SECRET_ENV)
            if not secret:
                raise ValueError(
                    f"the cluster at {self.url} needs its secret: give secret= (cluster.secret) or set "
                    f"${SECRET_ENV}"
                )
            if tls is None and os.environ.get(TLS_ENV):
                tls = ClusterTLS.from_json(os.environ[TLS_ENV])
            if self.url.startswith("grpc+tls://") and tls is None:
                raise ValueError(
                    f"the cluster at {self.url} uses mutual TLS: give tls=ClusterTLS(...) (this caller's "
                    f"certificate, key and the cluster's CA) or set ${TLS_ENV}"
                )
        self.secret = secret
        self.tls = tls
        self.options = flight.FlightCallOptions(headers=[(SECRET_HEADER.encode(), secret.encode())])
        self._tls_options = tls.client_options() if tls is not None else {}
        self._clients: dict[str, flight.FlightClient] = {}
        self._locations: dict[str, str] = {}
        self._driver: flight.FlightClient | None = None

    # ---- what the cluster is: files of its directory, or the driver's answer --------------------
    def topology(self) -> dict:
        """``routing`` (the table's JSON, None before the first), ``nodes`` (id -> location) and
        ``jobs`` (name -> inputs, types, nodes)."""
        if self.url is not None:
            return self.driver_action("topology")
        try:
            jobs = json.loads((self.directory / "jobs.json").read_text())
        except FileNotFoundError:
            raise LookupError(f"no stretch cluster at {self.address}") from None
        table = self.store.load()
        return {
            "routing": json.loads(table.to_json()) if table is not None else None,
            "nodes": json.loads((self.directory / "nodes.json").read_text()),
            "jobs": jobs,
        }

    def routing(self) -> RoutingTable | None:
        """The latest routing table."""
        if self.url is None:
            return self.store.load()
        raw = self.topology()["routing"]
        return RoutingTable.from_json(json.dumps(raw)) if raw is not None else None

    def jobs(self) -> dict:
        """Job name -> its ``inputs`` (channel -> key field), ``types`` and ``nodes``."""
        if self.url is None:
            try:
                return json.loads((self.directory / "jobs.json").read_text())
            except FileNotFoundError:
                raise LookupError(f"no stretch cluster at {self.address}") from None
        return self.topology()["jobs"]

    def locations(self) -> dict[str, str]:
        if self.url is None:
            self._locations = json.loads((self.directory / "nodes.json").read_text())
        else:
            self._locations = self.topology()["nodes"]
        return self._locations

    def members(self) -> Members:
        """The cluster's broadcast membership now (``members.json``, or the driver's answer)."""
        if self.url is None:
            return Members.load(self.directory)
        raw = self.topology().get("members")
        if raw is None:
            raise LookupError(f"the cluster at {self.address} has no broadcast membership")
        return Members(int(raw["version"]), tuple(raw["nodes"]))

    # ---- calls ----------------------------------------------------------------------------------
    def client(self, node: str) -> flight.FlightClient:
        c = self._clients.get(node)
        if c is None:
            location = self._locations.get(node) or self.locations().get(node)
            if location is None:
                raise LookupError(f"cluster at {self.address} has no node {node!r}")
            c = self._clients[node] = flight.FlightClient(location, **self._tls_options)
        return c

    def action(self, node: str, kind: str, body: bytes | dict = b"") -> dict:
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        with self._reaching(node):
            (result,) = list(self.client(node).do_action(flight.Action(kind, raw), self.options))
        return json.loads(result.body.to_pybytes())

    def put(self, node: str, command: dict, table: pa.Table) -> None:
        descriptor = flight.FlightDescriptor.for_command(json.dumps(command).encode())
        with self._reaching(node):
            writer, _ = self.client(node).do_put(descriptor, table.schema, self.options)
            try:
                writer.write_table(table)
            finally:
                writer.close()

    def get(self, node: str, ticket: str) -> pa.Table:
        with self._reaching(node):
            return self.client(node).do_get(flight.Ticket(ticket.encode()), self.options).read_all()

    @contextlib.contextmanager
    def _reaching(self, node: str):
        """A call to a node that does not answer raises NodeUnreachable, naming the node."""
        try:
            yield
        except NodeUnreachable:
            raise
        except flight.FlightUnavailableError as e:
            where = self._locations.get(node, "?")
            raise NodeUnreachable(
                f"node {node} of the cluster at {self.address} ({where}) does not answer: its process "
                f"ended or its host is unreachable ({str(e).splitlines()[0]})"
            ) from None

    def driver(self) -> flight.FlightClient:
        """A client of the cluster's driver (``cluster.url``, or ``driver.json`` in its directory)."""
        if self._driver is None:
            location = self.url
            if location is None:
                try:
                    location = json.loads((self.directory / "driver.json").read_text())["location"]
                except FileNotFoundError:
                    raise LookupError(f"the cluster at {self.directory} has no running driver") from None
            self._driver = flight.FlightClient(location, **self._tls_options)
        return self._driver

    def driver_action(self, kind: str, body: dict | None = None) -> dict:
        """Ask the cluster's driver: a node change (``add_node``, ``remove_node``), the
        ``topology``, or a removed node's ``output`` log."""
        raw = json.dumps(body or {}).encode()
        (result,) = list(self.driver().do_action(flight.Action(kind, raw), self.options))
        return json.loads(result.body.to_pybytes())

    def driver_get(self, ticket: str) -> pa.Table:
        return self.driver().do_get(flight.Ticket(ticket.encode()), self.options).read_all()

    # ---- output logs, for readers on other hosts (see cluster.output_logs) --------------------
    def output_info(self, node: str, job: str, channel: str) -> dict:
        """Offsets and schema of node ``node``'s log of ``job``'s output ``channel``: from the node,
        or from the driver for a node that was removed."""
        body = {"job": f"{job}@{node}", "channel": channel}
        if node in self.locations():
            return self.action(node, "output", body)
        return self.driver_action("output", body)

    def output_range(self, node: str, job: str, channel: str, start: int, end: int) -> pa.Table:
        """Batches ``start`` .. ``end`` of that log."""
        body = {"job": f"{job}@{node}", "channel": channel, "start": start, "end": end}
        ticket = "output:" + json.dumps(body)
        if node in self.locations():
            return self.get(node, ticket)
        return self.driver_get(ticket)

    def forget(self, node: str) -> None:
        c = self._clients.pop(node, None)
        if c is not None:
            c.close()

    def close(self) -> None:
        for node in list(self._clients):
            self.forget(node)
        if self._driver is not None:
            self._driver.close()
            self._driver = None

    def __enter__(self) -> ClusterConnection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def job_nodes(
    address: str | Path, job: str, secret: str | None = None, tls: ClusterTLS | None = None
) -> list[str]:
    """The nodes job ``job`` ran on, in the order they joined (removed nodes too: their output
    logs stay readable); each runs it as ``<job>@<node>``. ``address``, ``secret``, ``tls``: as
    for ClusterConnection."""
    with ClusterConnection(address, secret, tls) as connection:
        jobs = connection.jobs()
    nodes = jobs.get(job, {}).get("nodes")
    if not nodes:
        raise LookupError(f"the cluster at {address} runs no job {job!r} (jobs: {sorted(jobs)})")
    return nodes


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
