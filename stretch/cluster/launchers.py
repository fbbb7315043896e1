"""Where node processes run: on this machine (``LocalNodes``) or inside Spark executors
(``SparkNodes``, one long-running Spark task per node, as Ray on Spark runs its nodes).

A launcher starts ``python -m``-style node processes with the cluster's secret in their
environment, bound to the cluster's ``host``, and answers each node's Flight location (the address
peers dial: see cluster.addresses); ``stop`` waits for a node that was told to shut down, and ends
it if it does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from pyarrow import flight

import stretch
from stretch import _shm as shm
from stretch.cluster.addresses import LOOPBACK, advertised_host
from stretch.cluster.protocol import SECRET_ENV, call_options
from stretch.cluster.tls import TLS_ENV, ClusterTLS, location

NODE_COMMAND = "from stretch.cluster.node import main; main()"


def node_environment(secret: str, tls: ClusterTLS | None = None) -> dict:
    """The environment of a node process: the secret (and TLS paths), and this stretch first on
    its path."""
    env = dict(os.environ)
    env[SECRET_ENV] = secret
    if tls is not None:
        env[TLS_ENV] = tls.to_json()
    root = str(Path(stretch.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, os.getcwd(), *filter(None, [env.get("PYTHONPATH")])])
    return env


def spawn_node(
    node_id: str,
    secret: str,
    tls: ClusterTLS | None = None,
    private_shm_mb: int | None = None,
    checkpoint_dir: str | None = None,
    host: str = LOOPBACK,
) -> tuple[subprocess.Popen, int]:
    """Start one node process listening on ``host``; returns it and its port. ``private_shm_mb``:
    run it in a mount namespace of its own with a private ``/dev/shm`` of that size (``unshare
    -m``; needs root), as a node on another host would be: nothing can be shared with it by accident."""
    command = [sys.executable, "-c", NODE_COMMAND, "--node-id", node_id, "--host", host]
    if checkpoint_dir is not None:
        command += ["--checkpoint-dir", str(checkpoint_dir)]
    if private_shm_mb is not None:
        mount = f'mount -t tmpfs -o size={int(private_shm_mb)}m tmpfs /dev/shm && exec "$0" "$@"'
        command = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, *command]
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        env=node_environment(secret, tls),
    )
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"stretch node {node_id} did not start (exit code {proc.returncode})")
    return proc, json.loads(line)["port"]


def reap(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Wait for a node process to end, then remove the shared memory its jobs left: a node killed
    (SIGKILL, out of memory) never unlinked its segments, which would stay in /dev/shm for good."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    shm.unlink_prefix(f"{shm.PREFIX}-{os.getuid()}-{proc.pid}")


class LocalNodes:
    """Node processes that are children of this (the driver's) process; ``private_shm_mb``: each
    with a private ``/dev/shm`` (see spawn_node)."""

    def __init__(
        self, private_shm_mb: int | None = None, checkpoint_dir: str | None = None, host: str = LOOPBACK
    ):
        self._procs: dict[str, subprocess.Popen] = {}
        self.private_shm_mb = private_shm_mb
        self.checkpoint_dir = checkpoint_dir
        self.host = host

    def pids(self) -> dict[str, int]:
        return {node: proc.pid for node, proc in self._procs.items()}

    def start(self, node_id: str, secret: str, tls: ClusterTLS | None = None) -> str:
        proc, port = spawn_node(node_id, secret, tls, self.private_shm_mb, self.checkpoint_dir, self.host)
        self._procs[node_id] = proc
        return location(advertised_host(self.host), port, tls)

    def alive(self, node_id: str) -> bool:
        proc = self._procs.get(node_id)
        return proc is not None and proc.poll() is None

    def stop(self, node_id: str) -> None:
        proc = self._procs.pop(node_id, None)
        if proc is not None:
            reap(proc)


def _run_node_task(
    node_id: str,
    secret: str,
    driver: str,
    tls: ClusterTLS | None,
    checkpoint_dir: str | None = None,
    host: str = LOOPBACK,
):
    """The body of a node's Spark task: run the node until it is shut down (or the task is
    killed), after telling the driver (its Flight endpoint ``driver``) where it listens: this
    executor's address (see cluster.addresses) and the node's port."""

    def run(_partition):
        proc, port = spawn_node(node_id, secret, tls, checkpoint_dir=checkpoint_dir, host=host)
        try:
            body = json.dumps({"node": node_id, "location": location(advertised_host(host), port, tls)})
            options = call_options(secret)
            with flight.FlightClient(driver, **(tls.client_options() if tls is not None else {})) as c:
                list(c.do_action(flight.Action("node_up", body.encode()), options))
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
            reap(proc)
        yield node_id

    return run


class SparkNodes:
    """Each node is one long-running task of its own Spark job, holding one task slot of an
    executor (the Ray-on-Spark pattern): adding a node starts another such job, removing one
    shuts the node down and its task ends. A node tells the cluster's driver where it listens
    (action ``node_up``), so executors may run on other hosts when the cluster binds beyond
    loopback (``host``)."""

    def __init__(
        self, spark, start_timeout: float = 300, checkpoint_dir: str | None = None, host: str = LOOPBACK
    ):
        self.spark = spark
        self.checkpoint_dir = checkpoint_dir
        self.host = host
        self.start_timeout = start_timeout
        self.driver = None  # the cluster's DriverServer, which nodes announce themselves to
        self._threads: dict[str, threading.Thread] = {}
        self._errors: dict[str, BaseException] = {}

    def start(self, node_id: str, secret: str, tls: ClusterTLS | None = None) -> str:
        sc = self.spark.sparkContext
        self.driver.forget_announced(node_id)
        task = _run_node_task(node_id, secret, self.driver.location, tls, self.checkpoint_dir, self.host)

        def job() -> None:
            try:
                sc.setJobGroup(f"stretch-node-{node_id}", f"stretch node {node_id}", interruptOnCancel=True)
                sc.parallelize([node_id], 1).mapPartitions(task).collect()
            except BaseException as e:  # the node's task failed or was cancelled
                self._errors[node_id] = e

        thread = self._threads[node_id] = threading.Thread(
            target=job, name=f"stretch-node-{node_id}", daemon=True
        )
        thread.start()
        found = self.driver.wait_announced(
            node_id, self.start_timeout, lambda: node_id in self._errors or not thread.is_alive()
        )
        if found is None:
            if node_id in self._errors or not thread.is_alive():
                raise RuntimeError(
                    f"stretch node {node_id} did not start in Spark: {self._errors.get(node_id)}"
                )
            sc.cancelJobGroup(f"stretch-node-{node_id}")
            raise RuntimeError(
                f"stretch node {node_id} did not start within {self.start_timeout} s: does Spark have a "
                "free task slot for it? (each node holds one for as long as it runs)"
            )
        return found

    def alive(self, node_id: str) -> bool:
        """A node's Spark task runs as long as its process does."""
        thread = self._threads.get(node_id)
        return thread is not None and thread.is_alive()

    def stop(self, node_id: str) -> None:
        thread = self._threads.pop(node_id, None)
        if thread is None:
            return
        thread.join(60)
        if thread.is_alive():
            self.spark.sparkContext.cancelJobGroup(f"stretch-node-{node_id}")
            thread.join(60)
        self.driver.forget_announced(node_id)
