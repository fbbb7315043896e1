"""A stretch cluster: nodes that each run the engine for their key groups, and the routing table.

>>> cluster = StretchCluster.local(nodes=2)            # node processes on this machine
>>> client = env.execute_async("counts", cluster=cluster)
>>> with client.writer("in") as w: w.write(batch)      # each row to the node owning its key group
>>> report = cluster.add_node()                        # HandoffReport: ~1/3 of the key groups move
>>> cluster.close()

The cluster's address is its directory: the routing table (``routing.json``), the nodes'
endpoints (``nodes.json``), the jobs' input keys (``jobs.json``) and the secret (``secret``,
owner-only). A writer in another process of this host opens it by that path. The driver keeps
the routing table there, so it survives the driver's restart. From other hosts the cluster's
address is its driver's URL (``cluster.url``), with its secret (``cluster.secret``): the driver
answers over Flight what the directory's files hold; nodes and driver then bind beyond loopback
(``host``, see cluster.addresses).

A node change moves the fewest key groups (``routing.plan_add_node``/``plan_remove_node``), in
steps of a few key groups (at most ``step``, and about ``STEP_BYTES`` of state), each step one
routing version: the old owner stops taking the step's key groups, lets its engine finish the
rows it took (a barrier through the keyed gates), copies their state out (Arrow IPC key-group
snapshot) and forgets it; the new owner loads it into its live arena and only then takes their
rows. Writers that meet a refusal reload the table and send
again, so a key waits at most for its own step.

Jobs with broadcast state run too: their broadcast channels go whole to every node of the
broadcast membership (``members.json``), and a node that joins starts from a member's broadcast
state, copied at a fence (see ``_start_joining`` and client.ClusterWriter).

With a checkpoint directory (``checkpoint_dir``), checkpointed jobs run too: nodes journal what
they take and checkpoint their key groups there, and a node that dies, at any point of a handoff
too, is restored on the others; a driver that dies is resumed by the next one started on the same
directories (see cluster.recovery).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from stretch.cluster import broadcast_restore, recovery
from stretch.cluster.addresses import LOOPBACK
from stretch.cluster.client import MEMBERS_FILE, ClusterConnection, ClusterWriter, Members
from stretch.cluster.driver import DriverServer
from stretch.cluster.elasticity import NodeElasticity
from stretch.cluster.job_client import ClusterJobClient
from stretch.cluster.launchers import LocalNodes, SparkNodes
from stretch.cluster.node_plans import broadcast_channels, cluster_inputs
from stretch.cluster.recovery import NodeLost
from stretch.cluster.routing import (
    RoutingStore,
    RoutingTable,
    plan_add_node,
    plan_failover,
    plan_remove_node,
    steps,
)
from stretch.cluster.source_plans import split_sources
from stretch.cluster.sources import ClusterSources
from stretch.cluster.tls import ClusterTLS
from stretch.common import user_code
from stretch.runtime.state_dir import channel_dir, job_dir_name, write_private
from stretch.state.key_groups import DEFAULT_MAX_PARALLELISM

STEP_BYTES = 4 << 20
"""About the state a handoff step moves: its key groups wait while it is copied, so a step of a
large state holds fewer key groups (at least one; a finer max parallelism makes finer steps)."""


@dataclass(frozen=True)
class HandoffReport:
    """What a node change did: ``max_stall_ms`` is the longest any key group refused rows (from
    its release by the old owner until the new owner took it)."""

    elapsed_ms: float
    key_groups_moved: int
    bytes_moved: int
    max_stall_ms: float
    version: int = 0
    steps: int = 0
    step_ms: tuple[float, ...] = ()  # each (source, target) move of each step, release to adoption


@dataclass
class _Node:
    id: str
    location: str


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
        self.host = host
        self.checkpoint_dir = checkpoint_dir
        self.tls: ClusterTLS | None = tls
        self.launcher = launcher if launcher is not None else LocalNodes()
        self.max_parallelism = max_parallelism
        self.step = step
        self._owns_directory = owns_directory
        self._nodes: dict[str, _Node] = {}
        self._jobs: dict[str, bytes] = {}  # job name -> its pickled plan and config
        self._broadcast: set[str] = set()  # the jobs with broadcast state
        self._next = 0
        self._secret = ""
        self.store = RoutingStore(directory)
        self.table: RoutingTable | None = None
        self.connection: ClusterConnection | None = None
        self._driver: DriverServer | None = None
        self._elasticity: NodeElasticity | None = None
        self.closed = False
        self.started = False  # the driver makes node changes only once the cluster has started
        self._outputs: dict[str, list[str]] = {}  # job -> its output channels
        self._interval: float | None = None  # seconds between checkpoints, the jobs' shortest
        self._checkpoint_id = 0
        self._supervisor: threading.Thread | None = None
        self._job_watch: threading.Thread | None = None
        self.failures: dict[str, dict] = {}  # job -> the node it failed on, and how
        self._stopping = threading.Event()
        self.recoveries: list[dict] = []  # one per node failure: which nodes, key groups, rows replayed
        self.supervisor_errors: list[BaseException] = []
        self._in_flight: dict | None = None  # the handoff move under way
        self._writers: weakref.WeakSet[ClusterWriter] = weakref.WeakSet()  # closed with the cluster
        self._step_hook = None  # tests: called at each point of a move (see _move)
        self.sources = ClusterSources(self)  # the jobs' sources that are not channels (cluster.sources)

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
        a network, TLS is advised).
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
        location (``spark.sql.streaming.checkpointLocation``) when one is set."""
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
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _begin(self, nodes: int) -> None:
        self._secret = secrets.token_hex(32)
        secret_file = self.directory / "secret"
        secret_file.touch(mode=0o600)
        secret_file.write_text(self._secret)
        self._serve()  # first: nodes started in Spark executors announce themselves to it
        stored = self.store.load()
        resumed = self._stored_jobs() if stored is not None and self.checkpoint_dir is not None else {}
        if resumed:
            self._resume(stored, resumed)
            return
        self._write("jobs.json", {})
        self._write("nodes.json", {})
        if self.tls is not None:
            self._write_text("tls.json", self.tls.to_json())
        (self.directory / "staging").mkdir(mode=0o700, exist_ok=True)  # Spark executors stage here
        self.connection = ClusterConnection(self.directory)
        if stored is not None and stored.max_parallelism != self.max_parallelism:
            raise ValueError(
                f"the routing table in {self.directory} has {stored.max_parallelism} key groups, "
                f"not {self.max_parallelism}"
            )
        ids = stored.nodes if stored is not None else [f"node-{i}" for i in range(nodes)]
        self._next = 1 + max(
            (int(n.rsplit("-", 1)[1]) for n in ids if n.rsplit("-", 1)[-1].isdigit()), default=-1
        )
        for node_id in ids:
            self._start_node(node_id)
        self.table = stored if stored is not None else RoutingTable.initial(ids, self.max_parallelism)
        if stored is None:
            self.store.save(self.table)
        self._publish_members(ids)  # the nodes that take broadcast rows
        for node_id in ids:
            self._own(node_id)
        self.started = True

    def _serve(self) -> None:
        self._driver = DriverServer(self, self._secret, host=self.host, tls=self.tls)
        threading.Thread(target=self._driver.serve, name="stretch-cluster-driver", daemon=True).start()
        if hasattr(self.launcher, "driver"):
            self.launcher.driver = self._driver
        self._write("driver.json", {"location": self._driver.location})

    def _stored_jobs(self) -> dict[str, bytes]:
        """The checkpointed jobs a previous driver ran on this cluster (``jobs/<name>.job``)."""
        try:
            jobs = json.loads((self.directory / "jobs.json").read_text())
        except FileNotFoundError:
            return {}
        return {
            name: (self.directory / "jobs" / entry["spec"]).read_bytes()
            for name, entry in jobs.items()
            if entry.get("spec") and (self.directory / "jobs" / entry["spec"]).exists()
        }

    def _forget_specs(self) -> None:
        """The cluster's jobs end with it: a driver started later on its directory resumes none."""
        try:
            jobs = json.loads((self.directory / "jobs.json").read_text())
        except FileNotFoundError:
            return
        for entry in jobs.values():
            spec = entry.pop("spec", None)
            if spec:
                (self.directory / "jobs" / spec).unlink(missing_ok=True)
        self._write("jobs.json", jobs)

    def _resume(self, stored: RoutingTable, jobs: dict[str, bytes]) -> None:
        """A driver restarted on a cluster whose previous driver died (its nodes died with it):
        as many new nodes as the stored table has, the checkpointed jobs again, and every key group
        restored from the checkpoint directory as if every old node had died, a handoff that was
        under way included (``handoff.json``)."""
        if stored.max_parallelism != self.max_parallelism:
            raise ValueError(
                f"the routing table in {self.directory} has {stored.max_parallelism} key groups, "
                f"not {self.max_parallelism}"
            )
        if self.tls is not None:
            self._write_text("tls.json", self.tls.to_json())
        self._write("nodes.json", {})
        self.connection = ClusterConnection(self.directory)
        self.table = stored
        old = stored.nodes
        entries = json.loads((self.directory / "jobs.json").read_text())
        self._next = 1 + max(
            (
                int(n.rsplit("-", 1)[1])
                for e in entries.values()
                for n in e.get("nodes", [])
                if n[-1].isdigit()
            ),
            default=-1,
        )
        fresh = [f"node-{self._next + i}" for i in range(len(old))]
        self._next += len(old)
        for node_id in fresh:
            self._start_node(node_id)
            self.connection.action(
                node_id,
                "own",
                {"version": stored.version, "key_groups": [], "max_parallelism": self.max_parallelism},
            )
        try:
            previous = list(Members.load(self.directory).nodes)
        except LookupError:
            previous = list(old)
        for name, blob in jobs.items():
            self._jobs[name] = blob
            self._outputs[name] = entries[name].get("outputs", [])
            if entries[name].get("broadcast"):
                self._broadcast.add(name)
                starts = self._resume_broadcast(name, blob, previous, fresh)
            else:
                starts = {node_id: self._submit(node_id, blob) for node_id in fresh}
            self._ran_on(name, starts)
            interval = entries[name].get("interval_ms")
            if interval:
                self._interval = min(self._interval or interval / 1000, interval / 1000)
        self._publish_members(fresh)  # broadcast rows come now: after the old ones replayed
        try:
            self._restore_all(stored, old, fresh)
        except BaseException:  # nothing ran on the fresh nodes: readers must not look for them
            entries = json.loads((self.directory / "jobs.json").read_text())
            for entry in entries.values():
                entry["nodes"] = [n for n in entry.get("nodes", []) if n not in fresh]
                entry["starts"] = {n: s for n, s in entry.get("starts", {}).items() if n not in fresh}
            self._write("jobs.json", entries)
            raise

    def _restore_all(self, stored: RoutingTable, old: list[str], fresh: list[str]) -> None:
        """Every key group of the stored table (and of a handoff under way) onto the fresh nodes."""
        pending = None
        try:
            step = json.loads((self.directory / "handoff.json").read_text())
        except FileNotFoundError:
            step = None
        if step is not None and step["version"] == stored.version:
            pending = {int(kg): src for kg, (src, _dst) in step["moves"].items()}
            for kg, (src, dst) in step["moves"].items():
                name = f"h{step['version']}-{src}-{dst}"  # its release checkpoint (node._act_release)
                base = str(recovery.node_dir(self.checkpoint_dir, src) / "checkpoints" / name)
                if recovery.adopted_from(self.checkpoint_dir, dst, int(kg), base):
                    del pending[int(kg)]  # the new owner had it: it restores from there
        # a node being removed owns nothing in the stored table after its last step began, but the
        # key groups of that step it had not handed over are still its own: it is dead too
        dead = list(dict.fromkeys([*old, *(pending or {}).values()]))
        self._recover(dead, None, pending, survivors=fresh)
        (self.directory / "handoff.json").unlink(missing_ok=True)
        self._collect_garbage()
        self.started = True
        self._supervise()

    def _resume_broadcast(
        self, name: str, blob: bytes, previous: list[str], fresh: list[str]
    ) -> dict[str, dict[str, int]]:
        """Start a checkpointed job with broadcast state on a restarted driver's new nodes from an
        old member's latest broadcast point, and replay that member's broadcast journal since (see
        cluster.broadcast_restore): before the key groups are restored, so their replayed rows see
        the broadcast state the old nodes had at their end."""
        point = broadcast_restore.restore_point(self.checkpoint_dir, previous, name)
        body = {"spec": blob, "states": point["states"], "marks": point["marks"], "members": 0}
        replay = {"job": name, "node": point["node"], "journal": point["journal"]}
        starts = {}
        for node_id in fresh:
            starts[node_id] = self.connection.action(node_id, "join", pickle.dumps(body)).get("outputs", {})
            self.connection.action(node_id, "broadcast_replay", replay)
        return starts

    def _write(self, name: str, value) -> None:
        self._write_text(name, json.dumps(value))

    def _write_text(self, name: str, text: str) -> None:
        tmp = self.directory / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(self.directory / name)

    def _start_node(self, node_id: str, jobs: dict[str, bytes] | None = None) -> _Node:
        """Start a node running the cluster's jobs (or ``jobs``)."""
        node = self._nodes[node_id] = _Node(node_id, self.launcher.start(node_id, self._secret, self.tls))
        self._write("nodes.json", {n.id: n.location for n in self._nodes.values()})
        for name, blob in (self._jobs if jobs is None else jobs).items():
            self._ran_on(name, {node_id: self._submit(node_id, blob)})
        return node

    def _submit(self, node_id: str, blob: bytes) -> dict[str, int]:
        """Start a job on a node; returns where its output channels' logs start for this run."""
        return self.connection.action(node_id, "submit", blob).get("outputs", {})

    def _ran_on(self, job: str, starts: dict[str, dict[str, int]]) -> None:
        """Record in ``jobs.json`` that ``job`` ran on these nodes, and where each node's output
        logs start for this cluster's run of it: readers of its output (and of its state) look at
        every node it ran on, removed ones too, from there (a log keeps earlier runs of the name,
        on earlier clusters too, before it)."""
        jobs = json.loads((self.directory / "jobs.json").read_text())
        entry = jobs.setdefault(job, {})
        entry["nodes"] = [*entry.get("nodes", []), *(n for n in starts if n not in entry.get("nodes", []))]
        entry.setdefault("starts", {}).update(starts)
        self._write("jobs.json", jobs)
        self.sources.ran_on(job, list(starts))

    def _own(self, node_id: str) -> None:
        body = {
            "version": self.table.version,
            "key_groups": self.table.key_groups_of(node_id),
            "max_parallelism": self.max_parallelism,
        }
        self.connection.action(node_id, "own", body)

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
        table = self.store.load()
        try:
            jobs = json.loads((self.directory / "jobs.json").read_text())
            nodes = json.loads((self.directory / "nodes.json").read_text())
        except FileNotFoundError:
            jobs, nodes = {}, {}
        for entry in jobs.values():
            entry.pop("spec", None)
            entry.pop("interval_ms", None)
        try:
            members = json.loads((self.directory / MEMBERS_FILE).read_text())
        except FileNotFoundError:
            members = None
        return {
            "routing": json.loads(table.to_json()) if table is not None else None,
            "nodes": nodes,
            "jobs": jobs,
            "members": members,
        }

    @property
    def nodes(self) -> list[str]:
        """The ids of the cluster's nodes now, in the order they joined."""
        return list(self._nodes)

    def status(self) -> dict:
        """Each node's routing version, key groups and jobs."""
        return {n: self.connection.action(n, "status") for n in self._nodes}

    # ---- jobs -----------------------------------------------------------------------------------
    def submit(self, plan, name: str, config) -> ClusterJobClient:
        """Run a job on every node (what ``env.execute_async(name, cluster=cluster)`` does)."""
        self._check_open()
        if name in self._jobs:
            raise ValueError(f"the cluster already runs a job {name!r}")
        if config.checkpointing and self.checkpoint_dir is None:
            raise ValueError(
                f"job {name!r} enables checkpointing: give the cluster a checkpoint directory every node "
                "can read (StretchCluster.local(..., checkpoint_dir=...) or on_spark(..., checkpoint_dir=...))"
            )
        if plan.max_parallelism != self.max_parallelism:
            raise ValueError(
                f"job {name!r} has max parallelism {plan.max_parallelism}; the cluster routes "
                f"{self.max_parallelism} key groups: set env.set_max_parallelism({self.max_parallelism})"
            )
        plan, feeds = split_sources(plan)  # its other sources: read into channels of their own
        inputs = cluster_inputs(plan)
        broadcast = broadcast_channels(plan)
        checkpointed = bool(config.checkpointing)
        # the nodes checkpoint the job (not its engine): its channels stay fed straight, as the
        # handoff's barrier needs, and the node journals what it takes
        node_config = dataclasses.replace(config, checkpointing=False, restore=False)
        spec = {"name": name, "plan": plan, "config": node_config, "checkpointed": checkpointed}
        blob = user_code.dumps(spec)
        self._jobs[name] = blob
        self._outputs[name] = [s.sink.channel_name for s in plan.sinks if hasattr(s.sink, "channel_name")]
        jobs = json.loads((self.directory / "jobs.json").read_text())
        types = {}
        for stage in plan.stages:
            channel, type_info = (
                getattr(stage.source, "channel_name", None),
                getattr(stage.source, "type_info", None),
            )
            if channel is not None:
                types[channel] = type_info.to_json() if type_info is not None else None
        jobs[name] = {"inputs": inputs, "types": types}
        if broadcast:  # writers send their rows to every node (client.Members)
            jobs[name]["broadcast"] = broadcast
            self._broadcast.add(name)
        if checkpointed:  # a restarted driver runs it again, from the checkpoint directory
            (self.directory / "jobs").mkdir(mode=0o700, exist_ok=True)
            spec_name = f"{job_dir_name(name)}.job"
            write_private(self.directory / "jobs" / spec_name, blob)
            jobs[name].update(
                spec=spec_name, outputs=self._outputs[name], interval_ms=config.checkpoint.interval_ms
            )
        self._write("jobs.json", jobs)
        self._ran_on(name, {node_id: self._submit(node_id, blob) for node_id in self._nodes})
        if self._job_watch is None:
            self._job_watch = threading.Thread(
                target=self._watch_jobs, name="stretch-cluster-jobs", daemon=True
            )
            self._job_watch.start()
        if checkpointed:
            interval = config.checkpoint.interval_ms
            if interval:
                self._interval = min(self._interval or interval / 1000, interval / 1000)
            self._supervise()
        self.sources.start(name, feeds, checkpointed)
        return ClusterJobClient(self, name)

    # ---- checkpoints and failures -----------------------------------------------------------
    def _changing(self):
        """One node change, checkpoint or recovery at a time."""
        return self._driver.changing if self._driver is not None else contextlib.nullcontext()

    def checkpoint(self) -> dict[str, dict]:
        """Every node checkpoints its key groups of the checkpointed jobs into the checkpoint
        directory now (their outputs commit there); each node's report (path, bytes, duration_ms)."""
        if self.checkpoint_dir is None:
            raise ValueError(
                "the cluster has no checkpoint directory (StretchCluster.local(checkpoint_dir=...))"
            )
        with self._changing():
            self._checkpoint_id += 1
            reports = {
                n: self.connection.action(n, "checkpoint", {"id": self._checkpoint_id}) for n in self.nodes
            }
            self._collect_garbage()
            return reports

    def _collect_garbage(self) -> None:
        """Delete from the checkpoint directory what no manifest of a current node names (see
        recovery.collect_garbage); the caller holds the change lock, so none changes meanwhile."""
        if self.checkpoint_dir is not None:
            nodes = [*self._nodes, *(self.table.nodes if self.table is not None else [])]
            recovery.collect_garbage(self.checkpoint_dir, nodes, lambda path: self._hook("collect", path, ""))

    def _supervise(self) -> None:
        """Start the thread that restores nodes that die and takes the periodic checkpoints."""
        if self._supervisor is None:
            self._supervisor = threading.Thread(
                target=self._watch, name="stretch-cluster-supervisor", daemon=True
            )
            self._supervisor.start()

    def _watch_jobs(self) -> None:
        """A job that fails on one node fails on all, as a Flink job does when a task fails: its
        copies on the other nodes are cancelled (``wait`` then raises the failed node's error)."""
        while not self._stopping.wait(0.5):
            for node in list(self.nodes):
                try:
                    failed = self.connection.action(node, "failed")
                except Exception:  # a node that died: the supervisor's, or the caller's, to see
                    continue
                for job, error in failed.items():
                    if job in self.failures:
                        continue
                    self.failures[job] = {"node": node, "error": error}
                    for other in list(self.nodes):
                        if other != node:
                            with contextlib.suppress(Exception):
                                self.connection.action(other, "cancel", {"job": job})

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._stopping.wait(0.05):
            try:
                dead = [n for n in self.nodes if not self.launcher.alive(n)]
                if dead:
                    with self._changing():
                        dead = [n for n in dead if n in self._nodes]
                        if dead:
                            self._recover(dead)
                            self._collect_garbage()
                if self._interval and time.monotonic() - last >= self._interval:
                    last = time.monotonic()
                    self.checkpoint()
            except Exception as e:  # kept for the caller to see; the thread goes on
                if not self._stopping.is_set():
                    self.supervisor_errors.append(e)

    def _recover(
        self,
        dead: list[str],
        in_flight: dict | None = None,
        pending: dict | None = None,
        survivors: list[str] | None = None,
        origins: dict[int, str] | None = None,
    ) -> dict:
        """Restore the key groups of nodes that died on the surviving nodes (the caller holds the
        change lock): a new routing version without them; each key group from the checkpoint and
        journal its manifest names (``in_flight``: a move under way, whose key groups restore
        from the old owner unless the new one adopted them; ``pending``: key group -> old owner,
        moves of the step not begun, which go back to their old owner; ``origins``: key group ->
        node, those a node died restoring); the dead nodes' outputs cut back to their latest
        checkpoint. A node that dies restoring is restored in turn."""
        if self.checkpoint_dir is None:
            raise NodeLost(
                f"nodes {dead} died and the cluster has no checkpoint directory to restore them from"
            )
        t0 = time.monotonic()
        for node in dead:
            self._forget(node)
        table = self.table
        if pending:  # the same version: these key groups never left their old owner
            table = RoutingTable(
                table.version, tuple(pending.get(kg, o) for kg, o in enumerate(table.owners))
            )
        origin: dict[int, str] = {}  # key group -> the node whose checkpoint and journal restore it
        for node in dead:
            for kg in table.key_groups_of(node):
                origin[kg] = node
        if in_flight is not None:
            src, dst, base = in_flight["src"], in_flight["dst"], in_flight.get("base")
            for kg in in_flight["key_groups"]:
                adopted = base is not None and recovery.adopted_from(self.checkpoint_dir, dst, kg, base)
                origin[kg] = dst if adopted else src
        origin.update(origins or {})  # key groups a node died restoring: from where they came
        moves = plan_failover(table, dead, survivors)
        if moves or pending:
            self.table = table.moved(moves)
            self.store.save(self.table)
        parts: dict[str, dict[tuple, dict]] = {}
        manifests = {n: recovery.load_manifest(self.checkpoint_dir, n) for n in set(origin.values())}
        for kg, node in sorted(origin.items()):
            base, journal = recovery.source_of(self.checkpoint_dir, node, kg, manifests[node])
            key = (node, base, json.dumps(journal, sort_keys=True))
            part = parts.setdefault(self.table.owners[kg], {}).setdefault(
                key, {"node": node, "base": base, "journal": journal, "key_groups": []}
            )
            part["key_groups"].append(kg)
        for node in dead:
            outputs = recovery.load_manifest(self.checkpoint_dir, node)["outputs"]
            for job, channels_ in self._outputs.items():
                for channel in channels_:
                    log = channel_dir(f"{job}@{node}", channel, "out")
                    offset = outputs.get(job, {}).get(channel)
                    recovery.cut_output(log, offset if offset is not None else 1 << 62)
        replayed, failed, unfinished = 0, [], {}
        for target, by_source in parts.items():
            body = {"version": self.table.version, "parts": list(by_source.values())}
            self._hook("recover", ",".join(dead), target)
            try:
                replayed += self.connection.action(target, "recover", body)["rows_replayed"]
            except Exception:
                if not self._dead_among(target):
                    raise
                failed.append(target)  # it died restoring: what it had not adopted restores as before
                adopted = recovery.load_manifest(self.checkpoint_dir, target)["adopted"]
                for part in by_source.values():
                    for kg in part["key_groups"]:
                        if not any(kg in e["key_groups"] and e["base"] == part["base"] for e in adopted):
                            unfinished[kg] = part["node"]
        report = {
            "nodes": list(dead),
            "key_groups": len(origin),
            "rows_replayed": replayed,
            "version": self.table.version,
            "elapsed_ms": (time.monotonic() - t0) * 1000,
        }
        self.recoveries.append(report)
        if failed:
            self._recover(failed, origins=unfinished)
        return report

    def _forget(self, node_id: str) -> None:
        """A node that died: out of the cluster (its process reaped)."""
        self._nodes.pop(node_id, None)
        self.sources.lost(node_id)
        with contextlib.suppress(LookupError):  # writers of broadcast rows stop waiting for it
            members = Members.load(self.directory)
            if node_id in members.nodes:
                self._publish_members([n for n in members.nodes if n != node_id])
        self._write("nodes.json", {n.id: n.location for n in self._nodes.values()})
        self.connection.forget(node_id)
        self.launcher.stop(node_id)

    def job(self, name: str) -> ClusterJobClient:
        """The client of a job the cluster runs (one a restarted driver resumed, too)."""
        if name not in self._jobs:
            raise LookupError(f"the cluster runs no job {name!r} (jobs: {sorted(self._jobs)})")
        return ClusterJobClient(self, name)

    def writer(self, job: str, channel: str, key=None) -> ClusterWriter:
        """A writer into input channel ``channel`` of job ``job`` on every node: each row goes to the
        node owning its key group (``key``: the field, by default the one the job keys by)."""
        self._check_open()
        writer = ClusterWriter(self.address, job, channel, key)
        self._writers.add(writer)
        return writer

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
        node_id = f"node-{self._next}"
        self._next += 1
        self._start_joining(node_id)
        self.connection.action(
            node_id,
            "own",
            {"version": self.table.version, "key_groups": [], "max_parallelism": self.max_parallelism},
        )
        return self._handoff(plan_add_node(self.table, node_id))

    def remove_node(self, node: str) -> HandoffReport:
        """Hand a node's key groups to the others, then stop it."""
        self._check_open()
        if self._driver is not None:
            with self._driver.changing:
                return self._remove_node(node)
        return self._remove_node(node)

    def _remove_node(self, node: str) -> HandoffReport:
        if len(self._nodes) == 1 and node in self._nodes:
            raise ValueError(f"{node!r} is the cluster's last node: its key groups would have nowhere to go")
        if node not in self._nodes:
            raise LookupError(f"no node {node!r} in the cluster (nodes: {self.nodes})")
        self.sources.leaving(node)  # its source readers give their splits back
        report = self._handoff(plan_remove_node(self.table, node))
        self._leave_members(node)
        self.connection.action(node, "retire")
        self._stop_node(node)
        self._collect_garbage()  # its journal: its key groups' new owners journal them now
        return report

    # ---- broadcast membership: the nodes that take every broadcast row (client.Members) --------
    def _publish_members(self, nodes: list[str], version: int | None = None) -> int:
        """Publish the broadcast membership, as its next version unless ``version`` is given."""
        if version is None:
            try:
                version = Members.load(self.directory).version + 1
            except LookupError:
                version = 0
        self._write(MEMBERS_FILE, {"version": version, "nodes": list(nodes)})
        return version

    def _start_joining(self, node_id: str) -> None:
        """Start a node that joins the cluster, its jobs with broadcast state starting from the
        broadcast state a member holds. That member is fenced first (from then on it refuses
        broadcast rows of the current membership, and parks its broadcast state as of every row it
        took before); the new node's jobs start from that state; only then is the next membership,
        with the new node, published: so every broadcast row reaches the new node exactly once,
        in the copied state or sent to it (see client.ClusterWriter)."""
        self._start_node(node_id, {n: b for n, b in self._jobs.items() if n not in self._broadcast})
        members = Members.load(self.directory)
        version, nodes = members.version + 1, list(members.nodes)
        try:
            if self._broadcast:
                fenced = self.connection.action(nodes[0], "broadcast_fence", {"members": version})
                for name in sorted(self._broadcast):
                    table = self.connection.get(nodes[0], f"broadcast:{fenced['tickets'][name]}")
                    states = dict(
                        zip(table.column("operator").to_pylist(), table.column("state").to_pylist())
                    )
                    body = {"spec": self._jobs[name], "states": states, "marks": fenced["marks"][name]}
                    joined = self.connection.action(
                        node_id, "join", pickle.dumps({**body, "members": version})
                    )
                    self._ran_on(name, {node_id: joined.get("outputs", {})})
            nodes.append(node_id)
        finally:  # the fenced member takes rows of this version on, the new node in it or not
            self._publish_members(nodes, version)

    def _leave_members(self, node_id: str) -> None:
        """A node leaving (its key groups handed away) takes no more broadcast rows: the
        membership without it first, then the node refuses writers that still send it some."""
        members = Members.load(self.directory)
        self._publish_members([n for n in members.nodes if n != node_id])
        self.connection.action(node_id, "broadcast_leave")

    def _state_bytes_per_key_group(self, moves: dict[int, str]) -> dict[int, float]:
        """Each moving key group's share of its node's state (the nodes' jobs' state bytes over
        the key groups the node owns): what cuts a node change into steps of similar size."""
        shares: dict[int, float] = {}
        for node in {self.table.owners[kg] for kg in moves}:
            status = self.connection.action(node, "status")
            total = sum(
                op["state_bytes"] for job in status["jobs"].values() for op in job.get("operators", ())
            )
            owned = status["key_groups"]
            for kg in owned:
                shares[kg] = total / len(owned)
        return shares

    def _handoff(self, moves: dict[int, str]) -> HandoffReport:
        t0 = time.monotonic()
        moved = size = 0
        stalls: list[float] = []
        parts = steps(moves, self.step, self._state_bytes_per_key_group(moves), STEP_BYTES)
        for step in parts:
            old = self.table
            self.table = old.moved(step)
            if self.checkpoint_dir is not None:  # a restarted driver finds where each key group was
                moving = {kg: [old.owners[kg], dst] for kg, dst in step.items()}
                self._write("handoff.json", {"version": self.table.version, "moves": moving})
            self.store.save(self.table)  # writers refused from now on find the new owners here
            pairs: dict[tuple[str, str], list[int]] = {}
            for kg, dst in step.items():
                pairs.setdefault((old.owners[kg], dst), []).append(kg)
            for index, ((src, dst), kgs) in enumerate(pairs.items()):
                s0 = time.monotonic()
                try:
                    size += self._move(src, dst, kgs, self.table.version)
                except Exception as e:
                    dead = self._dead_among(src, dst)
                    if not dead or self.checkpoint_dir is None:
                        raise
                    in_flight, self._in_flight = self._in_flight, None
                    started = {kg for done in list(pairs.values())[: index + 1] for kg in done}
                    pending = {kg: old.owners[kg] for kg in step if kg not in started}
                    recovered = self._recover(dead, in_flight, pending)
                    (self.directory / "handoff.json").unlink(missing_ok=True)
                    self._collect_garbage()
                    raise NodeLost(
                        f"node {' and '.join(dead)} died while key groups moved from {src} to {dst}: "
                        f"{recovered['key_groups']} key groups restored from the checkpoint directory "
                        f"(routing version {recovered['version']}); the node change stopped there"
                    ) from e
                stalls.append((time.monotonic() - s0) * 1000)
                moved += len(kgs)
        (self.directory / "handoff.json").unlink(missing_ok=True)
        self._collect_garbage()  # checkpoints the release checkpoints superseded
        return HandoffReport(
            elapsed_ms=(time.monotonic() - t0) * 1000,
            key_groups_moved=moved,
            bytes_moved=size,
            max_stall_ms=max(stalls, default=0.0),
            version=self.table.version,
            steps=len(parts),
            step_ms=tuple(stalls),
        )

    def _dead_among(self, *nodes: str, wait: float = 10.0) -> list[str]:
        """Which of ``nodes`` died (a call to one failed: give a killed process time to end)."""
        deadline = time.monotonic() + wait
        while True:
            dead = [n for n in nodes if n in self._nodes and not self.launcher.alive(n)]
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    def _hook(self, point: str, src: str, dst: str) -> None:
        if self._step_hook is not None:
            self._step_hook(point, src, dst)

    def _move(self, src: str, dst: str, kgs: list[int], version: int) -> int:
        """Move key groups ``kgs`` from node ``src`` to ``dst``; returns the state bytes shipped."""
        c = self.connection
        self._in_flight = {"src": src, "dst": dst, "key_groups": kgs, "base": None}
        self._hook("release", src, dst)
        released = c.action(src, "release", {"version": version, "key_groups": kgs, "to": dst})
        self._in_flight["base"] = released.get("base")
        self._hook("load", src, dst)
        size = 0
        for part in released["parts"]:
            table = c.get(src, f"snapshot:{part['ticket']}")
            size += table.nbytes
            command = {
                "op": "load",
                "job": part["job"],
                "operator": part["operator"],
                "description": part["description"],
            }
            c.put(dst, command, table)
        self._hook("adopt", src, dst)
        body = {
            "version": version,
            "key_groups": kgs,
            "marks": released["marks"],
            "base": released.get("base"),
        }
        c.action(dst, "adopt", body)
        self._in_flight = None
        self._hook("adopted", src, dst)
        return size

    def _stop_node(self, node_id: str) -> None:
        node = self._nodes.pop(node_id)
        self._write("nodes.json", {n.id: n.location for n in self._nodes.values()})
        try:
            self.connection.action(node_id, "shutdown")
        except Exception:
            pass
        self.connection.forget(node_id)
        self.launcher.stop(node.id)

    def _check_open(self) -> None:
        """A closed cluster has no nodes, directory or driver left: say so, start nothing."""
        if self.closed:
            raise RuntimeError(f"the stretch cluster at {self.directory} is closed")

    def close(self) -> None:
        """Stop every node (cancelling the jobs still running) and remove what the cluster made."""
        if self.closed:
            return
        self.closed = True
        self._stopping.set()
        self.sources.close()
        if self._supervisor is not None:
            self._supervisor.join(30)
        if self._job_watch is not None:
            self._job_watch.join(30)
        if self._elasticity is not None:
            self._elasticity.stop()
        if self._driver is not None:
            self._driver.shutdown()
            (self.directory / "driver.json").unlink(missing_ok=True)
        if self._jobs and self.checkpoint_dir is not None and self.started:
            self._forget_specs()  # closed after it started, not died nor failed to: nothing to resume
        for writer in list(self._writers):  # their shared-memory segments go too
            writer.close()
        for node_id in list(self._nodes):
            self._stop_node(node_id)
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
