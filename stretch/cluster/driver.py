"""The cluster driver's endpoint: node changes asked for from another process.

``stretch cluster add-node ADDRESS`` runs in a process of its own, while the cluster (its
``StretchCluster`` object, which starts nodes and moves key groups) lives in the driver's process.
The driver therefore listens too: an Arrow Flight server on loopback, like its nodes, whose every
call must carry the cluster's secret; its location is ``driver.json`` in the cluster's directory.
One node change runs at a time, whoever asked for it.
"""

from __future__ import annotations

import dataclasses
import json
import threading

from pyarrow import flight

from stretch.cluster.node import SecretCheck
from stretch.cluster.tls import ClusterTLS, location


class DriverServer(flight.FlightServerBase):
    """Actions ``add_node`` and ``remove_node`` (body: {"node": id}) on ``cluster``; each answers
    with the HandoffReport, as a JSON object."""

    def __init__(self, cluster, secret: str, host: str = "127.0.0.1", tls: ClusterTLS | None = None):
        super().__init__(
            location(host, 0, tls),
            middleware={"secret": SecretCheck(secret)},
            **(tls.server_options() if tls is not None else {}),
        )
        self.cluster = cluster
        self.location = location(host, self.port, tls)
        self.changing = threading.Lock()  # the cluster holds it through every node change

    def do_action(self, context, action):
        body = json.loads(action.body.to_pybytes() or b"{}")
        try:
            if action.type == "add_node":
                report = self.cluster.add_node()
            elif action.type == "remove_node":
                report = self.cluster.remove_node(body["node"])
            else:
                raise flight.FlightServerError(f"unknown action {action.type!r}")
            answer = {"ok": True, **dataclasses.asdict(report)}
        except (LookupError, ValueError) as e:
            answer = {"ok": False, "error": str(e)}
        yield flight.Result(json.dumps(answer).encode())
