"""What a worker runs: a source task, or one instance of a keyed operator reading its gate."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stretch.contracts.metrics import MetricGroup
from stretch.plan.stages import StageSpec
from stretch.runtime import control_block as cbk
from stretch.runtime.batch import KG_COLUMN, Records
from stretch.runtime.broadcast_board import BroadcastBoard
from stretch.runtime.chain import Chain
from stretch.runtime.channel_source import read_channel
from stretch.runtime.checkpointing import Barrier, broadcast_file, snapshot_file, write_snapshot_or_report
from stretch.runtime.code_update import load_version, updated_step
from stretch.runtime.control_block import ControlBlock
from stretch.runtime.event_time import MAX_WATERMARK, MIN_WATERMARK, WatermarkTracker, producer_id
from stretch.runtime.gate import Gate, Kind
from stretch.runtime.key_group_runs import laid_out, owned_ranges, owns_all, spans
from stretch.runtime.operators import InstanceRuntimeContext, make_operator
from stretch.runtime.operators.broadcast import SAVER_GROUP
from stretch.runtime.outputs import Outputs, open_function
from stretch.runtime.resources import JobResources
from stretch.runtime.state_dir import write_private
from stretch.runtime.transactions import MarkCounter, round_of, txn_of
from stretch.state.arena import Arena
from stretch.state.keyed_table import KeyedTable, writable
from stretch.state.snapshot import copy_key_groups
from stretch.state.timers import EVENT, PROCESSING


@dataclass
class Assignment:
    """A task for a worker: which stage, which instance, and the job's segments."""

    resources: JobResources
    stage: StageSpec
    index: int = 0
    epoch: int = 0
    position: int = 0  # where a source restarts: the position its checkpoint recorded (Source.advance)
    code: int = 0  # a keyed operator's code version where the instance starts reading (live updates)


class Stopped(Exception):
    """The coordinator asked the task to stop."""


class _Attached:
    """Lazily attached segments of one job, shared by the tasks a worker runs."""

    def __init__(self, resources: JobResources):
        self.resources = resources
        self._gates: dict[str, Gate] = {}
        self.control = ControlBlock.attach(resources.control, resources.n_keyed, resources.max_parallelism)
        self._arenas: dict[str, Arena] = {}
        self._tables: dict[str, KeyedTable] = {}
        self._boards: dict[str, BroadcastBoard] = {}

    def attach_all(self) -> None:
        """Map every segment of the job now (spare workers do it before they are needed)."""
        for name in (
            *self.resources.gates.values(),
            *self.resources.sink_gates.values(),
            *self.resources.channels.values(),
        ):
            self.gate(name)
        self.populate()

    def populate(self) -> None:
        """Keep an idle worker's page tables covering the live state (it grows while we idle)."""
        for name in self.resources.arenas.values():
            if name not in self._tables:
                self._tables[name] = KeyedTable(self.arena(name))
            self._tables[name].populate()

    def gate(self, name: str) -> Gate:
        g = self._gates.get(name)
        if g is None:
            g = self._gates[name] = Gate.attach(name)
        return g

    def board(self, name: str) -> BroadcastBoard:
        b = self._boards.get(name)
        if b is None:
            b = self._boards[name] = BroadcastBoard.attach(name)
        return b

    def arena(self, name: str) -> Arena:
        a = self._arenas.get(name)
        if a is None:
            a = self._arenas[name] = Arena.attach(name)
        return a


class Task:
    def __init__(self, assignment: Assignment, attached: _Attached, should_stop):
        self.a = assignment
        self.stage = assignment.stage
        self.res = assignment.resources
        self.attached = attached
        self.should_stop = should_stop
        self.op_index = self.res.keyed_index.get(self.stage.id, -1)
        self._records_out = 0
        self.metrics = MetricGroup()  # the user functions' metrics, which the worker reports

    def outputs(self, producer: int) -> Outputs:
        gates = {g: self.attached.gate(n) for g, n in self.res.gates.items()}
        sink_gates = {s: self.attached.gate(n) for s, n in self.res.sink_gates.items()}
        outputs = Outputs(gates, sink_gates, self.res.sinks, producer, self._count_out)
        if self.res.dead_letter_sink is not None:
            outputs.dead_letter_gate = sink_gates[self.res.dead_letter_sink]
        return outputs

    def channel_gate(self, name: str) -> Gate:
        """An input channel's gate."""
        return self.attached.gate(self.res.channels[name])

    def read_channel(self, name: str):
        """A ChannelSource's batches (see ``runtime.channel_source``)."""
        return read_channel(self, name)

    def _count_out(self, n: int) -> None:
        self._records_out += n


