"""The cluster driver's endpoint: what callers in other processes, and on other hosts, ask of it.

The cluster (its ``StretchCluster`` object, which starts nodes and moves key groups) lives in the
driver's process, so the driver listens too: an Arrow Flight server on the cluster's ``host``
(loopback by default), like its nodes, whose every call must carry the cluster's secret. Its
location is ``driver.json`` in the cluster's directory and, for callers on other hosts, the
cluster's URL (``cluster.url``). Actions:

- ``add_node``, ``remove_node`` (body ``{"node": id}``): a node change, answered with its
  HandoffReport; one node change runs at a time, whoever asked for it.
- ``topology``: the routing table, the nodes' locations and the jobs' input keys, types and nodes
  (what a directory's ``routing.json``, ``nodes.json`` and ``jobs.json`` hold): a writer given the
  URL routes by it and asks again when a node refuses rows (``NOT_OWNER``).
- ``node_up`` (body ``{"node", "location"}``): a node started in a Spark executor says where it
  listens.
- ``source_take``, ``source_progress``, ``source_done``, ``source_failed``: a node's reader of a
  job's file sources asks for splits and says how far it got (see cluster.sources).
- ``output`` and the ticket ``output:...`` (see cluster.output_logs): the output log of a node that
  was removed, for readers by URL (the driver reads it where it shares the node's filesystem).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

from pyarrow import flight

from stretch.cluster.addresses import LOOPBACK, advertised_host
from stretch.cluster.output_logs import output_info, output_range
from stretch.cluster.protocol import SecretCheck
from stretch.cluster.tls import ClusterTLS, location


class DriverServer(flight.FlightServerBase):
    """The actions above on ``cluster``."""

    def __init__(self, cluster, secret: str, host: str = LOOPBACK, tls: ClusterTLS | None = None):
        super().__init__(
            location(host, 0, tls),
            middleware={"secret": SecretCheck(secret)},
            **(tls.server_options() if tls is not None else {}),
        )
        self.cluster = cluster
        self.location = location(advertised_host(host), self.port, tls)
        self.changing = threading.Lock()  # the cluster holds it through every node change
        self._announced: dict[str, str] = {}
        self._announcing = threading.Condition()

    def do_action(self, context, action):
        body = json.loads(action.body.to_pybytes() or b"{}")
        if action.type == "topology":
            answer = self.cluster.topology()
        elif action.type == "node_up":
            with self._announcing:
                self._announced[body["node"]] = body["location"]
                self._announcing.notify_all()
            answer = {"ok": True}
        elif action.type == "handoff":  # the UI's: node changes under way and done
            answer = self.cluster.handoff.describe()
        elif action.type == "output":
            answer = output_info(self._output_request(body))
        elif action.type in ("add_node", "remove_node"):
            answer = self._change(action.type, body)
        elif action.type.startswith("source_"):  # a node's reader of file sources (cluster.sources)
            answer = self.cluster.sources.act(action.type, body)
        else:
            raise flight.FlightServerError(f"unknown action {action.type!r}")
        yield flight.Result(json.dumps(answer).encode())

    def _change(self, kind: str, body: dict) -> dict:
        try:
            if not self.cluster.started:
                raise LookupError("the cluster is still starting")
            report = self.cluster.add_node() if kind == "add_node" else self.cluster.remove_node(body["node"])
            return {"ok": True, **dataclasses.asdict(report)}
        except (LookupError, ValueError) as e:
            return {"ok": False, "error": str(e)}

    def do_get(self, context, ticket):
        kind, _, rest = ticket.ticket.decode().partition(":")
        if kind != "output":
            raise flight.FlightServerError(f"unknown ticket {kind!r}")
        return flight.RecordBatchStream(output_range(self._output_request(json.loads(rest))))

    def _output_request(self, msg: dict) -> dict:
        """A request for ``<job>@<node>``'s output log (a removed node's), with that run of the
        job as ``jobs.json`` recorded it."""
        name, _, node = msg["job"].rpartition("@")
        run = self.cluster.files.jobs().get(name, {}).get("runs", {}).get(node)
        return msg if run is None else {**msg, "run": run}

    def forget_announced(self, node: str) -> None:
        with self._announcing:
            self._announced.pop(node, None)

    def wait_announced(self, node: str, timeout: float, failed) -> str | None:
        """The location node ``node`` announced (``node_up``); None once ``failed()`` says its
        start failed, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._announcing:
            while node not in self._announced:
                if failed() or time.monotonic() > deadline:
                    return None
                self._announcing.wait(0.05)
            return self._announced[node]
