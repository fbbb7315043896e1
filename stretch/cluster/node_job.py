"""One job as a node runs it: the engine's job under ``<job>@<node>``, the writers of its input
channels, its (query, batch) marks, journals and the barrier through its keyed gates."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from stretch.channels import open_writer
from stretch.cluster import recovery
from stretch.cluster.node_plans import broadcast_channels, cluster_inputs
from stretch.cluster.stage_parts import StageParts
from stretch.datastream.job_client import JobClient
from stretch.jobs import find
from stretch.runtime.broadcast_board import BroadcastBoard
from stretch.runtime.channel_log import ChannelLog
from stretch.runtime.coordinator import Coordinator
from stretch.state.arena import Arena


class NodeJob:
    """One job as this node runs it: under the name ``<job>@<node>`` so that nodes on one host
    keep apart their control sockets and output logs.

    ``checkpoint_dir`` (a checkpointed job on a cluster with one): the node journals every batch
    it takes before the job sees it, and its output channels show only what a checkpoint of the
    node covers (``commit``), so that another node can restore its key groups exactly."""

    def __init__(
        self,
        name: str,
        node_id: str,
        plan,
        config,
        checkpoint_dir: str | None = None,
        broadcast_start: dict[str, bytes] | None = None,
    ):
        self.name = name
        self.node_id = node_id
        self.inputs = cluster_inputs(plan)
        self.broadcast = broadcast_channels(plan)  # every node takes all their rows
        self.broadcast_marks: dict[tuple[str, str], int] = {}  # (channel, query) -> last batch taken
        self.broadcast_ops = {
            s.name: s.id
            for s in plan.stages
            if s.operator is not None and s.operator.kind == "broadcast_process"
        }
        self.max_parallelism = plan.max_parallelism
        self.keyed = [s.name for s in plan.stages if s.kind == "keyed"]
        self.checkpoint_dir = checkpoint_dir
        self.coordinator = Coordinator(plan, f"{name}@{node_id}", config)
        for operator, state in (broadcast_start or {}).items():  # before any instance starts
            self.coordinator.broadcast_start[self.broadcast_ops[operator]] = state
        self.client = JobClient(self.coordinator)._start()
        self.job = find(self.client)
        self.writers: dict = {}
        self.marks: dict[tuple[str, str], np.ndarray] = {}  # (channel, query) -> last batch per key group
        self._arenas: dict[str, Arena] = {}
        self.journals: dict[str, ChannelLog] = {}
        if checkpoint_dir is not None:
            for channel in self.inputs:
                journal = self.journals[channel] = recovery.open_journal(
                    checkpoint_dir, node_id, name, channel
                )
                journal.register("checkpoint", 0)  # keeps what the latest checkpoint does not cover
            for _channel, _runner, log in self.outputs():
                log.set_committed(log.end_offset)  # nothing shows before a checkpoint covers it
        self.broadcast_journals: dict[str, ChannelLog] = {}  # replayed whole by a restarted driver
        self.stage = StageParts(node_id, self)  # parts of Spark stage transactions taken here
        if checkpoint_dir is not None:
            for channel in self.broadcast:
                journal = self.broadcast_journals[channel] = recovery.open_journal(
                    checkpoint_dir, node_id, name, channel
                )
                journal.register("checkpoint", 0)

    def outputs(self) -> list:
        """(channel, sink runner, log) of each output channel the job writes itself."""
        return [
            (r.spec.sink.channel_name, r, r.writer.log)
            for r in self.coordinator._sink_runners
            if getattr(r.writer, "log", None) is not None
        ]

    def take(self, channel: str, rows: pa.RecordBatch, query, batch_id, stage: tuple | None = None) -> None:
        """Rows into the job: journaled first (a checkpointed job), so that a node restoring this
        node's key groups finds every row the job was given. ``stage``: (transaction number,
        name) of the stage transaction part they are (cluster.stage_parts): the rows go in as
        that transaction of the engine, ended by its marker."""
        journal = self.journals.get(channel, self.broadcast_journals.get(channel))
        if journal is not None:
            journal.append(recovery.tagged(rows, query, batch_id, stage[1] if stage else None))
        writer = self.writer(channel)
        if stage is None:
            writer.write(rows)
            return
        txn, name = stage
        writer.write(rows, txn)
        writer.end_txn(txn, name)

    def output_channel(self, name: str):
        """The engine's output channel ``name`` (its log, and the results of its transactions)."""
        out = self.coordinator.channels.outputs.get(name)
        if out is None:
            raise LookupError(
                f"job {self.name!r} has no output channel {name!r} "
                f"(output channels: {sorted(self.coordinator.channels.outputs)})"
            )
        return out

    def flush(self, timeout: float = 60.0) -> None:
        """Return once every row taken is processed (a barrier through each keyed gate) and each
        output channel's log holds all it produced."""
        barrier_all(self)
        deadline = time.monotonic() + timeout
        for _channel, runner, _log in self.outputs():
            tail = runner.gate.tail
            while runner.gate.cursor(0) < tail and not runner.finished:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"output {runner.spec.name!r} of job {self.name!r} did not catch up")
                time.sleep(0.001)

    def drain(self, timeout: float = 60.0) -> None:
        """Return once the job's sources read every row appended to the channels they read (those
        not keyed right away, such as a broadcast operator's inputs): a barrier through the keyed
        gates then covers them too."""
        deadline = time.monotonic() + timeout
        for channel, gate in self.coordinator.channels.inputs.items():
            tail = gate.tail
            while gate.cursor(0) < tail and self.coordinator.status.name == "RUNNING":
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the source of channel {channel!r} of job {self.name!r} did not catch up"
                    )
                time.sleep(0.001)

    def broadcast_states(self) -> dict[str, bytes]:
        """Each broadcast operator's broadcast state (pickled), as of the rows barriered so far:
        the latest version its board holds."""
        states = {}
        for operator, stage_id in self.broadcast_ops.items():
            board = BroadcastBoard.attach(self.coordinator.resources.boards[stage_id])
            try:
                states[operator] = board.before(1 << 40) or b""
            finally:
                board.close()
        return states

    def journal_offsets(self) -> dict[str, int]:
        return {channel: log.end_offset for channel, log in self.journals.items()}

    def marks_of(self, kgs) -> list:
        return [
            [channel, query, {int(kg): int(mark[kg]) for kg in kgs if mark[kg] >= 0}]
            for (channel, query), mark in self.marks.items()
        ]

    def writer(self, channel: str):
        w = self.writers.get(channel)
        if w is None:
            if channel not in self.inputs and channel not in self.broadcast:
                raise KeyError(
                    f"job {self.name!r} has no input channel {channel!r} (inputs: {sorted(self.inputs)})"
                )
            w = self.writers[channel] = open_writer(self.client, channel)
        return w

    def arena(self, operator: str) -> Arena:
        a = self._arenas.get(operator)
        if a is None:
            a = self._arenas[operator] = Arena.attach(self.job.state_location(operator)["arena"])
        return a

    def mark(self, channel: str, query: str) -> np.ndarray:
        m = self.marks.get((channel, query))
        if m is None:
            m = self.marks[(channel, query)] = np.full(self.max_parallelism, -1, dtype=np.int64)
        return m

    def close(self) -> None:
        self.stage.close()
        for a in self._arenas.values():
            a.close()
        self._arenas.clear()
        for log in [*self.journals.values(), *self.broadcast_journals.values()]:
            log.close()

    def broadcast_point(self) -> dict:
        """Its broadcast states, broadcast marks and broadcast journals' ends now (after a
        flush): where a restarted driver's new nodes can start the job from."""
        return {
            "states": self.broadcast_states(),
            "marks": [[c, q, b] for (c, q), b in self.broadcast_marks.items()],
            "journal": {channel: log.end_offset for channel, log in self.broadcast_journals.items()},
        }


def barrier_all(job: NodeJob) -> None:
    """Return once every keyed operator of ``job`` processed every row appended before this call.

    The engine's barrier places an epoch record at the current parallelism in the operator's
    gate and returns when every instance has passed it; rows of channels that pass a source stage
    first (a broadcast operator's inputs) are drained into the gates before. A job that ended
    (its sources ended: bounded ones, or every input channel) processed every row already.
    """
    if job.coordinator.status.name != "RUNNING":
        return
    job.drain()
    for operator in job.keyed:
        reply = job.client.control({"op": "barrier", "operator": operator})
        if not reply.get("ok"):
            raise RuntimeError(reply.get("error", f"the barrier of {operator!r} failed"))