class SourceTask(Task):
    """Reads a source and pushes its batches through the chain into gates and sinks.

    Its position is what the source counts (``Source.advance``: items read, or records). At a
    checkpoint it records the position and waits until the coordinator has put the barrier behind
    its output; restarted from a checkpoint, a seekable source starts at the position, and any
    other is read again and skipped that many items.
    """

    def run(self) -> None:
        if self.a.code != self.stage.code_version:  # restarted after a live update of a step
            self.stage = load_version(self.res.code, self.stage.id, self.a.code)
        outputs = self.outputs(producer=1)
        outputs.producer_id = producer_id(self.stage.id, 0)
        chain = Chain(self.stage.chain, self.stage.name, outputs)
        chain.open(self._context())
        source_type = getattr(self.stage.source, "type_info", None)
        position = self.position = self.a.position
        source = self.stage.source
        skip = 0 if source.seekable else position
        barrier = Barrier(self.attached.control, self.stage.id) if self.res.checkpoints else None
        reader = source.create_reader(self)
        open_txn = 0  # no checkpoint barrier inside a stage transaction (runtime.transactions)
        cb = self.attached.control
        code_word = cb.stage_word(self.stage.id, cbk.S_CODE)
        try:
            for item in reader:
                if self.should_stop():
                    raise Stopped()
                if cb.load(code_word) > self.stage.code_version:  # a live update of a chained step
                    self._update(cb.load(code_word), chain)
                if item is None:  # the source waits for input: time passes all the same
                    chain.tick()
                elif skip:
                    skip -= 1
                    continue
                else:
                    if isinstance(item, list):
                        chain.push(Records(items=item, type_info=source_type))
                    else:
                        txn, end = txn_of(item)
                        chain.outputs.txn, chain.outputs.round = txn, round_of(item)
                        if end:
                            chain.end_txn(txn, 1)
                            open_txn = 0
                        else:
                            chain.push(Records(batch=item))
                            open_txn = txn
                    position = source.advance(position, item)
                if open_txn:
                    continue
                if barrier is not None and not barrier.source_reached(position, self.should_stop):
                    raise Stopped()
        finally:
            close = getattr(reader, "close", None)
            if close is not None:
                close()
        if barrier is not None:
            barrier.record_position(position)
        chain.finish()  # a bounded input ended: its watermark goes to the maximum
        chain.close()

    def _context(self) -> InstanceRuntimeContext:
        """What the chained steps of a source see: one instance, no keyed state."""
        return InstanceRuntimeContext(
            self.stage.name,
            0,
            lambda: 1,
            self.stage.max_parallelism,
            metrics=self.metrics,
            job_parameters=self.res.job_parameters,
        )

    def _update(self, version: int, chain: Chain) -> None:
        """Between two items: the chained step of the new code version takes over."""
        self.stage = load_version(self.res.code, self.stage.id, version)
        chain.update_step(updated_step(self.stage), self._context())
        cb = self.attached.control
        cb.signal(cb.stage_word(self.stage.id, cbk.S_CODE_DONE), version)


