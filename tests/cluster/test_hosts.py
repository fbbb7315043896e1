"""A cluster used from another host: nodes and driver bound to this machine's network address
(not loopback), a writer in a separate process that has only the cluster's URL and secret (no
access to its directory, nor to this machine's /dev/shm), nodes added and removed while it writes,
a replayed micro-batch, and results and keyed state read back over Flight, all checked against a
plain-Python reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pyarrow import flight

from stretch.cli import main
from stretch.cluster import ClusterWriter, StretchCluster
from stretch.cluster.addresses import machine_address
from stretch.cluster.client import ClusterConnection
from tests.cluster.jobs import count_sum_job, reference
from tests.cluster.remote_writer import DATA

ROOT = Path(__file__).resolve().parents[2]


def network_address() -> str:
    """This machine's address on its network; 127.0.0.2 (loopback, but not the 127.0.0.1 the
    cluster binds by default) on a machine that has none."""
    try:
        return machine_address()
    except LookupError:
        return "127.0.0.2"


class RemoteWriter:
    """tests/cluster/remote_writer.py in a mount namespace of its own: the cluster's directory
    hidden under an empty tmpfs, a private /dev/shm, another working directory, only the URL
    and the secret (in its environment) to reach the cluster."""

    def __init__(self, url: str, secret: str, job: str, hidden: Path, cwd: Path):
        env = {k: v for k, v in os.environ.items() if not k.startswith("STRETCH_")}
        env.update(STRETCH_CLUSTER_SECRET=secret, PYTHONPATH=str(ROOT), STRETCH_STATE_DIR=str(cwd / "state"))
        mounts = f'mount -t tmpfs tmpfs "{hidden}" && mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"'
        command = [sys.executable, "-m", "tests.cluster.remote_writer", url, job, str(hidden)]
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", mounts, *command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=cwd,
            env=env,
            text=True,
        )
        self.hello = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the remote writer ended (exit code {self.proc.poll()})"
        return json.loads(line)

    def send(self, **command) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def ask(self, **command) -> dict:
        self.send(**command)
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send(op="quit")
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_a_writer_with_only_the_url_and_secret_writes_and_reads_across_node_changes(tmp_path):
    host = network_address()
    directory = tmp_path / "cluster"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with StretchCluster.local(nodes=2, directory=directory, host=host, private_shm_mb=64) as cluster:
        assert cluster.url.startswith(f"grpc://{host}:")
        assert all(loc.startswith(f"grpc://{host}:") for loc in cluster.connection.locations().values())
        client = count_sum_job().execute_async("hosts-job", cluster=cluster)
        writer = RemoteWriter(cluster.url, cluster.secret, "hosts-job", directory, elsewhere)
        try:
            assert writer.hello == {"sees_directory": False, "cwd": str(elsewhere)}
            writer.ask(op="write", **{"from": 0, "to": 20})
            writer.send(op="write", **{"from": 20, "to": 40})
            added = cluster.add_node()  # while the writer streams
            writer._answer()
            writer.send(op="write", **{"from": 40, "to": 60})
            removed = cluster.remove_node("node-0")
            writer._answer()
            writer.ask(op="replay", batches=[5, 25, 45, 59])  # each already taken, wherever it is now
            read = writer.ask(op="read")
            state = {r["key"]: (r["count"], r["sum"]) for r in client.query_state("counts").to_pylist()}
        finally:
            writer.close()
        assert writer.proc.returncode == 0
        assert added.key_groups_moved == 42 and removed.key_groups_moved > 0
        assert read["nodes"] == ["node-1", "node-2"]
    want = reference([r for records in DATA for r in records])
    assert state == want
    assert {r["key"]: (r["count"], r["sum"]) for r in read["state"]} == want  # read by URL
    by_key: dict[str, list[tuple[int, int]]] = {}
    for r in read["outputs"]:  # every node's results by URL, the removed node-0's through the driver
        key, count, total = r.values()
        by_key.setdefault(key, []).append((count, total))
    assert {k: max(v) for k, v in by_key.items()} == want
    for key, seen in by_key.items():  # each running count once: nothing lost, nothing twice
        assert sorted(c for c, _ in seen) == list(range(1, want[key][0] + 1)), key


def test_callers_by_url_without_the_secret_are_refused(tmp_path, monkeypatch, capsys):
    host = network_address()
    monkeypatch.delenv("STRETCH_CLUSTER_SECRET", raising=False)
    with StretchCluster.local(nodes=1, directory=tmp_path / "cluster", host=host) as cluster:
        count_sum_job().execute_async("refused-job", cluster=cluster)
        with pytest.raises(ValueError, match="needs its secret"):
            ClusterWriter(cluster.url, "refused-job", "in")
        with pytest.raises(flight.FlightUnauthenticatedError):
            ClusterWriter(cluster.url, "refused-job", "in", secret="0" * 64)
        node = cluster.connection.locations()["node-0"]
        wrong = ClusterConnection(cluster.url, secret="0" * 64)
        wrong._locations = {"node-0": node}
        with pytest.raises(flight.FlightUnauthenticatedError):
            wrong.action("node-0", "status")
        wrong.close()
        monkeypatch.setenv("STRETCH_CLUSTER_SECRET", cluster.secret)  # the right one, from the environment
        with ClusterWriter(cluster.url, "refused-job", "in") as w:
            w.write([("k", 1)])
        with ClusterConnection(cluster.url) as c:
            assert c.routing() == cluster.table
            assert main(["cluster", "status", cluster.url, "--json"]) == 0  # the CLI, by URL too
            status = json.loads(capsys.readouterr().out)
            assert (status["version"], list(status["nodes"])) == (cluster.table.version, ["node-0"])
            with pytest.raises(flight.FlightUnavailableError):  # bound to the network address only
                flight.FlightClient(node.replace(host, "127.0.0.1")).do_action(
                    flight.Action("status", b""),
                    flight.FlightCallOptions(timeout=5, headers=c.options.headers),
                ).__next__()
