"""The jobs a cluster runs: what each node is given to run (a job's spec), what writers and readers
learn of it (``jobs.json``: its input keys and types, the nodes it ran on and where their output
logs start), what a restarted driver resumes (a checkpointed job's spec under ``jobs/``), and a
failure on one node failing it on all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

from stretch.cluster.directory import JOBS
from stretch.cluster.forward_log import ForwardLog
from stretch.cluster.forward_sink import ForwardSink
from stretch.cluster.key_routes import encode_routes
from stretch.cluster.node_plans import broadcast_channels, cluster_inputs
from stretch.plan.shipping import pickled
from stretch.runtime.state_dir import job_dir_name, write_private


class JobRegistry:
    """The jobs of ``cluster`` (a StretchCluster)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.specs: dict[str, bytes] = {}  # job name -> its pickled plan and config
        self.broadcast: set[str] = set()  # the jobs with broadcast state
        self.outputs: dict[str, list[str]] = {}  # job -> its output channels
        # job -> {channel: with event time} of its forwards through logs (cluster.forward_log)
        self.forward_logs: dict[str, dict[str, bool]] = {}
        self.interval: float | None = None  # seconds between checkpoints, the jobs' shortest
        self.failures: dict[str, dict] = {}  # job -> the node it failed on, and how
        self._watch: threading.Thread | None = None

    def submit(self, plan, name: str, config) -> bool:
        """Run a job on every node; whether it is checkpointed."""
        c = self.cluster
        if name in self.specs:
            raise ValueError(f"the cluster already runs a job {name!r}")
        if config.checkpointing and c.checkpoint_dir is None:
            raise ValueError(
                f"job {name!r} enables checkpointing: give the cluster a checkpoint directory every node "
                "can read (StretchCluster.local(..., checkpoint_dir=...) or on_spark(..., checkpoint_dir=...))"
            )
        if plan.max_parallelism != c.max_parallelism:
            raise ValueError(
                f"job {name!r} has max parallelism {plan.max_parallelism}; the cluster routes "
                f"{c.max_parallelism} key groups: set env.set_max_parallelism({c.max_parallelism})"
            )
        inputs = cluster_inputs(plan)
        broadcast = broadcast_channels(plan)
        checkpointed = bool(config.checkpointing)
        # the nodes checkpoint the job (not its engine): its channels stay fed straight, as the
        # handoff's barrier needs, and the node journals what it takes
        node_config = dataclasses.replace(config, checkpointing=False, restore=False)
        spec = {"name": name, "plan": plan, "config": node_config, "checkpointed": checkpointed}
        blob = pickled(spec, plan.stages)  # a function that does not pickle is named
        self.specs[name] = blob
        self.outputs[name] = [s.sink.channel_name for s in plan.sinks if hasattr(s.sink, "channel_name")]
        jobs = c.files.jobs()
        types = {}
        for stage in plan.stages:
            channel, type_info = (
                getattr(stage.source, "channel_name", None),
                getattr(stage.source, "type_info", None),
            )
            if channel is not None:
                types[channel] = type_info.to_json() if type_info is not None else None
        jobs[name] = {
            "inputs": {channel: route.describe() for channel, route in inputs.items()},
            "routes": encode_routes(inputs),  # the key selector functions writers run
            "types": types,
        }
        forwards = [s.sink.channel for s in plan.sinks if isinstance(s.sink, (ForwardSink, ForwardLog))]
        if forwards:  # it re-keys across nodes (cluster.rekey_plans): no stage can run it
            jobs[name]["forwards"] = forwards
        self.forward_logs[name] = {
            s.sink.channel: s.sink.timed for s in plan.sinks if isinstance(s.sink, ForwardLog)
        }
        if broadcast:  # writers send their rows to every node (client.Members)
            jobs[name]["broadcast"] = broadcast
            self.broadcast.add(name)
        if checkpointed:  # a restarted driver runs it again, from the checkpoint directory
            (c.directory / "jobs").mkdir(mode=0o700, exist_ok=True)
            spec_name = f"{job_dir_name(name)}.job"
            write_private(c.directory / "jobs" / spec_name, blob)
            jobs[name].update(
                spec=spec_name,
                outputs=self.outputs[name],
                forward_logs=self.forward_logs[name],
                interval_ms=config.checkpoint.interval_ms,
            )
        c.files.write(JOBS, jobs)
        self.ran_on(name, {node_id: self.start(node_id, blob) for node_id in c.nodes})
        if self._watch is None:
            self._watch = threading.Thread(
                target=self._watch_failures, name="stretch-cluster-jobs", daemon=True
            )
            self._watch.start()
        if checkpointed:
            self.checkpoint_every(config.checkpoint.interval_ms)
        return checkpointed

    def resumed(self, name: str, blob: bytes, entry: dict) -> None:
        """A checkpointed job a previous driver ran (its ``jobs.json`` entry), run again."""
        self.specs[name] = blob
        self.outputs[name] = entry.get("outputs", [])
        self.forward_logs[name] = entry.get("forward_logs", {})
        if entry.get("broadcast"):
            self.broadcast.add(name)
        self.checkpoint_every(entry.get("interval_ms"))

    def checkpoint_every(self, interval_ms: int | None) -> None:
        """The cluster checkpoints as often as its most often checkpointed job asks."""
        if interval_ms:
            self.interval = min(self.interval or interval_ms / 1000, interval_ms / 1000)

    def start(self, node_id: str, blob: bytes) -> dict:
        """Start a job on a node; returns the node's answer (``ran_on`` records it)."""
        return self.cluster.connection.action(node_id, "submit", blob)

    def start_all(self, node_id: str, jobs: dict[str, bytes] | None = None) -> None:
        """Start the cluster's jobs (or ``jobs``) on a node."""
        for name, blob in (self.specs if jobs is None else jobs).items():
            self.ran_on(name, {node_id: self.start(node_id, blob)})

    def end(self, job: str, channel: str) -> None:
        """End input channel ``channel`` of ``job`` on every node, and remember it in
        ``jobs.json``: a node the job starts on later (``ran_on``) gets the end too, or its copy of
        the job would wait for input for ever."""
        files = self.cluster.files
        jobs = files.jobs()
        entry = jobs.setdefault(job, {})
        if channel not in entry.setdefault("ended", []):
            entry["ended"].append(channel)
            files.write(JOBS, jobs)
        for node in self.cluster.nodes:
            self.cluster.connection.action(node, "end", {"job": job, "channel": channel})

    def ran_on(self, job: str, started: dict[str, dict]) -> None:
        """Record in ``jobs.json`` that ``job`` ran on these nodes (each node's answer to its
        start), where each node's output logs start for this cluster's run of it, and which run
        it is (its job id and log directories): readers of its output (and of its state) look at
        every node it ran on, removed ones too, from there (a log keeps earlier runs of the name,
        on earlier clusters too, before it), and never at another cluster's job of that name."""
        files = self.cluster.files
        jobs = files.jobs()
        entry = jobs.setdefault(job, {})
        entry["nodes"] = [*entry.get("nodes", []), *(n for n in started if n not in entry.get("nodes", []))]
        entry.setdefault("starts", {}).update({n: r["outputs"] for n, r in started.items()})
        entry.setdefault("runs", {}).update(
            {n: {"job_id": r["job_id"], "logs": r["logs"]} for n, r in started.items()}
        )
        files.write(JOBS, jobs)
        for node in started:  # the input channels its user ended before
            for channel in entry.get("ended", []):
                with contextlib.suppress(Exception):  # ended there already
                    self.cluster.connection.action(node, "end", {"job": job, "channel": channel})
        self.cluster.sources.ran_on(job, list(started))  # its source readers there (cluster.sources)
        self.cluster.forwards.ran_on(job, list(started))  # the ends of its forwards given already

    def unrecord(self, nodes: list[str]) -> None:
        """Nothing ran on ``nodes`` after all (a resume that failed): readers must not look for them."""
        files = self.cluster.files
        entries = files.jobs()
        for entry in entries.values():
            entry["nodes"] = [n for n in entry.get("nodes", []) if n not in nodes]
            entry["starts"] = {n: s for n, s in entry.get("starts", {}).items() if n not in nodes}
            entry["runs"] = {n: r for n, r in entry.get("runs", {}).items() if n not in nodes}
        files.write(JOBS, entries)

    def stored(self) -> dict[str, bytes]:
        """The checkpointed jobs a previous driver ran on this cluster (``jobs/<name>.job``)."""
        directory = self.cluster.directory
        return {
            name: (directory / "jobs" / entry["spec"]).read_bytes()
            for name, entry in self.cluster.files.read(JOBS, {}).items()
            if entry.get("spec") and (directory / "jobs" / entry["spec"]).exists()
        }

    def forget_specs(self) -> None:
        """The cluster's jobs end with it: a driver started later on its directory resumes none."""
        files = self.cluster.files
        jobs = files.read(JOBS)
        if jobs is None:
            return
        for entry in jobs.values():
            spec = entry.pop("spec", None)
            if spec:
                (self.cluster.directory / "jobs" / spec).unlink(missing_ok=True)
        files.write(JOBS, jobs)

    def join(self, timeout: float) -> None:
        if self._watch is not None:
            self._watch.join(timeout)

    def _watch_failures(self) -> None:
        """A job that fails on one node fails on all, as a Flink job does when a task fails: its
        copies on the other nodes are cancelled (``wait`` then raises the failed node's error)."""
        c = self.cluster
        while not c.stopping.wait(0.5):
            for node in list(c.nodes):
                try:
                    failed = c.connection.action(node, "failed")
                except Exception:  # a node that died: the supervisor's, or the caller's, to see
                    continue
                for job, error in failed.items():
                    if job in self.failures:
                        continue
                    self.failures[job] = {"node": node, "error": error}
                    for other in list(c.nodes):
                        if other != node:
                            with contextlib.suppress(Exception):
                                c.connection.action(other, "cancel", {"job": job})
