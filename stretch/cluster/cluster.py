"""A stretch cluster: nodes that each run the engine for their key groups, and the routing table.

>>> cluster = StretchCluster.local(nodes=2)            # node processes on this machine
>>> client = env.execute_async("counts", cluster=cluster)
>>> with client.writer("in") as w: w.write(batch)      # each row to the node owning its key group
>>> report = cluster.add_node()                        # HandoffReport: ~1/3 of the key groups move
>>> cluster.close()

The cluster's address is its directory (cluster.directory: the routing table, the nodes'
endpoints, the jobs, the secret); a writer in another process of this host opens it by that path.
The driver keeps the routing table there, so it survives the driver's restart. From other hosts
the cluster's address is its driver's URL (``cluster.url``), with its secret (``cluster.secret``):
the driver answers over Flight what the directory's files hold (cluster.driver); nodes and driver
then bind beyond loopback (``host``, see cluster.addresses).

``StretchCluster`` is the face the user holds; each of the driver's concerns is a module of its
own, which it composes: which nodes make the cluster (cluster.membership), key groups moving
between them (cluster.handoff), the jobs it runs (cluster.job_registry), checkpoints and nodes
that die (cluster.failover), and what it answers callers by URL (cluster.driver).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

from stretch.cluster import recovery
from stretch.cluster.addresses import LOOPBACK
from stretch.cluster.client import ClusterConnection
from stretch.cluster.directory import DRIVER, JOBS, NODES, TLS, ClusterDirectory
from stretch.cluster.driver import DriverServer
from stretch.cluster.elasticity import NodeElasticity
from stretch.cluster.failover import Failover
from stretch.cluster.forward_ends import ForwardEnds
from stretch.cluster.handoff import Handoff, HandoffReport
from stretch.cluster.job_client import ClusterJobClient
from stretch.cluster.job_registry import JobRegistry
from stretch.cluster.launchers import LocalNodes, SparkNodes
from stretch.cluster.membership import Membership
from stretch.cluster.rekey_plans import split_rekeys
from stretch.cluster.routing import RoutingTable, plan_add_node, plan_remove_node
from stretch.cluster.source_plans import split_sources
from stretch.cluster.sources import ClusterSources
from stretch.cluster.spark_workers import check_workers
from stretch.cluster.tls import ClusterTLS
from stretch.cluster.ui_source import ClusterJobs
from stretch.cluster.writer import ClusterWriter
from stretch.state.key_groups import DEFAULT_MAX_PARALLELISM
from stretch.ui.config import UIConfig
from stretch.ui.server import UIServer


class StretchCluster:
    """A cluster of stretch nodes (on this host, or in Spark's executors), driven from this process: jobs run on it
    (``env.execute_async(name, cluster=...)``), nodes are added and removed live (their key groups
    move with their state), and ``enable_elasticity`` lets it size itself by load."""

    def __init__(
        self,
        directory: Path,
        max_parallelism: int,
        step: int,
        owns_directory: bool,
        launcher=None,
        tls=None,
        checkpoint_dir: Path | None = None,
        host: str = LOOPBACK,
    ):
        self.directory = directory
        self.files = ClusterDirectory(directory)
        self.store = self.files.store
        self.host = host
        self.checkpoint_dir = checkpoint_dir
        self.tls: ClusterTLS | None = tls
        self.launcher = launcher if launcher is not None else LocalNodes()
        self.max_parallelism = max_parallelism
        self.step = step
        self._owns_directory = owns_directory
        self._secret = ""
        self.table: RoutingTable | None = None
        self.connection: ClusterConnection | None = None
        self.membership = Membership(self)
        self.handoff = Handoff(self)
        self.jobs = JobRegistry(self)
        self.failover = Failover(self)
        self._driver: DriverServer | None = None
        self._elasticity: NodeElasticity | None = None
        self.closed = False
        self.started = False  # the driver makes node changes only once the cluster has started
        self.stopping = threading.Event()  # the cluster's threads end when it is set
        self._writers: weakref.WeakSet[ClusterWriter] = weakref.WeakSet()  # closed with the cluster
        self._ui = None  # the cluster's web page (ui=), served from this process
        self._step_hook = None  # tests: called at each point of a move (see handoff.Handoff)
        self.sources = ClusterSources(self)  # the jobs' sources that are not channels (cluster.sources)
        self.forwards = ForwardEnds(self)  # the ends of jobs' re-keying edges (cluster.forward_ends)

    # ---- creation -------------------------------------------------------------------------------
    @classmethod
    def local(
        cls,
        nodes: int = 2,
        directory: str | os.PathLike | None = None,
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
        step: int = 8,
        tls: ClusterTLS | None = None,
        private_shm_mb: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        host: str = LOOPBACK,
        ui=False,
    ) -> StretchCluster:
        """``nodes`` node processes on this machine (the default for laptops and tests).

        ``directory`` holds the cluster's routing table; given one that a previous driver used,
        the cluster goes on from the routing version stored there (with fresh, empty nodes).
        ``step``: the most key groups moved per routing version during a node change (fewer
        where their state is large: a step moves about ``STEP_BYTES``). ``tls``: mutual TLS
        between every node, the driver and every writer (see cluster.tls). ``private_shm_mb``: each
        node in a mount namespace of its own with a private ``/dev/shm`` of that size (needs root),
        so that nodes share nothing by accident, as on separate hosts. ``checkpoint_dir``: where
        nodes checkpoint their key groups and journal what they take, readable by every node, so
        that checkpointed jobs run on the cluster and a node that dies is restored on the others
        (see cluster.recovery). ``host``: the interface nodes and the driver listen on, loopback
        by default; another (an IP of this machine, or ``"0.0.0.0"``) lets other hosts write and
        read by ``cluster.url`` with ``cluster.secret`` (every call still needs the secret; over
        a network, TLS is advised). ``ui``: serve the cluster's web page from this process (True,
        a port, or a ``stretch.ui.UIConfig``; see ``ui_url``).
        """
        owns = directory is None
        path = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="stretch-cluster-"))
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        checkpoints = _checkpoint_path(checkpoint_dir)
        launcher = LocalNodes(private_shm_mb, str(checkpoints) if checkpoints else None, host)
        cluster = cls(
            path, max_parallelism, step, owns, launcher, tls=tls, checkpoint_dir=checkpoints, host=host
        )
        try:
            cluster._begin(nodes)
            if ui is not False:
                cluster._serve_ui(ui)
        except BaseException:
            cluster.close()
            raise
        return cluster

    @classmethod
    def on_spark(
        cls,
        spark,
        nodes: int = 2,
        directory: str | os.PathLike | None = None,
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
        step: int = 8,
        tls: ClusterTLS | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        host: str = LOOPBACK,
        ui=False,
    ) -> StretchCluster:
        """``nodes`` nodes, each a long-running task of a Spark job of ``spark``'s context,
        holding one task slot for as long as it runs (as Ray on Spark does); leave task slots
        free for the queries that write into the cluster.

        ``host``: the interface nodes and the driver listen on. The default, loopback, keeps
        everything on this host (executors must run here). With ``"0.0.0.0"`` each node listens
        on every interface of its executor and advertises the executor's address (Spark's
        ``SPARK_LOCAL_IP``, else the machine's), and the driver on this machine's: executors may
        then run on other hosts, and queries write and read by ``cluster.url`` with
        ``cluster.secret`` (over a network, TLS is advised). ``checkpoint_dir`` (see ``local``;
        every node must reach it): by default ``stretch-cluster`` inside Spark's checkpoint
        location (``spark.sql.streaming.checkpointLocation``) when one is set. ``ui``: as
        ``local``'s."""
        check_workers(spark)
        owns = directory is None
        path = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="stretch-cluster-"))
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        checkpoints = _checkpoint_path(
            checkpoint_dir if checkpoint_dir is not None else spark_checkpoint_dir(spark)
        )
        launcher = SparkNodes(spark, checkpoint_dir=str(checkpoints) if checkpoints else None, host=host)
        cluster = cls(
            path, max_parallelism, step, owns, launcher, tls=tls, checkpoint_dir=checkpoints, host=host
        )
        try:
            cluster._begin(nodes)
            if ui is not False:
                cluster._serve_ui(ui)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _begin(self, nodes: int) -> None:
        self._secret = secrets.token_hex(32)
        self.files.write_secret(self._secret)
        self._serve()  # first: nodes started in Spark executors announce themselves to it
        stored = self.store.load()
        resumed = self.jobs.stored() if stored is not None and self.checkpoint_dir is not None else {}
        if stored is not None and stored.max_parallelism != self.max_parallelism:
            raise ValueError(
                f"the routing table in {self.directory} has {stored.max_parallelism} key groups, "
                f"not {self.max_parallelism}"
            )
        if resumed:
            if self.tls is not None:
                self.files.write_text(TLS, self.tls.to_json())
            self.files.write(NODES, {})
            self.connection = ClusterConnection(self.directory)
            self.failover.resume(stored, resumed)
            self.sources.resume(list(resumed))
            return
        self.files.write(JOBS, {})
        self.files.write(NODES, {})
        if self.tls is not None:
            self.files.write_text(TLS, self.tls.to_json())
        (self.directory / "staging").mkdir(mode=0o700, exist_ok=True)  # Spark executors stage here
        self.connection = ClusterConnection(self.directory)
        ids = stored.nodes if stored is not None else [f"node-{i}" for i in range(nodes)]
        self.membership.number_after(ids)
        self.membership.start_all(ids)
        self.table = stored if stored is not None else RoutingTable.initial(ids, self.max_parallelism)
        if stored is None:
            self.store.save(self.table)
        self.membership.publish(ids)  # the nodes that take broadcast rows
        for node_id in ids:
            self._own(node_id)
        self.started = True

    def _serve(self) -> None:
        self._driver = DriverServer(self, self._secret, host=self.host, tls=self.tls)
        threading.Thread(target=self._driver.serve, name="stretch-cluster-driver", daemon=True).start()
        if hasattr(self.launcher, "driver"):
            self.launcher.driver = self._driver
        self.files.write(DRIVER, {"location": self._driver.location})

    def _serve_ui(self, ui) -> None:
        """The cluster's page, with the cluster's secret for changes and, with TLS, its
        certificate for HTTPS."""
        config = dataclasses.replace(UIConfig.of(ui), secret=self._secret)
        if self.tls is not None and config.certfile is None:
            config = dataclasses.replace(config, certfile=self.tls.cert_chain, keyfile=self.tls.private_key)
        self._ui = UIServer([ClusterJobs(ClusterConnection(self.directory))], config).start()

    @property
    def ui_url(self) -> str | None:
        """The cluster's web page with its secret (which lets a browser rescale); None without
        ``ui=``."""
        return self._ui.url if self._ui is not None else None

    def start_node(self, node_id: str, jobs: dict[str, bytes] | None = None) -> None:
        """Start a node running the cluster's jobs (or ``jobs``)."""
        self.membership.start(node_id)
        self.jobs.start_all(node_id, jobs)

    def _own(self, node_id: str) -> None:
        """Tell a node the key groups it owns in the current routing table."""
        body = {
            "version": self.table.version,
            "key_groups": self.table.key_groups_of(node_id),
            "max_parallelism": self.max_parallelism,
        }
        self.connection.action(node_id, "own", body)

    def hook(self, point: str, src: str, dst: str) -> None:
        """Tests: called at each point of a move, a recovery and a collection (``_step_hook``)."""
        if self._step_hook is not None:
            self._step_hook(point, src, dst)

    def changing(self):
        """One node change, checkpoint or recovery at a time (the CLI's, by the driver, too)."""
        return self._driver.changing if self._driver is not None else contextlib.nullcontext()

    # ---- what it is -----------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """Where writers and readers in other processes of this host find the cluster."""
        return str(self.directory)

    @property
    def url(self) -> str:
        """The driver's endpoint (``grpc://host:port``, ``grpc+tls://`` with TLS): the cluster's
        address for writers and readers anywhere, with ``secret``; reachable from other hosts
        when the cluster binds beyond loopback (``host``)."""
        if self._driver is None:
            raise LookupError("the cluster has no driver endpoint (it is closed, or did not start)")
        return self._driver.location

    @property
    def secret(self) -> str:
        """The cluster's secret: every call to its nodes and driver must carry it (give it to the
        writers and readers that use ``url``)."""
        return self._secret

    def topology(self) -> dict:
        """The routing table, the nodes' locations, the jobs (inputs, types, nodes) and the
        broadcast membership, as the driver answers them to callers by URL (the directory's files,
        read as they are now)."""
        return self.files.topology()

    @property
    def nodes(self) -> list[str]:
        """The ids of the cluster's nodes now, in the order they joined."""
        return self.membership.nodes

    def status(self) -> dict:
        """Each node's routing version, key groups and jobs."""
        return {n: self.connection.action(n, "status") for n in self.nodes}

    @property
    def failures(self) -> dict[str, dict]:
        """Job -> the node it failed on, and how (a job that fails on one node fails on all)."""
        return self.jobs.failures

    @property
    def recoveries(self) -> list[dict]:
        """One report per node failure: which nodes, key groups, rows replayed."""
        return self.failover.recoveries

    @property
    def supervisor_errors(self) -> list[BaseException]:
        return self.failover.errors

    # ---- jobs -----------------------------------------------------------------------------------
    def submit(self, plan, name: str, config) -> ClusterJobClient:
        """Run a job on every node (what ``env.execute_async(name, cluster=cluster)`` does)."""
        self._check_open()
        plan, feeds = split_sources(plan)  # its other sources: read into channels of their own
        # re-keying: node to node (a checkpointed job's through logs its checkpoints commit)
        plan, forwards = split_rekeys(plan, self.reach(name), logged=bool(config.checkpointing))
        if self.jobs.submit(plan, name, config):
            self.failover.supervise()
        self.forwards.add(name, forwards)  # before its sources' rows come
        self.sources.start(name, feeds, bool(config.checkpointing))
        return ClusterJobClient(self, name)

    def reach(self, job: str) -> dict:
        """How a node's writers reach the cluster for ``job``: its directory where every node is
        on this host (they send through shared memory where they can), else its URL."""
        return {
            "job": job,
            "address": str(self.address) if isinstance(self.launcher, LocalNodes) else self.url,
            "secret": self.secret,
            "tls": self.tls.to_json() if self.tls is not None else None,
        }

    def job(self, name: str) -> ClusterJobClient:
        """The client of a job the cluster runs (one a restarted driver resumed, too)."""
        if name not in self.jobs.specs:
            raise LookupError(f"the cluster runs no job {name!r} (jobs: {sorted(self.jobs.specs)})")
        return ClusterJobClient(self, name)

    def writer(self, job: str, channel: str, key=None) -> ClusterWriter:
        """A writer into input channel ``channel`` of job ``job`` on every node: each row goes to the
        node owning its key group (``key``: the field, by default the one the job keys by)."""
        self._check_open()
        writer = ClusterWriter(self.address, job, channel, key)
        self._writers.add(writer)
        return writer

    # ---- checkpoints ----------------------------------------------------------------------------
    def checkpoint(self) -> dict[str, dict]:
        """Every node checkpoints its key groups of the checkpointed jobs into the checkpoint
        directory now (their outputs commit there); each node's report (path, bytes, duration_ms)."""
        return self.failover.checkpoint()

    # ---- node changes ---------------------------------------------------------------------------
    def enable_elasticity(
        self, policy=None, min_nodes: int = 1, max_nodes: int = 4, interval_ms: int = 1000
    ) -> NodeElasticity:
        """Add and remove nodes by load (see cluster.elasticity): ``policy`` is any object with
        ``decide(load) -> int`` (default ``ThresholdPolicy()``), here deciding a node count."""
        if self._elasticity is not None:
            raise ValueError("the cluster's elasticity is enabled already")
        self._elasticity = NodeElasticity(self, policy, min_nodes, max_nodes, interval_ms)
        return self._elasticity

    def add_node(self) -> HandoffReport:
        """Start a node and give it its share of key groups, moving the fewest."""
        self._check_open()
        if self._driver is not None:
            with self._driver.changing:  # one node change at a time (the CLI's too)
                return self._add_node()
        return self._add_node()

    def _add_node(self) -> HandoffReport:
        node_id = self.membership.new_id()
        try:
            self.membership.join(node_id)
            self.connection.action(
                node_id,
                "own",
                {"version": self.table.version, "key_groups": [], "max_parallelism": self.max_parallelism},
            )
            return self.handoff.run(plan_add_node(self.table, node_id))
        except BaseException:
            if not self.table.key_groups_of(node_id):  # it got nothing: as if it was never added
                self._withdraw(node_id)
            raise

    def _withdraw(self, node_id: str) -> None:
        """Take a node that holds no key group out of the cluster again, and stop it."""
        with contextlib.suppress(Exception):
            self.sources.leaving(node_id)
        with contextlib.suppress(Exception):
            self.membership.leave(node_id)
        if node_id in self.nodes:
            self.membership.stop(node_id)
        else:
            self.launcher.stop(node_id)  # it failed to start, or died: reaped all the same

    def remove_node(self, node: str) -> HandoffReport:
        """Hand a node's key groups to the others, then stop it."""
        self._check_open()
        if self._driver is not None:
            with self._driver.changing:
                return self._remove_node(node)
        return self._remove_node(node)

    def _remove_node(self, node: str) -> HandoffReport:
        if len(self.nodes) == 1 and node in self.nodes:
            raise ValueError(f"{node!r} is the cluster's last node: its key groups would have nowhere to go")
        if node not in self.nodes:
            raise LookupError(f"no node {node!r} in the cluster (nodes: {self.nodes})")
        self.sources.leaving(node)  # its source readers give their splits back
        report = self.handoff.run(plan_remove_node(self.table, node))
        self.membership.leave(node)
        self.connection.action(node, "retire")
        self.membership.stop(node)
        self.failover.collect_garbage()  # its journal: its key groups' new owners journal them now
        return report

    # ---- the end --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        """A closed cluster has no nodes, directory or driver left: say so, start nothing."""
        if self.closed:
            raise RuntimeError(f"the stretch cluster at {self.directory} is closed")

    def close(self) -> None:
        """Stop every node (cancelling the jobs still running) and remove what the cluster made."""
        if self.closed:
            return
        self.closed = True
        self.stopping.set()
        if self._ui is not None:
            self._ui.stop()
        self.sources.close()
        self.failover.join(30)
        self.jobs.join(30)
        self.forwards.join(30)
        if self._elasticity is not None:
            self._elasticity.stop()
        if self._driver is not None:
            self._driver.shutdown()
            (self.directory / DRIVER).unlink(missing_ok=True)
        if self.jobs.specs and self.checkpoint_dir is not None and self.started:
            self.jobs.forget_specs()  # closed after it started, not died nor failed to: nothing to resume
        for writer in list(self._writers):  # their shared-memory segments go too
            writer.close()
        self.membership.stop_all()
        if self.checkpoint_dir is not None and self.started:
            # closed after it started (not a start that failed): nothing resumes it, its files go
            recovery.collect_garbage(self.checkpoint_dir, [])
        if self.connection is not None:
            self.connection.close()
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> StretchCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _checkpoint_path(directory: str | os.PathLike | None) -> Path | None:
    if directory is None:
        return None
    path = Path(directory).resolve()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def spark_checkpoint_dir(spark) -> Path | None:
    """``stretch-cluster`` inside Spark's checkpoint location, if the session sets one."""
    location_ = spark.conf.get("spark.sql.streaming.checkpointLocation", None)
    if not location_:
        return None
    return Path(location_.removeprefix("file://").removeprefix("file:")) / "stretch-cluster"