class KeyedInstanceTask(Task):
    """One instance of a keyed operator: reads every gate entry, processes the rows it owns (of a
    batch in runs of key groups, only those rows: ``runtime.key_group_runs``)."""

    retired = False  # set when a rescale removed this instance (it ended at the epoch marker)
    _parts = None
    board: BroadcastBoard | None = None  # a broadcast operator's: its broadcast state's versions

    def build(self) -> KeyedInstanceTask:
        """Construct everything that does not depend on the instance index.

        Spare workers build a task for each keyed operator ahead of time ("parked"), so an instance
        added by a rescale only has to learn its index and start reading.
        """
        stage = self.stage
        table = KeyedTable(self.attached.arena(self.res.arenas[stage.id]))
        outputs = self.outputs(producer=0)
        operator = make_operator(stage.operator, stage.name, table)
        operator.outputs = outputs  # for records its functions reject (the dead-letter policy)
        if stage.id in self.res.boards:
            self.board = self.attached.board(self.res.boards[stage.id])
        self._parts = (
            self.attached.gate(self.res.gates[stage.input_gate]),
            operator,
            outputs,
            Chain(stage.chain, stage.name, outputs),
        )
        return self

    def run(self) -> None:
        cb = self.attached.control
        op = self.op_index
        if self.a.code != self.stage.code_version:  # built before or after a live update
            self.stage, self._parts = load_version(self.res.code, self.stage.id, self.a.code), None
        stage, index = self.stage, self.a.index
        if self._parts is None:
            self.build()
        gate, operator, outputs, chain = self._parts
        outputs.producer = index + 1
        outputs.producer_id = producer_id(stage.id, index)
        epoch = self.a.epoch
        owners = cb.table(op, epoch).copy()
        operator.owned = np.flatnonzero(owners == index)
        ranges = owned_ranges(owners, index)
        everything = owns_all(ranges, stage.max_parallelism)
        stats = self.stats = cb.instances(op)[index]
        self._records_out = int(stats[cbk.I_RECORDS_OUT])  # a slot used before: continue its count
        stats[cbk.I_STATE] = cbk.RUNNING
        cb.announce(op, index, cbk.I_EPOCH, epoch)
        cb.announce(op, index, cbk.I_ACTIVE, epoch)
        # an instance added by a rescale learns the watermarks at its first marker instead
        self.tracker = WatermarkTracker(self.res.producers.get(stage.input_gate, ()))
        self.fresh = operator.owned.size == 0  # added by a rescale: it owns nothing before its marker
        cb.announce(op, index, cbk.I_CODE, stage.code_version)
        if self.board is not None:  # the broadcast state in force where this instance starts
            self._bind_board(operator, gate)
            operator.load_broadcast(self.board.before(gate.cursor(index)))
        open_function(operator, self._context(operator), stage.name)
        chain.open(self._context(operator))
        fused = hasattr(operator, "process_owned")
        marks = MarkCounter()
        seq = gate.cursor(index)
        next_processing_check = 0.0
        batch_mode = stage.batch  # BATCH mode: processing-time timers wait for the end of input, as in Flink
        while True:
            now = time.monotonic()
            if now >= next_processing_check and not batch_mode:  # processing-time timers, every few ms
                next_processing_check = now + 0.005
                chain.push(operator.fire(PROCESSING, time.time_ns() // 1_000_000))
            soon = not batch_mode and operator.next_timer(PROCESSING) < MAX_WATERMARK
            if not gate.wait(seq, timeout=0.005 if soon else 0.1):
                if self.should_stop():
                    raise Stopped()
                continue
            if self.should_stop():  # cancelled: stop now, not after draining the backlog
                raise Stopped()
            entry = gate.read(seq)
            if entry.kind is Kind.DATA:
                outputs.txn = entry.arg1
                t0 = time.perf_counter_ns()
                batch = entry.batch
                kgs = batch.column(KG_COLUMN).to_numpy()
                select = not everything  # rows of others to leave out
                if select and laid_out(batch):  # read only the runs of the key groups it owns
                    parts = [(batch.slice(a, b - a), writable(kgs[a:b])) for a, b in spans(kgs, ranges)]
                    select = False
                else:
                    parts = [(batch, writable(kgs))]
                n = 0
                for batch, kgs in parts:
                    if fused:
                        operator.position = seq  # where a broadcast operator's versions are placed
                        out = operator.process_owned(batch, kgs, owners, index)
                        if isinstance(out, list):  # results in order, of runs of the batch
                            for part in out:
                                chain.push(part)
                        elif out is not None:
                            chain.push(out)
                        n += operator.rows_in
                        continue
                    own, own_kgs = _own_rows(batch, kgs, owners, index) if select else (batch, kgs)
                    if own.num_rows:
                        n += own.num_rows
                        chain.push(operator.process(own, own_kgs))
                stats[cbk.I_RECORDS_IN] += n
                stats[cbk.I_RECORDS_OUT] = self._records_out
                stats[cbk.I_BATCHES] += 1
                stats[cbk.I_BUSY_NS] += time.perf_counter_ns() - t0
            elif entry.kind is Kind.WATERMARK:
                self._advance(operator, chain, self.tracker.watermark(entry.arg0, entry.arg1))
            elif entry.kind is Kind.IDLE:
                self._advance(operator, chain, self.tracker.go_idle(entry.arg0))
            elif entry.kind is Kind.LEAVE:
                self._advance(operator, chain, self.tracker.leave(entry.arg0))
            elif entry.kind is Kind.EPOCH:
                owners = self._switch(cb, op, index, owners, entry.arg0, gate, chain, operator)
                operator.owned = np.flatnonzero(owners == index)
                ranges = owned_ranges(owners, index)
                everything = owns_all(ranges, stage.max_parallelism)
                if self.retired:
                    chain.emit(Kind.LEAVE)  # downstream stops waiting for this producer's watermark
                    break
            elif entry.kind is Kind.CHECKPOINT:
                self._checkpoint(entry.arg0, operator)
            elif entry.kind is Kind.UPDATE:
                operator = self._update(entry.arg0, operator, chain)
                fused = hasattr(operator, "process_owned")
            elif entry.kind is Kind.MARK and entry.arg1 and marks.ended(entry.arg1, entry.arg0):
                chain.end_txn(entry.arg1, int(owners.max()) + 1)  # the parallelism of this epoch
            elif entry.kind is Kind.END_OF_STREAM:
                gate.advance(index, seq + 1)
                if batch_mode:
                    chain.push(operator.fire(PROCESSING, MAX_WATERMARK))
                self._advance(
                    operator, chain, MAX_WATERMARK if self.tracker.current < MAX_WATERMARK else None
                )
                break
            seq += 1
            gate.advance(index, seq)
            stats[cbk.I_GATE_SEQ] = seq
        operator.close()
        chain.close()
        stats[cbk.I_RECORDS_OUT] = self._records_out
        stats[cbk.I_STATE] = cbk.DONE

    def _context(self, operator) -> InstanceRuntimeContext:
        cb, op = self.attached.control, self.op_index
        return InstanceRuntimeContext(
            self.stage.name,
            self.a.index,
            lambda: int(cb.header(op)[cbk.O_PARALLELISM]),
            self.stage.max_parallelism,
            operator.backend,
            self.metrics,
            self.res.job_parameters,
        )

    def _update(self, version: int, old, chain: Chain):
        """At an UPDATE record: close the old code, open the new version's on the same shared state
        (its timers, kept with the state, fire into the new code), and say so. A version that
        changed a chained step swaps only that step's function."""
        if version <= self.stage.code_version:
            return old  # started with this version already
        self.stage = load_version(self.res.code, self.stage.id, version)
        if self.stage.updated_step:
            chain.update_step(updated_step(self.stage), self._context(old))
            self.attached.control.announce(self.op_index, self.a.index, cbk.I_CODE, version)
            return old
        old.close()
        new = make_operator(self.stage.operator, self.stage.name, old.table)
        new.outputs, new.owned, new.watermark = old.outputs, old.owned, old.watermark
        if self.board is not None:  # the new code reads the same broadcast state
            self._bind_board(new, self._parts[0])
            new.load_broadcast(old.broadcast_bytes())
        for name in self.stage.drop_states:
            new.drop_state(name)
        new.open(self._context(new))
        self.attached.control.announce(self.op_index, self.a.index, cbk.I_CODE, version)
        return new

    def _bind_board(self, operator, gate: Gate) -> None:
        def waiting() -> None:
            if self.should_stop():
                raise Stopped()

        operator.bind(self.board, lambda: int(gate.active_cursors().min()), waiting)

    def _checkpoint(self, checkpoint: int, operator) -> None:
        """At a barrier: copy the key groups this instance owns, then wait for the release; the
        copy is written to the checkpoint's directory meanwhile and after (asynchronously)."""
        self.stats[cbk.I_BARRIER_AT_NS] = time.monotonic_ns()
        path = snapshot_file(Path(self.res.checkpoints), checkpoint, self.stage.id, self.a.index)
        batches = copy_key_groups(operator.table, operator.owned_here())
        if self.board is not None and SAVER_GROUP in operator.owned:  # before the barrier is passed
            write_private(broadcast_file(path.parent, self.stage.id), operator.broadcast_bytes())
        threading.Thread(target=write_snapshot_or_report, args=(batches, path), daemon=True).start()
        cb = self.attached.control
        cb.signal(cb.instance_word(self.op_index, self.a.index, cbk.I_CHECKPOINT), checkpoint)
        if not Barrier(cb, self.stage.id).wait_release(checkpoint, self.should_stop):
            raise Stopped()

    def _advance(self, operator, chain: Chain, watermark: int | None) -> None:
        """The input watermark advanced: fire the event-time timers it passed, then forward it."""
        if watermark is None:
            return
        self.tracker.current = max(self.tracker.current, watermark)
        operator.watermark = watermark
        self.stats[cbk.I_WATERMARK] = watermark
        chain.push(operator.fire(EVENT, watermark))
        chain.emit(Kind.WATERMARK, watermark)
        self.stats[cbk.I_RECORDS_OUT] = self._records_out

    def _switch(
        self,
        cb: ControlBlock,
        op: int,
        index: int,
        owners: np.ndarray,
        epoch: int,
        gate: Gate,
        chain: Chain,
        operator,
    ) -> np.ndarray:
        """Move to the next epoch's ownership at its marker (STRETCH's handoff).

        State is already in shared memory (every batch writes back), so this instance announces the
        epoch at once; it then waits only for the previous owners of key groups it gains to do the
        same. An instance that gains nothing never waits. An instance scaled away gives up its
        reader slot first, so the slot is free for reuse once the rescale is announced complete.
        Instances record the watermarks they track at the marker; an added instance starts from
        those, and (a broadcast operator's) from the broadcast state's version at the marker, once
        an instance that was there before has passed it (so every version before it is out).
        """
        new = cb.table(op, epoch).copy()
        if not self.fresh:
            cb.save_watermarks(op, epoch, self.tracker.state())
        if not (new == index).any():
            gate.close_reader(index)
            self.retired = True
        cb.announce(op, index, cbk.I_EPOCH, epoch)
        gained = (new == index) & (owners != index)
        t0 = time.perf_counter_ns()
        previous = sorted({int(p) for p in owners[gained]})
        if self.board is not None and self.fresh:
            previous = sorted({*previous, int(owners[SAVER_GROUP])})
        if previous:
            while not cb.wait_epochs(op, previous, epoch, timeout=0.1):
                if self.should_stop():
                    raise Stopped()
        stall = time.perf_counter_ns() - t0
        if self.fresh:
            state = cb.load_watermarks(op, epoch)
            if state is not None:
                self.tracker = WatermarkTracker.from_state(state)
                if self.tracker.current > MIN_WATERMARK:
                    self._advance(operator, chain, self.tracker.current)
            if self.board is not None:
                operator.load_broadcast(self.board.before(gate.cursor(index)))
            self.fresh = False
        stats = cb.instances(op)[index]
        stats[cbk.I_STALL_NS] += stall
        stats[cbk.I_MAX_STALL_NS] = max(int(stats[cbk.I_MAX_STALL_NS]), stall)
        stats[cbk.I_LAST_STALL_NS] = stall
        stats[cbk.I_LAST_GAINED] = int(gained.any())
        cb.announce(op, index, cbk.I_ACTIVE, epoch)
        return new


def _own_rows(batch, kgs: np.ndarray, owners: np.ndarray, index: int):
    """The rows of a batch (not in runs) whose key groups ``index`` owns, and their key groups."""
    mine = owners[kgs] == index
    if mine.all():
        return batch, kgs
    sel = np.flatnonzero(mine)
    return batch.take(sel), kgs[sel]


def make_task(assignment: Assignment, attached: _Attached, should_stop) -> Task:
    if assignment.stage.kind == "source":
        return SourceTask(assignment, attached, should_stop)
    return KeyedInstanceTask(assignment, attached, should_stop)
