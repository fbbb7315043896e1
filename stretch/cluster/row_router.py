"""The one way rows reach the nodes of a cluster: what ClusterWriter, Spark's sink and the
one-query stage all send through.

A batch of a job's input channel is split by the key group of every row (the job's own key,
cluster.key_routes) and each node gets its part at once, the parts to different nodes in
parallel: through a shared-memory segment the router keeps for the node if the node sees this
host's shared memory (cluster.shm_transport), else in a Flight exchange. Either way the node
answers when it has taken the rows (and, for a stage transaction, when their results are ready,
which come back in the answer). A node refuses a part that holds a key group it does not own
(``NOT_OWNER``: the key group moved, or is moving); the router then reloads the routing table and
sends that part again, split anew, so no row is lost or sent twice.

A broadcast channel's batch is not split: every node of the broadcast membership takes it whole;
a node that knows a newer membership refuses it (``NOT_MEMBER``), and the router loads the
membership again and sends it to the nodes that have not taken it yet.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
from pyarrow import flight

from stretch.cluster.client import ClusterConnection, Members, NotOwner
from stretch.cluster.key_routes import KeyRoute
from stretch.cluster.protocol import NOT_MEMBER, NOT_OWNER
from stretch.cluster.routing import RoutingTable
from stretch.cluster.shm_transport import NO_SHM, SharedBatches

REFUSED = (flight.FlightServerError, flight.FlightUnavailableError, LookupError)


@dataclass
class NodeAnswer:
    """A node's answer to one part: ``reply`` (JSON) and, for a stage transaction, the Arrow IPC
    streams of the result parts it names (``reply["parts"]``, in order)."""

    node: str
    reply: dict
    results: list[pa.Buffer] = field(default_factory=list)


class RowRouter:
    """Sends batches of input channel ``channel`` of job ``job`` to their nodes over
    ``connection`` (retrying refused parts for ``retry_for`` seconds)."""

    def __init__(
        self,
        connection: ClusterConnection,
        job: str,
        channel: str,
        route: KeyRoute | None,
        retry_for: float = 60.0,
    ):
        self.connection = connection
        self.job, self.channel, self.route = job, channel, route
        self.retry_for = retry_for
        self.table: RoutingTable = connection.routing()
        self.refusals = 0  # parts sent again because their key groups had moved
        self.shared = SharedBatches()  # parts for nodes on this host go through shared memory
        self.members: Members | None = None  # a broadcast channel's nodes, loaded at its first write
        self._pool: ThreadPoolExecutor | None = None

    # ---- keyed channels -------------------------------------------------------------------------
    def deliver(self, batch: pa.RecordBatch, command: dict) -> list[NodeAnswer]:
        """Each row of ``batch`` to the node owning its key group; every node's answer."""
        deadline = time.monotonic() + self.retry_for
        pending = [(batch, self.route.key_groups(batch, len(self.table.owners)))]
        answers: list[NodeAnswer] = []
        while pending:
            part, kgs = pending.pop(0)
            nodes, index = np.unique(np.asarray(self.table.owners), return_inverse=True)
            owners = index[kgs]
            split = []
            for i in np.unique(owners):
                mine = owners == i
                rows = part if mine.all() else part.filter(pa.array(mine))
                split.append((str(nodes[i]), rows, kgs[mine]))
            for (_node, rows, rows_kgs), outcome in zip(split, self._each(command, split)):
                if isinstance(outcome, NodeAnswer):
                    answers.append(outcome)
                    continue
                self._refused(outcome, NOT_OWNER, deadline, "found no owner")
                self._reload()
                pending.append((rows, rows_kgs))
        return answers

    def _each(self, command: dict, split: list) -> list:
        """Send each (node, rows, _) of ``split``, in parallel when there are several; each one's
        NodeAnswer, or the exception it met."""

        def one(node: str, rows: pa.RecordBatch):
            try:
                return self.send(node, command, rows)
            except REFUSED as e:
                return e

        if len(split) == 1:
            return [one(split[0][0], split[0][1])]
        for node, _rows, _kgs in split:  # the clients, made here rather than by several threads
            try:
                self.connection.client(node)
            except LookupError:
                pass
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="stretch-rows")
        futures = [self._pool.submit(one, node, rows) for node, rows, _kgs in split]
        return [f.result() for f in futures]

    # ---- one node's part ------------------------------------------------------------------------
    def send(self, node: str, command: dict, rows: pa.RecordBatch) -> NodeAnswer:
        """One node's part: through shared memory if the node sees this host's, else over Flight."""
        staged = self.shared.stage(node, rows) if self.shared.usable(node) else None
        if staged is not None:
            try:
                reply, results = self.connection.action_with_results(
                    node, "take_shared", {**command, **staged}
                )
                return NodeAnswer(node, reply, results)
            except flight.FlightServerError as e:
                if NO_SHM not in str(e):
                    raise
                self.shared.refused(node)
        reply, results = self.connection.exchange(node, command, rows)
        return NodeAnswer(node, reply, results)

    def _refused(self, e: Exception, marker: str, deadline: float, what: str) -> None:
        """A part a node refused (``marker``: it moved on) or could not take (gone, unknown) is sent
        again after a reload, until ``deadline``; any other error is the caller's."""
        if marker not in str(e) and not isinstance(e, (flight.FlightUnavailableError, LookupError)):
            raise e
        if time.monotonic() > deadline:
            raise NotOwner(f"rows of job {self.job!r} {what} within {self.retry_for} s: {e}") from e
        self.refusals += 1

    def _reload(self) -> None:
        """The latest routing table; waits a little if it has not changed (a move under way)."""
        latest = self.connection.routing()
        if latest.version == self.table.version:
            time.sleep(0.002)
        self.table = latest
        self.connection.locations()

    # ---- broadcast channels ---------------------------------------------------------------------
    def deliver_to_every_node(self, batch: pa.RecordBatch, command: dict) -> None:
        """Rows of a broadcast channel to every node of the cluster's broadcast membership. A node
        that refuses (it knows a newer membership: a node joined, or it left) or is gone makes the
        router load the membership again and send to the nodes that have not taken the rows yet."""
        deadline = time.monotonic() + self.retry_for
        if self.members is None:
            self.members = self.connection.members()
        done: set[str] = set()
        while True:
            pending = [n for n in self.members.nodes if n not in done]
            if not pending:
                return
            for node in pending:
                try:
                    self.send(node, {**command, "members": self.members.version}, batch)
                except REFUSED as e:
                    self._refused(e, NOT_MEMBER, deadline, "did not reach every node")
                    latest = self.connection.members()
                    if latest.version == self.members.version:
                        time.sleep(0.002)
                    self.members = latest
                    self.connection.locations()
                    break
                done.add(node)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self.shared.close()
