"""Which nodes make the cluster: their processes (started, stopped, forgotten when they die),
their endpoints (``nodes.json``) and the broadcast membership (``members.json``, client.Members):
the nodes that take every row of a broadcast channel.

A node that joins starts the cluster's jobs; its jobs with broadcast state start from the
broadcast state a member holds, copied at a fence (``join``), before the membership names it.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor

from stretch.cluster.client import Members
from stretch.cluster.directory import MEMBERS, NODES


class Membership:
    """The nodes of ``cluster`` (a StretchCluster) and its broadcast membership."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.locations: dict[str, str] = {}  # node id -> Flight location, in the order they joined
        self.next = 0  # the number of the next node id (``node-<n>``)
        self._lock = threading.Lock()  # nodes start and stop side by side

    @property
    def nodes(self) -> list[str]:
        return list(self.locations)

    def new_id(self) -> str:
        node_id = f"node-{self.next}"
        self.next += 1
        return node_id

    def number_after(self, ids) -> None:
        """New node ids come after ``ids`` (``node-<n>``): a node id is never used twice."""
        self.next = max(
            self.next,
            1 + max((int(n.rsplit("-", 1)[1]) for n in ids if n.rsplit("-", 1)[-1].isdigit()), default=-1),
        )

    # ---- node processes ---------------------------------------------------------------------------
    def start(self, node_id: str) -> str:
        """Start a node process; its location once it listens."""
        c = self.cluster
        found = c.launcher.start(node_id, c.secret, c.tls)
        with self._lock:
            self.locations[node_id] = found
            self._publish_locations()
        return found

    def start_all(self, node_ids: list[str]) -> None:
        """Start nodes side by side (a node spends seconds importing and warming up), in
        ``node_ids``' order in ``nodes.json``."""
        with ThreadPoolExecutor(max(1, len(node_ids))) as pool:
            found = list(pool.map(self.start, node_ids))
        with self._lock:
            for node_id, location in zip(node_ids, found):
                self.locations[node_id] = self.locations.pop(node_id, location)
            self._publish_locations()

    def stop(self, node_id: str) -> None:
        """Shut a node down (its jobs cancelled) and reap its process."""
        with self._lock:
            self.locations.pop(node_id)
            self._publish_locations()
        with contextlib.suppress(Exception):
            self.cluster.connection.action(node_id, "shutdown")
        self.cluster.connection.forget(node_id)
        self.cluster.launcher.stop(node_id)

    def stop_all(self) -> None:
        """Shut every node down side by side."""
        nodes = self.nodes
        with ThreadPoolExecutor(max(1, len(nodes))) as pool:
            list(pool.map(self.stop, nodes))

    def forget(self, node_id: str) -> None:
        """A node that died: out of the cluster and of the broadcast membership (its process reaped)."""
        self.locations.pop(node_id, None)
        self.cluster.sources.lost(node_id)  # the splits its readers read go to others
        with contextlib.suppress(LookupError):  # writers of broadcast rows stop waiting for it
            members = Members.load(self.cluster.directory)
            if node_id in members.nodes:
                self.publish([n for n in members.nodes if n != node_id])
        self._publish_locations()
        self.cluster.connection.forget(node_id)
        self.cluster.launcher.stop(node_id)

    def _publish_locations(self) -> None:
        self.cluster.files.write(NODES, dict(self.locations))

    # ---- the broadcast membership -------------------------------------------------------------
    def publish(self, nodes: list[str], version: int | None = None) -> int:
        """Publish the broadcast membership, as its next version unless ``version`` is given."""
        if version is None:
            try:
                version = Members.load(self.cluster.directory).version + 1
            except LookupError:
                version = 0
        self.cluster.files.write(MEMBERS, {"version": version, "nodes": list(nodes)})
        return version

    def join(self, node_id: str) -> None:
        """Start a node that joins the cluster, its jobs with broadcast state starting from the
        broadcast state a member holds. That member is fenced first (from then on it refuses
        broadcast rows of the current membership, and parks its broadcast state as of every row it
        took before); the new node's jobs start from that state; only then is the next membership,
        with the new node, published: so every broadcast row reaches the new node exactly once,
        in the copied state or sent to it (see writer.ClusterWriter)."""
        c, jobs = self.cluster, self.cluster.jobs
        c.start_node(node_id, {n: b for n, b in jobs.specs.items() if n not in jobs.broadcast})
        members = Members.load(c.directory)
        version, nodes = members.version + 1, list(members.nodes)
        try:
            if jobs.broadcast:
                fenced = c.connection.action(nodes[0], "broadcast_fence", {"members": version})
                for name in sorted(jobs.broadcast):
                    table = c.connection.get(nodes[0], f"broadcast:{fenced['tickets'][name]}")
                    states = dict(
                        zip(table.column("operator").to_pylist(), table.column("state").to_pylist())
                    )
                    body = {"spec": jobs.specs[name], "states": states, "marks": fenced["marks"][name]}
                    joined = c.connection.action(node_id, "join", pickle.dumps({**body, "members": version}))
                    jobs.ran_on(name, {node_id: joined})
            # event time: the new node hears of the writers a member knows (cluster.node_watermarks)
            if nodes:
                c.connection.action(node_id, "watermarks_load", c.connection.action(nodes[0], "watermarks"))
            nodes.append(node_id)
        finally:  # the fenced member takes rows of this version on, the new node in it or not
            self.publish(nodes, version)

    def leave(self, node_id: str) -> None:
        """A node leaving (its key groups handed away) takes no more broadcast rows: the
        membership without it first, then the node refuses writers that still send it some."""
        members = Members.load(self.cluster.directory)
        self.publish([n for n in members.nodes if n != node_id])
        self.cluster.connection.action(node_id, "broadcast_leave")
