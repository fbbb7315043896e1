"""A stretch node: one process that runs today's engine for the key groups the cluster gave it.

Transport: Arrow Flight (``pyarrow.flight``), bound to 127.0.0.1 unless told otherwise, with the
cluster's secret checked on every call (``x-stretch-cluster-secret``). Flight rather than writing
into the job's channel directly from the client, because the node must see every row before its
job does: that is where it refuses rows of key groups it does not own (or does not own *yet*,
while their state is on its way), where it drops rows of a (query, batch) a key group already
took (exactly once under replays, remembered per key group so the mark moves with the key group),
and where a handoff can stop a key group at a definite point (cluster.node_intake). The same
endpoint works across hosts; a writer on the node's host stages its rows in shared memory and
sends only the segment's name (``take_shared``, see cluster.shm_transport). Inside the node, rows
go on into the job's channel as today. Pickled job plans are accepted only from peers holding the
secret.

Calls (Flight):

- ``do_exchange`` ``{"op": "write", job, channel, query, batch}``: rows into a job's input
  channel; refused whole, with ``NOT_OWNER``, if any row's key group is not owned and ready here;
  ``{"op": "stage", job, channel, output, query, batch, partition}``: rows of a Spark stage
  transaction, answered with its results (cluster.stage_parts). The answer: a JSON reply and the
  results, as metadata messages. ``do_put`` takes a ``write`` too.
- ``do_put`` ``{"op": "load", job, operator, description}``: key groups' state (Arrow IPC
  key-group snapshot batches) into the operator's live arena, before the key groups are adopted;
  ``{"op": "stage_parts", job}``: the stage transaction parts that come with them.
- ``do_get`` ``snapshot:<ticket>``: the state a ``release`` copied out (``stage:<ticket>``: its
  stage transaction parts); ``state:<job>:<operator>``:
  an operator's keyed state here (one row per key); ``output:{job, channel, start, end}``: a range
  of an output channel's log (see cluster.output_logs), for readers on other hosts;
  ``broadcast:<ticket>``: a job's broadcast states a ``broadcast_fence`` parked (one row per
  broadcast operator).
- actions (JSON): ``submit`` (a cloudpickled plan), ``own``, ``precopy``, ``release``, ``fetch``
  (what a ``precopy`` or ``release`` of a peer parked for this node, fetched straight from the
  peer and taken as a ``do_put``), ``preadopt``, ``adopt``, ``unprecopy`` and ``unpreadopt`` (a
  pre-copied move abandoned), ``status``,
  ``rescale``, ``end``, ``ended_operators``, ``wait``, ``failed``, ``cancel``, ``retire``, ``shutdown``,
  ``take_shared`` (rows a writer on this host staged in shared memory, answered as
  ``do_exchange`` answers); for readers on other hosts
  ``output`` (an output log's offsets and schema) and ``state_schema`` (an operator's); for jobs
  with broadcast state, ``broadcast_fence``, ``join`` (a pickled plan with the broadcast state it
  starts from) and ``broadcast_leave``.

Rows of a broadcast channel (a job's ``broadcast(descriptor)`` input) are not owned by key group:
every node of the broadcast membership takes them all, each (query, batch) once per node, and
refuses (``NOT_MEMBER``) writers of a membership older than the one it was fenced for.

Run as ``python -m stretch.cluster.node --node-id ID`` with the secret in the environment
(``STRETCH_CLUSTER_SECRET``, never on the command line) and, for mutual TLS, the paths of its
certificate, key and CA (``STRETCH_CLUSTER_TLS``, see cluster.tls); it prints ``{"port": N}`` once
it listens and ends with its parent.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import threading
import time

import cloudpickle
import numpy as np
import pyarrow as pa
from pyarrow import flight

from stretch.cluster import broadcast_restore, recovery
from stretch.cluster.node_checkpoints import NodeCheckpoints
from stretch.cluster.node_handoff import NodeHandoff
from stretch.cluster.node_intake import NodeIntake
from stretch.cluster.node_job import NodeJob, barrier_all
from stretch.cluster.node_sources import NodeSources
from stretch.cluster.output_logs import encode_schema, output_info, output_range
from stretch.cluster.protocol import (
    LEFT_CLUSTER,
    SECRET_ENV,
    SecretCheck,
    call_options,
    plain_errors,
)
from stretch.cluster.shm_transport import NotVisible, staged_batches
from stretch.cluster.stage_parts import SCHEMA as STAGE_SCHEMA
from stretch.cluster.tls import TLS_ENV, ClusterTLS, location
from stretch.state.key_groups import warm_up as warm_key_groups
from stretch.state.keyed_table import KeyedTable
from stretch.state.queryable import read_key_group, read_state
from stretch.state.snapshot import (
    SCHEMA as SNAPSHOT_SCHEMA,
)
from stretch.state.snapshot import (
    load_key_groups,
    prepare_arena,
)


class NodeServer(flight.FlightServerBase):
    def __init__(
        self,
        node_id: str,
        secret: str,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: ClusterTLS | None = None,
        checkpoint_dir: str | None = None,
    ):
        super().__init__(
            location(host, port, tls),
            middleware={"secret": SecretCheck(secret)},
            **(tls.server_options() if tls is not None else {}),
        )
        self.node_id = node_id
        self._peer_options = (call_options(secret), tls.client_options() if tls is not None else {})
        self._peers: dict[str, flight.FlightClient] = {}  # location -> client (``_peer``)
        self._peers_lock = threading.Lock()
        self.lock = threading.RLock()  # ownership changes and writes take turns
        self.version = -1
        self.owned: np.ndarray | None = None  # bool per key group: owned and ready
        self.jobs: dict[str, NodeJob] = {}
        self.lingering: dict[
            tuple[str, str], np.ndarray
        ] = {}  # (job, forward channel) -> moving kgs it still takes
        self.parked: dict[str, list[pa.RecordBatch]] = {}  # released state awaiting its do_get
        self._tickets = itertools.count()
        self.max_parallelism: int | None = None
        self.checkpoint_dir = checkpoint_dir
        self.members = 0  # broadcast writes of an older membership are refused (client.Members)
        self.parked_broadcast: dict[str, dict[str, bytes]] = {}  # fenced broadcast states for a do_get
        self.parked_stage: dict[str, pa.Table] = {}  # released stage transaction parts for a do_get
        self.sources = NodeSources(node_id)  # readers of its jobs' file sources (cluster.node_sources)
        self.intake = NodeIntake(self)
        self.checkpoints = NodeCheckpoints(self)
        self.handoff = NodeHandoff(self)
        if checkpoint_dir is not None:  # a node id starts afresh: nothing of an earlier node of that id
            shutil.rmtree(recovery.node_dir(checkpoint_dir, node_id), ignore_errors=True)
            recovery.save_manifest(checkpoint_dir, node_id, recovery.load_manifest(checkpoint_dir, node_id))

    # ---- rows ---------------------------------------------------------------------------------
    @plain_errors
    def do_put(self, context, descriptor, reader, writer):
        self._put(json.loads(descriptor.command), list(reader.read_all().to_batches()))

    def _put(self, cmd: dict, batches: list[pa.RecordBatch]) -> None:
        if cmd["op"] == "write":
            self.intake.take(cmd, batches)
        elif cmd["op"] == "load":
            self._load(cmd, batches)
        elif cmd["op"] == "stage_parts":  # stage transaction parts that come with key groups
            self.job(cmd["job"]).stage.adopt(pa.Table.from_batches(batches))
        elif cmd["op"] == "forward":  # rows the key groups' old owner had queued, for their adoption
            self.handoff.take_forwarded(cmd, batches)
        else:
            raise flight.FlightServerError(f"unknown put {cmd['op']!r}")

    @plain_errors
    def do_exchange(self, context, descriptor, reader, writer):
        """Rows from a writer (cluster.node_intake); the answer is a JSON reply, then the results
        of a stage transaction, each an Arrow IPC stream, all as metadata messages."""
        cmd = json.loads(descriptor.command)
        reply, results = self.intake.take(cmd, list(reader.read_all().to_batches()))
        writer.write_metadata(pa.py_buffer(json.dumps(reply).encode()))
        for result in results:
            writer.write_metadata(pa.py_buffer(result))

    def _act_fetch(self, body: bytes) -> dict:
        """What a peer parked for this node (``ticket`` at ``from``: a released key group's state,
        or the rows it had queued), fetched straight from it and taken as the ``put`` command
        says: a handoff's bytes cross once, node to node, not through the driver."""
        msg = json.loads(body)
        options = self._peer_options[0]
        peer = self._peer(msg["from"])
        try:
            table = peer.do_get(flight.Ticket(msg["ticket"].encode()), options).read_all()
        except Exception:  # a peer gone or restarted: connect afresh next time
            with self._peers_lock:
                self._peers.pop(msg["from"], None)
            raise
        self._put(msg["put"], table.to_batches())
        return {"ok": True, "bytes": table.nbytes}

    def _peer(self, location: str) -> flight.FlightClient:
        """A client of the peer node at ``location``, kept: a connection each fetch cost a
        handoff's move several milliseconds."""
        with self._peers_lock:
            peer = self._peers.get(location)
            if peer is None:
                peer = self._peers[location] = flight.FlightClient(location, **self._peer_options[1])
            return peer

    def _act_take_shared(self, body: bytes):
        """Rows a writer on this host staged in shared memory (see cluster.shm_transport): taken
        before the call returns (the writer reuses the segment)."""
        cmd = json.loads(body)
        try:
            with staged_batches(cmd["segment"], int(cmd["size"])) as batches:
                reply, results = self.intake.take(cmd, batches)
                del batches
        except NotVisible as e:
            raise flight.FlightServerError(str(e)) from None
        return [json.dumps(reply).encode(), *results]

    def _load(self, cmd: dict, batches: list[pa.RecordBatch]) -> None:
        self.load_into(self.job(cmd["job"]), cmd["operator"], cmd["description"], batches)

    @staticmethod
    def load_into(job: NodeJob, operator: str, description: dict, batches) -> None:
        arena = job.arena(operator)
        if description["key_mode"] and arena.key_mode() not in (0, description["key_mode"]):
            raise flight.FlightServerError(f"operator {operator!r} holds keys of another type here")
        prepare_arena(arena, description)
        names = [e["name"] for e in arena.registry()]
        wanted = [e["name"] for e in description["registry"]]
        if names[: len(wanted)] != wanted:
            raise flight.FlightServerError(
                f"operator {operator!r} declared its states in another order here ({names}) than "
                f"on the node the key groups come from ({wanted})"
            )
        load_key_groups(arena, batches)

    # ---- state out ------------------------------------------------------------------------------
    @plain_errors
    def do_get(self, context, ticket):
        kind, _, rest = ticket.ticket.decode().partition(":")
        if kind == "snapshot":
            batches = self.parked.pop(rest, [])
            return flight.RecordBatchStream(pa.Table.from_batches(batches, SNAPSHOT_SCHEMA))
        if kind == "forward":  # rows of released key groups that were queued behind the frontier
            table = self.handoff.forwarded(rest)
            if table is None:
                raise flight.FlightServerError(
                    f"no forwarded rows under ticket {rest!r} on node {self.node_id}"
                )
            return flight.RecordBatchStream(table)
        if kind == "stage":  # stage transaction parts a release parked
            return flight.RecordBatchStream(self.parked_stage.pop(rest, STAGE_SCHEMA.empty_table()))
        if kind == "broadcast":  # a fenced job's broadcast states: one row per broadcast operator
            states = self.parked_broadcast.pop(rest, {})
            table = pa.table(
                {
                    "operator": pa.array(list(states), pa.string()),
                    "state": pa.array(list(states.values()), pa.large_binary()),
                }
            )
            return flight.RecordBatchStream(table)
        if kind == "state":  # <job>:<operator>, or {"job", "operator", "key_groups"}
            if rest.startswith("{"):
                msg = json.loads(rest)
                job_name, operator, groups = msg["job"], msg["operator"], msg.get("key_groups")
            else:
                (job_name, _, operator), groups = rest.partition(":"), None
            job = self.job(job_name)
            return flight.RecordBatchStream(read_state(KeyedTable(job.arena(operator)), groups))
        if kind == "output":
            return flight.RecordBatchStream(output_range(self._output_request(json.loads(rest))))
        raise flight.FlightServerError(f"unknown ticket {kind!r}")

    # ---- actions --------------------------------------------------------------------------------
    @plain_errors
    def do_action(self, context, action):
        handler = getattr(self, "_act_" + action.type, None)
        if handler is None:
            raise flight.FlightServerError(f"unknown action {action.type!r}")
        body = action.body.to_pybytes() if action.body is not None else b""
        result = handler(body)
        if isinstance(result, list):  # a JSON reply and binary results
            return [flight.Result(r) for r in result]
        return [flight.Result(json.dumps(result).encode())]

    def job(self, name: str) -> NodeJob:
        job = self.jobs.get(name)
        if job is None:
            raise flight.FlightServerError(
                f"no job {name!r} on node {self.node_id} (jobs: {sorted(self.jobs)})"
            )
        return job

    def _act_submit(self, body: bytes) -> dict:
        return self._submit(cloudpickle.loads(body))  # the caller holds the cluster's secret

    def _act_join(self, body: bytes) -> dict:
        """Submit a job with broadcast state on a node that joins the cluster: its broadcast
        operators start from the state another node held at its fence (``broadcast_fence``), with
        that node's broadcast marks, and it takes broadcast rows of membership ``members`` on."""
        msg = cloudpickle.loads(body)
        spec = cloudpickle.loads(msg["spec"])
        reply = self._submit(spec, msg["states"])
        with self.lock:
            job = self.job(spec["name"])
            for channel, query, batch in msg["marks"]:
                job.broadcast_marks[(channel, query)] = batch
            if job.checkpoint_dir is not None:  # a restarted driver may start from here
                broadcast_restore.save_start(
                    job.checkpoint_dir, self.node_id, job.name, msg["states"], msg["marks"]
                )
            self.members = max(self.members, msg["members"])
        return reply

    def _act_broadcast_fence(self, body: bytes) -> dict:
        """From now on refuse broadcast rows of a membership older than ``members``, and park each
        job's broadcast state as of every broadcast row taken before (for a ``do_get``
        ``broadcast:<ticket>``), with its broadcast marks: what a joining node starts from."""
        msg = json.loads(body)
        with self.lock:
            self.members = max(self.members, msg["members"])
            jobs = [job for job in self.jobs.values() if job.broadcast_ops]
            marks = {job.name: [[c, q, b] for (c, q), b in job.broadcast_marks.items()] for job in jobs}
        tickets = {}
        for job in jobs:  # no broadcast row comes in meanwhile: none of the new membership is sent yet
            barrier_all(job)
            ticket = tickets[job.name] = str(next(self._tickets))
            self.parked_broadcast[ticket] = job.broadcast_states()
        return {"tickets": tickets, "marks": marks}

    def _act_broadcast_leave(self, body: bytes) -> dict:
        """A node leaving the cluster takes no more broadcast rows: writers still sending it some
        learn the membership without it."""
        with self.lock:
            self.members = LEFT_CLUSTER
        return {"ok": True}

    def _submit(self, spec: dict, broadcast_start: dict[str, bytes] | None = None) -> dict:
        with self.lock:
            if spec["name"] in self.jobs:
                raise flight.FlightServerError(f"job {spec['name']!r} already runs on node {self.node_id}")
            if self.max_parallelism not in (None, spec["plan"].max_parallelism):
                raise flight.FlightServerError(
                    "every job of a cluster must have the cluster's max parallelism"
                )
            durable = self.checkpoint_dir if spec.get("checkpointed") else None
            job = NodeJob(spec["name"], self.node_id, spec["plan"], spec["config"], durable, broadcast_start)
            job.event_time.guard = self.lock  # its idleness ticks append to channels as writes do
            self.jobs[spec["name"]] = job
            if durable is not None:  # where its output starts, should the node die before a checkpoint
                manifest = recovery.load_manifest(durable, self.node_id)
                manifest["outputs"][job.name] = {c: log.end_offset for c, _r, log in job.outputs()}
                manifest["journal"][job.name] = job.journal_offsets()
                recovery.save_manifest(durable, self.node_id, manifest)
            self.place(job)  # its tables now, not in the first handoff's stall
            barrier_all(job)
        job = self.jobs[spec["name"]]  # its output starts here: earlier runs of the name came before
        return {**job.run_record(), "outputs": {c: log.end_offset for c, _r, log in job.outputs()}}

    def _act_own(self, body: bytes) -> dict:
        """The key groups this node owns from now on (a node that starts, or restarts)."""
        msg = json.loads(body)
        with self.lock:
            self.max_parallelism = msg["max_parallelism"]
            owned = np.zeros(self.max_parallelism, dtype=bool)
            owned[msg["key_groups"]] = True
            self.owned, self.version = owned, msg["version"]
            for job in self.jobs.values():
                self.place(job)
        return {"ok": True}

    def place(self, job: NodeJob) -> None:
        """Tell the job's instances which key groups' state is on this node: the others are
        away, and stay so while a handoff loads them (see KeyedTable.set_away)."""
        if job.coordinator.status.name != "RUNNING":
            return
        owned = self.owned if self.owned is not None else np.zeros(job.max_parallelism, bool)
        for operator in job.keyed:
            table = KeyedTable(job.arena(operator))
            table.set_away(np.flatnonzero(~owned), True)
            table.set_away(np.flatnonzero(owned), False)
        job.align(owned)  # its instances share the key groups here among them

    def _act_precopy(self, body: bytes) -> dict:
        """Copy key groups out ahead of their release, still taking their rows (cluster.node_handoff)."""
        return self.handoff.precopy(body)

    def _act_preadopt(self, body: bytes) -> dict:
        """Process pre-copied key groups, still refusing writers' rows of them (cluster.node_handoff)."""
        return self.handoff.preadopt(body)

    def _act_unprecopy(self, body: bytes) -> dict:
        """Take back pre-copied key groups whose move was abandoned (cluster.node_handoff)."""
        return self.handoff.unprecopy(body)

    def _act_unpreadopt(self, body: bytes) -> dict:
        """Give back, or drop, what an abandoned move pre-adopted here (cluster.node_handoff)."""
        return self.handoff.unpreadopt(body)

    def _act_release(self, body: bytes) -> dict:
        """Give up key groups at the readers' frontier (cluster.node_handoff)."""
        return self.handoff.release(body)

    def _act_adopt(self, body: bytes) -> dict:
        """Own key groups whose state was loaded, their forwarded rows first (cluster.node_handoff)."""
        return self.handoff.adopt(body)

    def ticket(self) -> str:
        """A fresh ticket for something parked for a ``do_get``."""
        return str(next(self._tickets))

    def running(self) -> list[NodeJob]:
        """The jobs whose key groups move with a handoff: a job that ended here (its sources
        ended) takes no more rows, and its shared memory went with its engine; its state stays."""
        return [job for job in self.jobs.values() if job.coordinator.status.name == "RUNNING"]

    # ---- checkpoints and recovery (a cluster with a checkpoint directory: node_checkpoints) ---
    def _act_checkpoint(self, body: bytes) -> dict:
        return self.checkpoints.act_checkpoint(body)

    def _act_recover(self, body: bytes) -> dict:
        return self.checkpoints.act_recover(body)

    def _act_broadcast_replay(self, body: bytes) -> dict:
        return self.checkpoints.act_broadcast_replay(body)

    def _act_status(self, body: bytes) -> dict:
        return {
            "node": self.node_id,
            "version": self.version,
            "key_groups": np.flatnonzero(self.owned).tolist() if self.owned is not None else [],
            "precopies": sorted(self.handoff.precopies),  # each pins its operators' gates until released
            "jobs": {name: j.client.describe() for name, j in self.jobs.items()},
        }

    def _act_output(self, body: bytes) -> dict:
        """An output log's readable offsets and schema (``output_logs.output_info``)."""
        return output_info(self._output_request(json.loads(body)))

    def _output_request(self, msg: dict) -> dict:
        """A request for ``<job>@<node>``'s output log, with this node's run of the job when it
        is this node's (not another cluster's job of that name on this host)."""
        name, _, node = msg["job"].rpartition("@")
        job = self.jobs.get(name) if node == self.node_id else None
        return msg if job is None else {**msg, "run": job.run_record()}

    def _act_state_schema(self, body: bytes) -> dict:
        """The schema of an operator's keyed state rows here (as ``state:`` streams them)."""
        msg = json.loads(body)
        table = KeyedTable(self.job(msg["job"]).arena(msg["operator"]))
        kg = next((kg for kg in range(table.maxp) if table.n_keys(kg)), 0)
        return {"schema": encode_schema(read_key_group(table, kg).schema)}

    def _act_rescale(self, body: bytes) -> dict:
        msg = json.loads(body)
        report = self.job(msg["job"]).client.rescale(msg["operator"], msg["parallelism"], msg.get("timeout"))
        return {**report.__dict__}

    def _act_watermark(self, body: bytes) -> dict:
        """A writer's watermark progress on an event-time channel (cluster.node_watermarks): every
        node hears it, rows or none."""
        msg = json.loads(body)
        with self.lock:
            job = self.jobs.get(msg["job"])
            if job is not None and job.coordinator.status.name == "RUNNING":
                if "round" in msg:  # a stage task's (cluster.node_watermarks.RoundClock)
                    job.event_time.round_progress(msg["channel"], msg["query"], msg["round"], msg.get("max"))
                else:
                    job.event_time.observe(msg["channel"], msg)
        return {"ok": True}

    def _act_watermarks(self, body: bytes) -> dict:
        """Every event-time job's writers as this node has heard them (job -> channel -> state)."""
        with self.lock:
            return {
                name: job.event_time.state() for name, job in self.jobs.items() if job.event_time.channels
            }

    def _act_watermarks_load(self, body: bytes) -> dict:
        """A joining node starts from a member's view of the writers (``watermarks``): a writer that
        has not sent it rows or progress yet still holds its watermark back."""
        with self.lock:
            for name, state in json.loads(body).items():
                job = self.jobs.get(name)
                if job is not None and job.coordinator.status.name == "RUNNING":
                    job.event_time.load(state)
        return {"ok": True}

    def _act_end(self, body: bytes) -> dict:
        msg = json.loads(body)
        with self.lock:
            job = self.job(msg["job"])
            job.writer(msg["channel"]).end()
        return {"ok": True}

    def _act_ended_operators(self, body: bytes) -> dict:
        """Which keyed operators of a job ended here (cluster.forward_ends), and the job's status
        here (None: not here yet)."""
        job = self.jobs.get(json.loads(body)["job"])
        if job is None:
            return {"status": None, "ended": []}
        return {"status": job.coordinator.status.name, "ended": job.ended_operators()}

    def _act_forwarding(self, body: bytes) -> dict:
        """Hold (``hold``) or let go on the forward logs of every job here (cluster.forward_log)."""
        held = bool(json.loads(body)["hold"])
        for job in list(self.jobs.values()):
            job.hold_forwarding(held)
        return {"ok": True}

    def _act_forwarded(self, body: bytes) -> dict:
        """Return once every job here sent what its forward logs committed so far (no lock held:
        the batches may be going to this node)."""
        for job in list(self.jobs.values()):
            job.wait_forwarded()
        return {"ok": True}

    def _act_wait(self, body: bytes) -> dict:
        msg = json.loads(body)
        job = self.job(msg["job"])
        try:
            status = job.client.wait(msg.get("timeout"))
        except Exception as e:  # the job failed: say how
            return {"status": "FAILED", "error": f"{type(e).__name__}: {e}"}
        return {"status": status.name if status is not None else job.client.describe().get("status")}

    def _act_failed(self, body: bytes) -> dict:
        """Jobs that failed here, each with its error (the cluster then cancels it elsewhere)."""
        return {
            name: f"{type(job.coordinator.error).__name__}: {job.coordinator.error}"
            for name, job in self.jobs.items()
            if job.coordinator.status.name == "FAILED"
        }

    def _act_cancel(self, body: bytes) -> dict:
        msg = json.loads(body)
        self.job(msg["job"]).client.cancel()
        return {"ok": True}

    def _act_retire(self, body: bytes) -> dict:
        """A node leaving the cluster, its key groups handed away: end its jobs' input channels so
        that each job finishes, its outputs complete and readable after the node is gone."""
        with self.lock:
            for job in self.running():
                for channel in [*job.inputs, *job.broadcast]:
                    try:
                        job.writer(channel).end()
                    except Exception:
                        if job.coordinator.status.name == "RUNNING":
                            raise  # not one ending meanwhile, as its sources end (cluster.sources)
        statuses = {name: self._act_wait(json.dumps({"job": name}).encode())["status"] for name in self.jobs}
        for job in list(self.jobs.values()):  # its forward logs' ends (a last watermark) are sent
            job.wait_drained()
        return statuses

    def _act_source_read(self, body: bytes) -> dict:
        """Read splits of a job's file sources (a pickled order: the caller holds the secret)."""
        return self.sources.start(cloudpickle.loads(body))

    def _act_source_stop(self, body: bytes) -> dict:
        """Stop reading a job's splits; returns how far the split being read got."""
        return self.sources.stop(json.loads(body)["job"])

    def _act_shutdown(self, body: bytes) -> dict:
        threading.Thread(target=self.stop, daemon=True).start()
        return {"ok": True}

    def stop(self) -> None:
        """Cancel every job, wait for it, and stop serving."""
        self.sources.stop_all()
        for job in self.jobs.values():
            try:
                job.client.cancel()
                job.client.wait()
            except Exception:
                pass
            with self.lock:  # no idleness tick is appending to its channels (node_watermarks)
                job.close()
        with self._peers_lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()
        self.shutdown()


def warm_up() -> None:
    """Pay now, at the node's start, what a first handoff or write would otherwise wait for: the
    lazy imports behind Arrow -> numpy conversions (pandas, seconds on a busy host) and the
    key-group kernels."""
    empty = SNAPSHOT_SCHEMA.empty_table()
    for column in empty.columns[:3]:
        column.to_numpy()
    pa.array([0], pa.int32()).to_numpy()
    warm_key_groups()


def _exit_with_parent(server: NodeServer, parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stretch.cluster.node")
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args(argv)
    secret = os.environ.pop(SECRET_ENV, None)
    if not secret:
        sys.exit(f"{SECRET_ENV} must hold the cluster's secret")
    tls_json = os.environ.pop(TLS_ENV, None)
    tls = ClusterTLS.from_json(tls_json) if tls_json else None
    warm_up()
    server = NodeServer(args.node_id, secret, args.host, args.port, tls, args.checkpoint_dir)
    threading.Thread(target=_exit_with_parent, args=(server, os.getppid()), daemon=True).start()
    print(json.dumps({"port": server.port}), flush=True)
    server.serve()


if __name__ == "__main__":
    main()
