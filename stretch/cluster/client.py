"""Talking to a cluster from any process: its connection (Flight clients of its nodes and driver,
each call carrying the cluster's secret), what it is (routing table, nodes, jobs, broadcast
membership: from its directory's files on its host, from its driver by URL elsewhere), and the
nodes a job ran on. Writers (cluster.writer) and readers (Spark's, the CLI) come through here.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from pyarrow import flight

from stretch.channels import locate_output
from stretch.cluster.addresses import is_url
from stretch.cluster.directory import MEMBERS, NODES, ClusterDirectory
from stretch.cluster.protocol import SECRET_ENV, call_options
from stretch.cluster.routing import RoutingStore, RoutingTable
from stretch.cluster.tls import TLS_ENV, ClusterTLS
from stretch.runtime.state_dir import channel_dir


@dataclass(frozen=True)
class Members:
    """The nodes that take a broadcast channel's rows (``members.json``), version ``version``: a
    node that joins is a member once it holds the broadcast state of the others."""

    version: int
    nodes: tuple[str, ...]

    @classmethod
    def load(cls, address: str | Path) -> Members:
        try:
            raw = json.loads((Path(address) / MEMBERS).read_text())
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
            self.files: ClusterDirectory | None = ClusterDirectory(self.directory)
            self.store: RoutingStore | None = self.files.store
            if not secret:
                secret = self.files.secret()
            tls = tls if tls is not None else ClusterTLS.of_cluster(self.directory)
        else:
            self.directory = self.files = self.store = None
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
        self.options = call_options(secret)
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
        self.files.jobs()  # LookupError: no cluster there
        return self.files.topology()

    def routing(self) -> RoutingTable | None:
        """The latest routing table."""
        if self.url is None:
            return self.store.load()
        raw = self.topology()["routing"]
        return RoutingTable.from_json(json.dumps(raw)) if raw is not None else None

    def jobs(self) -> dict:
        """Job name -> its ``inputs`` (channel -> key field), ``types`` and ``nodes``."""
        if self.url is None:
            return self.files.jobs()
        return self.topology()["jobs"]

    def locations(self) -> dict[str, str]:
        if self.url is None:
            self._locations = self.files.read(NODES, {})
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

    def action_with_results(self, node: str, kind: str, body: dict) -> tuple[dict, list[pa.Buffer]]:
        """An action whose answer is a JSON reply followed by binary results (Arrow IPC streams)."""
        with self._reaching(node):
            first, *rest = self.client(node).do_action(
                flight.Action(kind, json.dumps(body).encode()), self.options
            )
        return json.loads(first.body.to_pybytes()), [r.body for r in rest]

    def exchange(self, node: str, command: dict, rows: pa.RecordBatch) -> tuple[dict, list[pa.Buffer]]:
        """Rows to a node in one Flight exchange; its answer is a JSON reply followed by binary
        results (Arrow IPC streams), each a metadata message."""
        descriptor = flight.FlightDescriptor.for_command(json.dumps(command).encode())
        answer: list[pa.Buffer] = []
        with self._reaching(node):
            writer, reader = self.client(node).do_exchange(descriptor, self.options)
            try:
                writer.begin(rows.schema)
                writer.write_batch(rows)
                writer.done_writing()
                while True:
                    try:
                        chunk = reader.read_chunk()
                    except StopIteration:
                        break
                    if chunk.app_metadata is not None:
                        answer.append(chunk.app_metadata)
            finally:
                writer.close()
        return json.loads(answer[0].to_pybytes()), answer[1:]

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
        return job_runs(connection, job, address)[1]


def job_runs(connection: ClusterConnection, job: str, address: str | Path) -> tuple[dict, list[str]]:
    """The job's entry among the cluster's jobs (``node_job``, ``node_output`` read it) and
    ``job_nodes``, in one lookup."""
    jobs = connection.jobs()
    nodes = jobs.get(job, {}).get("nodes")
    if not nodes:
        raise LookupError(f"the cluster at {address} runs no job {job!r} (jobs: {sorted(jobs)})")
    return jobs[job], nodes


def node_job(entry: dict, job: str, node: str) -> str:
    """How this cluster's run of ``job`` on ``node`` is found among the host's running jobs
    (``entry``: the job's in ``jobs.json``): by the job id recorded when it started there, so
    that another cluster's job of that name on this host is never taken for it (by its name
    ``<job>@<node>`` where no run is recorded)."""
    run = entry.get("runs", {}).get(node)
    return run["job_id"] if run is not None else f"{job}@{node}"


def node_log_dir(entry: dict, job: str, node: str, channel: str) -> Path:
    """The directory of output channel ``channel``'s log of that run (as ``node_job``)."""
    kept = entry.get("runs", {}).get(node, {}).get("logs", {}).get(channel)
    return Path(kept) if kept is not None else channel_dir(f"{job}@{node}", channel, "out")


def node_output(entry: dict, job: str, node: str, channel: str) -> dict:
    """Where output channel ``channel`` of that run (as ``node_job``) is: a
    ``channels.locate_output`` answer."""
    kept = node_log_dir(entry, job, node, channel)
    return locate_output(node_job(entry, job, node), channel, kept=str(kept))
