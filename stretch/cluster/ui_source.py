"""The UI's view of a cluster: its nodes, the key-group -> node map, node changes under way and
done, and each node's jobs (shown and rescaled per node, as ``ClusterJobClient.rescale`` does)."""

from __future__ import annotations

from pyarrow import flight

from stretch.cluster.client import ClusterConnection
from stretch.ui.sources import Refused


class ClusterJobs:
    """A cluster reached by ``connection`` (its directory, or its driver's URL and secret)."""

    is_cluster = True

    def __init__(self, connection: ClusterConnection):
        self.connection = connection

    def _node_statuses(self) -> dict[str, dict]:
        found = {}
        for node in self.connection.locations():
            try:
                found[node] = self.connection.action(node, "status")
            except (flight.FlightError, OSError):
                continue  # a node that died or left: the cluster's own failover deals with it
        return found

    def statuses(self) -> dict[str, dict]:
        return {
            f"{node}/{name}": {**describe, "where": node}
            for node, status in self._node_statuses().items()
            for name, describe in status["jobs"].items()
            if describe.get("ok", True)
        }

    def rescale(self, key: str, operator: str, parallelism: int) -> dict:
        node, _, job = key.partition("/")
        body = {"job": job, "operator": operator, "parallelism": parallelism, "timeout": None}
        try:
            return self.connection.action(node, "rescale", body)
        except flight.FlightError as e:
            raise Refused(str(e).splitlines()[0]) from None

    def close(self) -> None:
        self.connection.close()

    def cluster(self) -> dict:
        table = self.connection.routing()
        locations = self.connection.locations()
        statuses = self._node_statuses()
        try:
            changes = self.connection.driver_action("handoff")
        except (LookupError, flight.FlightError):
            changes = {"progress": None, "in_flight": None, "reports": []}  # no driver to ask
        nodes = [
            {
                "node": node,
                "location": location,
                "key_groups": len(table.key_groups_of(node)) if table else 0,
                "jobs": {
                    name: job.get("status") for name, job in statuses.get(node, {}).get("jobs", {}).items()
                },
                "answers": node in statuses,
            }
            for node, location in locations.items()
        ]
        return {
            "address": self.connection.address,
            "version": table.version if table else None,
            "owners": list(table.owners) if table else [],
            "nodes": nodes,
            "handoff": changes["in_flight"],
            "progress": changes["progress"],
            "changes": changes["reports"],
        }
