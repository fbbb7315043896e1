"""One job as a node runs it: the engine's job under ``<job>@<node>``, the writers of its input
channels, its (query, batch) marks, journals, the barrier through its keyed gates, and key groups
released at the readers' frontier of them (with the rows of theirs queued behind it) and taken
back."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import pyarrow as pa

from stretch.channels import open_writer
from stretch.cluster import recovery
from stretch.cluster.forward_log import Forwarder, ForwardLog
from stretch.cluster.forward_sink import ForwardSink
from stretch.cluster.node_plans import broadcast_channels, cluster_inputs, node_plan
from stretch.cluster.node_watermarks import NodeEventTime
from stretch.cluster.stage_parts import StageParts
from stretch.datastream.job_client import JobClient
from stretch.errors import InputEnded
from stretch.jobs import find
from stretch.runtime.batch import KG_COLUMN
from stretch.runtime.broadcast_board import BroadcastBoard
from stretch.runtime.channel_log import ChannelLog
from stretch.runtime.coordinator import Coordinator
from stretch.runtime.event_time import judge_of, judged
from stretch.runtime.transactions import txn_of
from stretch.state.arena import Arena

AT_TAIL_ENV = "STRETCH_HANDOFF_AT_TAIL"
"""Set in a node's environment, its handoffs work off the moving key groups' backlog before they
release them, as every handoff did before they stopped at the frontier: a baseline for
side-by-side measurements (experiments/cluster_backlog.py), not a setting."""
APPEND_ROWS = 1 << 16  # rows per gate entry when queued rows go into a gate again
RELEASE_TIMEOUT = 60.0
"""How long a release waits for every instance of an operator to pass the frontier (they are
within milliseconds of each other, unless one is stuck in user code)."""


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
        self.keyed = [s.name for s in plan.stages if s.kind == "keyed"]  # inputs before consumers
        self.forwards = {  # channel -> the keyed operator forwarding into it (cluster.rekey_plans)
            s.sink.channel: plan.stages[s.producers[0]].name
            for s in plan.sinks
            if isinstance(s.sink, (ForwardSink, ForwardLog))
        }
        for s in plan.sinks:
            if isinstance(s.sink, ForwardSink):
                s.sink.node = node_id  # its instances are splits named after this node
        self.checkpoint_dir = checkpoint_dir
        strategies = {c: r.watermarks for c, r in self.inputs.items() if r.watermarks is not None}
        self.coordinator = Coordinator(node_plan(plan), f"{name}@{node_id}", config)
        self.feeds = direct_feeds(self.coordinator.plan)
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
        # each event-time channel's writers and their watermarks (cluster.node_watermarks)
        self.event_time = NodeEventTime(
            strategies, lambda channel, mark: self.writer(channel).append_mark(mark)
        )
        self.broadcast_journals: dict[str, ChannelLog] = {}  # replayed whole by a restarted driver
        self.stage = StageParts(node_id, self)  # parts of Spark stage transactions taken here
        if checkpoint_dir is not None:
            for channel in self.broadcast:
                journal = self.broadcast_journals[channel] = recovery.open_journal(
                    checkpoint_dir, node_id, name, channel
                )
                journal.register("checkpoint", 0)
        self.forwarders = {  # a checkpointed job's forwards: sent as checkpoints commit them
            channel: Forwarder(name, node_id, channel, runner.spec.sink.reach, log.dir, log.end_offset)
            for channel, runner, log in self.outputs()
            if isinstance(runner.spec.sink, ForwardLog)
        }

    def run_record(self) -> dict:
        """Which run of the job this is (its job id, its output logs' directories): what readers
        find it by where another cluster's job of the same name may run on the host too."""
        return {
            "job_id": self.client.get_job_id(),
            "logs": {c: str(log.dir) for c, _r, log in self.outputs()},
        }

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
        watermark = self.event_time.now(channel)
        if watermark is not None and judge_of(rows) is None:  # taken here first: judged by ours
            rows = judged(rows, watermark)
        if journal is not None:
            journal.append(recovery.tagged(rows, query, batch_id, stage[1] if stage else None))
        writer = self.writer(channel)
        if stage is None:
            writer.write(rows)
            return
        txn, name = stage
        writer.write(rows, txn)
        for mark in self.event_time.in_part(channel, name[1], name[2]):  # the micro-batch rule
            writer.append_mark(mark)
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

    def ended_operators(self) -> list[str]:
        """The keyed operators whose every instance here ended and whose forwards sent all they
        forwarded (through a log: all of it)."""
        co = self.coordinator
        sending = {self.forwards[c] for c, f in self.forwarders.items() if not f.drained()}
        return [
            s.name
            for s in co.plan.stages
            if s.kind == "keyed" and co.stage_finished(s.id) and s.name not in sending
        ]

    def hold_forwarding(self, held: bool) -> None:
        """Stop (or let go on) sending the forward logs (cluster.forward_log: a handoff's new
        owner waits for the old owner to send what it committed)."""
        for forwarder in self.forwarders.values():
            forwarder.hold(held)

    def wait_forwarded(self, timeout: float = 60.0) -> None:
        """Return once every forward log's batches committed now are sent."""
        for forwarder in self.forwarders.values():
            forwarder.wait_sent(timeout)

    def wait_drained(self, timeout: float = 60.0) -> None:
        """Return once every forward log of a job that finished here is sent to its end."""
        deadline = time.monotonic() + timeout
        while self.coordinator.status.name == "FINISHED" and not all(
            f.drained() for f in self.forwarders.values()
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the forward logs of job {self.name!r} were not sent within {timeout} s")
            time.sleep(0.005)

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

    # ---- key groups released at the readers' frontier, and taken back ---------------------------
    def release(
        self, operator: str, kgs, timeout: float = RELEASE_TIMEOUT, hold: bool = False
    ) -> list[pa.RecordBatch] | None:
        """Stop processing ``kgs`` in ``operator`` at the readers' frontier of its gate: their
        state here is final as of it once this returns, with the rows of theirs queued behind it
        (which no instance here processes; normalized by ``queued_batch``). The node stopped
        taking rows of ``kgs`` before, unless it ``hold``s the release: then it still takes them,
        and ``release_rest`` returns those once it stopped (``Rescaler.release``).

        None if they cannot stop there, and the caller works off the backlog instead (a barrier):
        a source task feeds the operator (rows of theirs may still be on the way to its gate), the
        operator's input ended, or so few key groups would be left here that an instance would own
        none (``rescaler.keep_every_instance``)."""
        co = self.coordinator
        stage = co.plan.stage(operator)
        kgs = sorted({int(kg) for kg in kgs})
        away = set(co.rescaler.away.get(stage.id, {}))
        left = stage.max_parallelism - len(away.union(kgs))
        if self.feeds.get(operator) is None or left < co.parallelism_of(stage.id):
            return None
        try:
            released = co.release(operator, kgs, timeout, hold)
        except InputEnded:  # what is left of the input is read already: the barrier is short
            return None
        return self._queued(operator, released.batches)

    def release_rest(self, operator: str, kgs) -> list[pa.RecordBatch]:
        """The rows of ``kgs`` appended behind their held ``release`` since it returned."""
        return self._queued(operator, self.coordinator.release_rest(operator, kgs))

    def _queued(self, operator: str, batches) -> list[pa.RecordBatch]:
        out = []
        for batch in batches:
            if txn_of(batch)[0]:
                raise RuntimeError(
                    f"rows of a stage transaction of job {self.name!r} were queued behind the release of "
                    f"key groups of {operator!r}: its parts should have completed first"
                )
            out.append(queued_batch(batch))
        return out

    def keepers(self, operator: str, held, moving) -> set[int]:
        """The fewest key groups of ``held`` (this node's) that ``freeze`` must not release, so that
        every instance of ``operator`` keeps one (those not moving first): a node that owns nearly
        every key group."""
        co = self.coordinator
        stage = co.plan.stage(operator)
        away = set(co.rescaler.away.get(stage.id, {}))
        need = co.parallelism_of(stage.id) - (stage.max_parallelism - len(away.union(held)))
        if need <= 0:
            return set()
        moving = set(moving)
        ordered = [kg for kg in held if kg not in moving] + [kg for kg in held if kg in moving]
        return set(ordered[:need])

    def freeze(self, held, moving) -> dict[str, tuple[list[pa.RecordBatch], set[int]]]:
        """Release every key group this node holds (``held``, of which ``moving`` leave it) at the
        frontier of each keyed operator that can (see ``release``): per operator, the rows queued
        behind it and the keepers it did not release (their backlog is short: a barrier works it
        off while the others skip theirs). What a release checkpoint takes at the frontier."""
        frozen = {}
        if at_tail():
            return frozen
        for operator in self.keyed:
            keep = self.keepers(operator, held, moving)
            batches = self.release(operator, [kg for kg in held if kg not in keep])
            if batches is not None:
                frozen[operator] = (batches, keep)
        return frozen

    def take_back(self, kgs, operators=None) -> None:
        """Process ``kgs`` again in each keyed operator (``operators``: those) that released them,
        from after every row of theirs it had queued: before rows of theirs are appended again (key
        groups that come back to this node, or that a release checkpoint froze)."""
        co = self.coordinator
        for operator in self.keyed if operators is None else operators:
            away = co.rescaler.away.get(co.plan.stage(operator).id, {})
            back = sorted({int(kg) for kg in kgs} & set(away))
            if back:
                with contextlib.suppress(InputEnded):  # it read all its input: nothing is left to process
                    co.own(operator, back)

    def align(self, owned: np.ndarray) -> None:
        """Let the instances of each keyed operator fed straight by channels own the key groups
        this node owns (``owned``: bools), spread over all of them, and a few spares: the others
        are released (writers send none of their rows here).

        Otherwise an instance's range could hold only other nodes' key groups: it would get no
        rows, leave the work to the others, and read ahead of them to the gate's tail while their
        pace is not known, taking the frontier of every later release with it. The spares (as
        many as instances, of those not owned) let a release checkpoint release every key group
        the node owns and still leave each instance one (``rescaler.spread``)."""
        co = self.coordinator
        mine = {int(kg) for kg in np.flatnonzero(owned)}
        for operator in self.keyed:
            if self.feeds.get(operator) is None:
                continue
            stage = co.plan.stage(operator)
            away = set(co.rescaler.away.get(stage.id, {}))
            others = [kg for kg in range(stage.max_parallelism) if kg not in mine and kg not in away]
            spares = co.parallelism_of(stage.id)
            short = spares - len(others)  # spares adopted since: others (no rows of theirs) instead
            back = sorted(mine & away) + sorted(away - mine)[: max(short, 0)]
            if back:
                with contextlib.suppress(InputEnded):
                    co.own(operator, back)
            extra = others[spares:]
            if extra:
                queued = self.release(operator, extra)
                if queued:
                    raise RuntimeError(
                        f"job {self.name!r} had rows queued of key groups {extra[:8]} its node does not own"
                    )

    def append(self, operator: str, batches) -> int:
        """Rows of ``operator``'s gate that were queued behind a release (here or on the key
        groups' old owner), into its gate as they were, not keyed again and not journaled (the
        checkpoint that names them keeps them, if the job is checkpointed); how many."""
        if not batches:
            return 0
        channels_ = self.feeds.get(operator)
        if not channels_:
            raise RuntimeError(f"operator {operator!r} of job {self.name!r} is not fed straight by a channel")
        writer = self.writer(channels_[0])
        # one piece of each gate entry they came from: joined, they take a few of the gate's slots
        rows = pa.Table.from_batches(batches).combine_chunks()
        for batch in rows.to_batches(max_chunksize=APPEND_ROWS):
            writer.append_keyed(batch)
        return rows.num_rows

    def close(self) -> None:
        for forwarder in self.forwarders.values():
            forwarder.close()
        self.event_time.close()
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
    barrier(job, job.keyed)


def barrier(job: NodeJob, operators) -> None:
    """``barrier_all`` through the gates of ``operators`` only."""
    if job.coordinator.status.name != "RUNNING":
        return
    job.drain()
    for operator in operators:
        reply = job.client.control({"op": "barrier", "operator": operator})
        if not reply.get("ok"):
            raise RuntimeError(reply.get("error", f"the barrier of {operator!r} failed"))


def at_tail() -> bool:
    """Whether this node's handoffs work off the backlog first (``AT_TAIL_ENV``)."""
    return bool(os.environ.get(AT_TAIL_ENV))


def direct_feeds(plan) -> dict[str, list[str] | None]:
    """Keyed operator -> the input channels whose writers append straight into its gate; None for
    an operator a source task feeds (a key selector function, a broadcast operator's keyed input):
    rows of its key groups may be on their way there after a release."""
    feeds: dict[str, list[str] | None] = {}
    for stage in plan.stages:
        if stage.kind != "keyed":
            continue
        producers = [plan.stages[i] for i in plan.gate_producers.get(stage.input_gate, [])]
        direct = producers and all(p.kind == "source" and p.direct for p in producers)
        feeds[stage.name] = [p.source.channel_name for p in producers] if direct else None
    return feeds


def queued_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A gate batch as a node ships or keeps it: without schema metadata or the mark of a layout
    in runs of key groups (a filtered batch may no longer fill its runs), so that every batch of
    one gate has one schema (one Arrow stream, one file)."""
    schema = batch.schema
    i = schema.get_field_index(KG_COLUMN)
    schema = schema.set(i, schema.field(i).with_metadata(None)).remove_metadata()
    return pa.RecordBatch.from_arrays(batch.columns, schema=schema)


def rows_of(batches: list[pa.RecordBatch], kgs) -> list[pa.RecordBatch]:
    """The rows of ``kgs`` in queued gate batches, in order."""
    wanted = np.zeros(1 << 16, dtype=bool)
    wanted[list(kgs)] = True
    out = []
    for batch in batches:
        keep = wanted[batch.column(KG_COLUMN).to_numpy()]
        if keep.all():
            out.append(batch)
        elif keep.any():
            out.append(batch.filter(pa.array(keep)))
    return out
