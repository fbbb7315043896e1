"""The cluster's directory: the files that make its address on its own host.

The driver writes them; writers, readers and the CLI in other processes of the host read them by
the directory's path (the cluster's ``address``), and the driver answers the same for callers on
other hosts (``topology``). Each file is replaced whole (written aside, then renamed), so a reader
sees one version or the next, never half of one.

- ``routing.json``: the routing table (cluster.routing.RoutingStore);
- ``nodes.json``: node id -> Flight location of the nodes now;
- ``jobs.json``: job name -> its input channels' keys and types, the nodes it ran on and where
  their output logs start, and, for a checkpointed job, its spec under ``jobs/``;
- ``members.json``: the broadcast membership (client.Members);
- ``driver.json``: where the driver listens; ``secret`` (owner-only); ``tls.json``: TLS paths;
- ``handoff.json``: the handoff step under way (a restarted driver finds where key groups were);
- ``staging/``: where Spark's executors stage a micro-batch for the driver's commit.
"""

from __future__ import annotations

import json
from pathlib import Path

from stretch.cluster.routing import RoutingStore

NODES = "nodes.json"
JOBS = "jobs.json"
MEMBERS = "members.json"
DRIVER = "driver.json"
SECRET = "secret"
TLS = "tls.json"
HANDOFF = "handoff.json"


class ClusterDirectory:
    """The files of a cluster's directory (see the module's docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.store = RoutingStore(self.path)

    def write(self, name: str, value) -> None:
        """Replace file ``name`` with ``value`` as JSON, whole."""
        self.write_text(name, json.dumps(value))

    def write_text(self, name: str, text: str) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(self.path / name)

    def read(self, name: str, default=None):
        """File ``name`` as JSON, ``default`` if there is none."""
        try:
            return json.loads((self.path / name).read_text())
        except FileNotFoundError:
            return default

    def jobs(self) -> dict:
        """``jobs.json``: LookupError if the directory holds no cluster."""
        jobs = self.read(JOBS)
        if jobs is None:
            raise LookupError(f"no stretch cluster at {self.path}")
        return jobs

    def secret(self) -> str:
        try:
            return (self.path / SECRET).read_text().strip()
        except FileNotFoundError:
            raise LookupError(f"no stretch cluster at {self.path}") from None

    def write_secret(self, secret: str) -> None:
        path = self.path / SECRET
        path.touch(mode=0o600)
        path.write_text(secret)

    def topology(self) -> dict:
        """The routing table, the nodes' locations, the jobs (inputs, types, nodes)
        and the broadcast membership, as they are now: what the driver answers callers by URL
        (a job's spec and checkpoint interval stay here)."""
        table = self.store.load()
        jobs = self.read(JOBS, {})
        for entry in jobs.values():
            entry.pop("spec", None)
            entry.pop("interval_ms", None)
        return {
            "routing": json.loads(table.to_json()) if table is not None else None,
            "nodes": self.read(NODES, {}),
            "jobs": jobs,
            "members": self.read(MEMBERS),
        }
