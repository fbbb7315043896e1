"""Epochs of a keyed operator: live rescales, barriers, and the switch a live update makes.

Each is a new epoch of the operator (runtime.control_block): an ownership table and a code version
that apply from one position of its gate. The position is placed at the readers' frontier
(runtime.frontier), so an epoch takes effect in about the time the operator's instances are apart,
however much input is queued behind them; a barrier is placed at the gate's tail instead, since it
waits for what the gate holds. Reconfigurations of one operator take turns. A rescale does not
wait for a checkpoint under way (runtime.checkpointing counts the instances of the epoch in force
at its barrier); a live update does (the checkpoint records the code version).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from stretch.common.job_status import JobStatus
from stretch.errors import InputEnded
from stretch.runtime import control_block as cbk
from stretch.runtime import frontier
from stretch.runtime.batch import KG_COLUMN
from stretch.runtime.gate import Kind
from stretch.runtime.key_group_runs import not_laid_out
from stretch.runtime.transactions import tagged

BEHIND_WAIT_S = 30.0  # how long placing an epoch waits for instances still on the oldest kept one


@dataclass(frozen=True)
class Placed:
    """Where an epoch was placed: its operator (index), number and gate position; the parallelism
    before it; the instances that take it up; how many records were queued behind it (they run
    under it: not watermarks or other marks, which take a gate position each)."""

    op: int
    epoch: int
    old_parallelism: int
    instances: list[int]
    position: int
    queued: int
    generation: int  # the coordinator's at placing: a recovery after it restarts the job


class EpochsBehind(RuntimeError):
    """An instance still reads an epoch whose table slot the next epoch would take: ``new_epoch``
    waits for ``instances`` of operator ``op`` to reach ``epoch``."""

    def __init__(self, op: int, instances: range, epoch: int):
        super().__init__("instances are too many epochs behind; retry later")
        self.op, self.instances, self.epoch = op, instances, epoch


@dataclass(frozen=True)
class Released:
    """What ``Rescaler.release`` left: the position from which the key groups were no longer
    processed, its epoch, and their records queued from there (gate batches, in order)."""

    position: int
    epoch: int
    batches: list[pa.RecordBatch]


class Rescaler:
    """The epochs of one job's keyed operators; ``co`` is its Coordinator."""

    def __init__(self, coordinator):
        self.co = coordinator
        self._lock = threading.Lock()
        self._busy: dict[int, threading.Event] = {}  # stage id -> set when its reconfiguration ends
        # stage id -> {released key group: the gate's tail when it was}: no instance owns them
        self.away: dict[int, dict[int, int]] = {}
        # stage id -> the gate entry a held release copied its records up to (``release(hold=)``)
        self.held: dict[int, int] = {}

    @property
    def busy(self) -> bool:
        return bool(self._busy)

    # ---- in the caller's thread ---------------------------------------------------------------
    def rescale(self, operator: str, parallelism: int, timeout: float | None = None) -> dict:
        """See ``Coordinator.rescale``."""
        t0 = time.monotonic_ns()
        self.co.refuse_if_ended("rescaled")
        stage = self._keyed(operator)
        if (
            not isinstance(parallelism, int)
            or isinstance(parallelism, bool)
            or not 1 <= parallelism <= stage.max_parallelism
        ):
            raise ValueError(
                f"parallelism must be an int in 1..{stage.max_parallelism} (max parallelism), got {parallelism!r}"
            )
        with self.reconfiguring(stage):
            co = self.co
            current = co.parallelism_of(stage.id)
            op = co.resources.keyed_index[stage.id]
            if parallelism == current:
                return self._report(operator, int(co.control.epoch(op)), current, current, t0)
            placed = self.new_epoch(stage, parallelism=parallelism)
            epoch, instances = placed.epoch, placed.instances
            recovered = self.await_(
                f"rescale of {operator!r}",
                f"to {parallelism} is in effect (epoch {epoch})",
                lambda: co.control.wait_epochs(op, instances, epoch, timeout=0.05, word=cbk.I_ACTIVE),
                placed.generation,
                timeout,
                survives_recovery=True,
            )
            if recovered:  # the job restarted from its checkpoint at the new parallelism
                epoch, done_at = int(co.control.epoch(op)), time.monotonic_ns()
            else:  # the last instance's own clock: the rescale, not this thread's scheduling
                done_at = max(int(co.control.instances(op)[i, cbk.I_ACTIVE_AT_NS]) for i in instances)
            co.replenish()  # refill the warm pool now that the rescale is done
            report = self._report(operator, epoch, placed.old_parallelism, parallelism, t0, done_at)
            report["queued"] = placed.queued
            co.rescales.append({**report, "at": time.time()})
            return report

    def barrier(self, operator: str, timeout: float | None = None) -> dict:
        """See ``Coordinator.barrier``."""
        t0 = time.monotonic_ns()
        self.co.refuse_if_ended("barriered")
        stage = self._keyed(operator)
        with self.reconfiguring(stage):
            co = self.co
            generation, p = co.generation, co.parallelism_of(stage.id)
            op = co.resources.keyed_index[stage.id]
            try:
                placed = self.new_epoch(stage, at_tail=True)
                epoch, instances, generation = placed.epoch, placed.instances, placed.generation
            except InputEnded:  # the gate ends: what it holds is processed once the operator ended
                epoch, instances = int(co.control.epoch(op)), None

            def done() -> bool:
                if instances is not None:
                    return co.control.wait_epochs(op, instances, epoch, timeout=0.05)
                time.sleep(0.002)
                return co.stage_finished(stage.id)

            self.await_(f"barrier of {operator!r}", "is placed", done, generation, timeout)
            return self._report(operator, epoch, p, p, t0)

    def release(
        self, operator: str, key_groups, timeout: float | None = None, hold: bool = False
    ) -> Released:
        """Stop processing ``key_groups`` from the readers' frontier of the operator's gate (a
        cluster node hands them to another node without working off its backlog first).

        Returns once every instance has passed the position, so their state is final as of it,
        with the records of these key groups queued behind it, which no instance here processes,
        in gate order: they go along with the state. The key groups stay away (no instance owns
        them, whatever the parallelism) until ``own`` takes them back.

        The caller has stopped appending records of these key groups, unless it ``hold``s the
        release: then records of theirs appended from now on stay in the gate, unprocessed, until
        ``rest`` copies them (a node copies the backlog out while writers still send it rows of the
        key groups, and refuses them only for the short rest)."""
        self.co.refuse_if_ended("released")
        stage = self._keyed(operator)
        key_groups = sorted({int(k) for k in key_groups})
        co = self.co
        gate = co.gates[stage.input_gate]
        with self.reconfiguring(stage):
            if stage.id in self.held:
                raise RuntimeError(f"a release of key groups of {operator!r} is held: its rest comes first")
            placed = self.new_epoch(stage, away=key_groups)
            pinned = False
            try:
                self.await_(
                    f"release of key groups of {operator!r}",
                    f"is placed (epoch {placed.epoch})",
                    lambda: co.control.wait_epochs(placed.op, placed.instances, placed.epoch, timeout=0.05),
                    placed.generation,
                    timeout,
                )
                kgs = np.array(key_groups, dtype=np.uint16)
                batches, end = _rows_from(gate, gate.seq_at(placed.position), placed.position, kgs)
                if hold:  # the pin moves on to what is not copied yet
                    gate.advance(gate.pin_slot, end)
                    self.held[stage.id], pinned = end, True
            finally:
                if not pinned:
                    gate.close_reader(gate.pin_slot)
        return Released(placed.position, placed.epoch, batches)

    def rest(self, operator: str, key_groups) -> list[pa.RecordBatch]:
        """The records of ``key_groups`` appended since their held ``release`` copied the gate,
        in gate order; the caller has stopped appending records of theirs. Lets go of the gate."""
        stage = self._keyed(operator)
        gate = self.co.gates[stage.input_gate]
        with self.reconfiguring(stage):
            seq = self.held.pop(stage.id, None)
            if seq is None:
                raise RuntimeError(f"no release of key groups of {operator!r} is held")
            try:
                gone = self.away.setdefault(stage.id, {})
                gone.update(dict.fromkeys((int(k) for k in key_groups), gate.position))
                kgs = np.array(sorted({int(k) for k in key_groups}), dtype=np.uint16)
                batches, _ = _rows_from(gate, seq, 0, kgs)
            finally:
                gate.close_reader(gate.pin_slot)
        return batches

    def own(self, operator: str, key_groups) -> int:
        """Process ``key_groups`` again (released before): from a position after every record of
        theirs that was queued when they were released, so records appended from now on are
        processed and those are not. Returns once placed; the epoch."""
        self.co.refuse_if_ended("given key groups")
        stage = self._keyed(operator)
        with self.reconfiguring(stage):
            return self.new_epoch(stage, own=sorted({int(k) for k in key_groups})).epoch

    def new_epoch(
        self,
        stage,
        parallelism: int | None = None,
        code: int | None = None,
        at_tail: bool = False,
        away: list[int] | None = None,
        own: list[int] | None = None,
    ) -> Placed:
        """Place the next epoch of ``stage``'s operator (``JobLoop.place``): a new parallelism,
        a new code version, key groups no instance processes (``away``, the gate's entries from
        there pinned) or processes again (``own``), or none of these (a barrier, ``at_tail``);
        raises why it could not."""
        deadline = time.monotonic() + BEHIND_WAIT_S
        while True:
            placed = self.co.loop.place(self._place, stage.id, parallelism, code, at_tail, away, own)
            if not isinstance(placed, EpochsBehind) or time.monotonic() > deadline:
                break
            with contextlib.suppress(ValueError):  # a recovery released the block: placing says so
                self.co.control.wait_epochs(placed.op, placed.instances, placed.epoch, 0.05)
        if isinstance(placed, BaseException):
            raise placed
        return placed

    @contextlib.contextmanager
    def reconfiguring(self, stage):
        """One reconfiguration (rescale, barrier, code update) of an operator at a time."""
        while True:
            with self._lock:
                busy = self._busy.get(stage.id)
                if busy is None:
                    done = self._busy[stage.id] = threading.Event()
                    break
            busy.wait()
        try:
            yield
        finally:
            with self._lock:
                del self._busy[stage.id]
            done.set()

    def await_(
        self, subject: str, in_effect: str, done, generation: int, timeout, survives_recovery: bool = False
    ) -> bool:
        """Until ``done()`` (which waits a little itself): it fails if the job stops meanwhile, or
        recovers from a failure (unless ``survives_recovery``: then it returns True once the job
        runs again), and times out after ``timeout`` (in effect all the same)."""
        co = self.co
        deadline = None if timeout is None else time.monotonic() + timeout

        def done_() -> bool:
            try:
                return done()
            except ValueError:  # a recovery released the control block it read: see below
                if co.generation == generation and not co.stopping:
                    raise
                return False

        while not done_():
            if co.generation != generation and survives_recovery:
                while co.status is JobStatus.RESTARTING and not co.stopping:
                    time.sleep(0.01)
                if co.status is JobStatus.RUNNING:
                    return True
            if co.stopping or co.generation != generation or co.status is not JobStatus.RUNNING:
                raise RuntimeError(f"{subject} did not complete: the job is {co.status.name}") from co.error
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"{subject} {in_effect} but its instances have not all reached it within {timeout} s: "
                    "they are apart by more than that"
                )
        return False

    def _keyed(self, operator: str):
        stage = self.co.plan.stage(operator)
        if stage.kind != "keyed":
            raise ValueError(f"operator {operator!r} is not a keyed operator; only keyed operators rescale")
        return stage

    @staticmethod
    def _report(operator: str, epoch: int, old: int, new: int, t0: int, done_at: int | None = None) -> dict:
        return {
            "operator": operator,
            "epoch": epoch,
            "old_parallelism": old,
            "new_parallelism": new,
            "elapsed_ms": ((time.monotonic_ns() if done_at is None else done_at) - t0) / 1e6,
            "state_bytes_copied": 0,
        }

    # ---- between two events of the job thread (JobLoop.place) ----------------------------------
    def _place(self, stage_id: int, parallelism: int | None, code: int | None, at_tail: bool, away, own):
        co = self.co
        if co.status is not JobStatus.RUNNING:
            return RuntimeError(f"{co.ended_as()}: nothing is reconfigured")
        stage = co.plan.stages[stage_id]
        op = co.resources.keyed_index[stage_id]
        cb, gate = co.control, co.gates[stage.input_gate]
        old = co.parallelism_of(stage_id)
        epoch = cb.epoch(op) + 1
        if epoch - min(int(cb.instances(op)[i, cbk.I_EPOCH]) for i in range(old)) >= cbk.TABLE_RING:
            return EpochsBehind(op, range(old), epoch - cbk.TABLE_RING + 1)
        new = old if parallelism is None else parallelism
        gone = self.away.setdefault(stage_id, {})  # released key group -> the gate's tail then
        released = sorted((set(gone) - set(own or ())) | set(away or ()))
        if parallelism is None and not own and not away:  # a barrier, a code update: the same table
            owners = cb.table(op, epoch - 1).copy()
        else:
            owners = spread(new, stage.max_parallelism, released)
            if owners is None:
                return RuntimeError(
                    f"operator {stage.name!r}: {stage.max_parallelism - len(released)} key group(s) would "
                    f"stay with its {new} instances once the released ones are away: each must own one"
                )
        floor = max(cb.position(op, epoch - 1), gate.position if at_tail else 0)
        if own:  # after what was queued of theirs when they were released
            floor = max([floor, *(gone.get(kg, 0) for kg in own)])
        position = frontier.place(cb, op, epoch, range(old), floor)
        end = gate.end_position
        if end is not None and position > end:
            frontier.withdraw(cb, op, epoch)
            return self._input_ended(stage, op, old, end)
        for kg in own or ():
            gone.pop(kg, None)
        if away:
            gone.update(dict.fromkeys(away, gate.position))
        start = gate.seq_at(position)
        queued = gate.rows_from(position)  # before the epoch is published: nobody reads past it yet
        if away:  # what is queued from the position on stays readable until it is copied
            gate.open_reader(gate.pin_slot, start)
        for i in range(old, new):  # before the position is published: nobody retires before them
            gate.open_reader(i, start)
            frontier.start_claim(cb, op, i, position)
            cb.instances(op)[i, cbk.I_STATE] = cbk.FREE  # a slot used before: not done, to a checkpoint
        cb.publish(op, epoch, owners, cb.code(op, epoch - 1) if code is None else code, position, new)
        gate.nudge()  # instances waiting at the position apply the epoch now
        co.set_parallelism(
            stage_id, new, [(i, epoch - 1, stage.code_version, position) for i in range(old, new)]
        )
        instances = list(range(max(old, new)))
        return Placed(op, epoch, old, instances, position, queued, co.generation)

    def _input_ended(self, stage, op: int, parallelism: int, end: int) -> InputEnded:
        cb = self.co.control
        read = [i for i in range(parallelism) if cb.load(cb.instance_word(op, i, cbk.I_CLAIM)) > end]
        if len(read) == parallelism:
            return InputEnded(
                f"operator {stage.name!r} has read all its input: nothing is left to reconfigure"
            )
        return InputEnded(
            f"operator {stage.name!r} is at the end of its input: instance(s) {read} of {parallelism} read "
            "all of it, so no position is left that every instance has yet to read"
        )


def spread(parallelism: int, max_parallelism: int, released) -> np.ndarray | None:
    """The ownership table of ``parallelism`` instances over the key groups not ``released``:
    contiguous ranges of those, as ``range_assignment`` makes over all of them (the same table
    when none is released); released ones -1. None if fewer are left than instances.

    Every instance keeps a share of what is left: one with nothing would idle while the others
    work, and one owning only key groups that get no rows (a cluster node's, of other nodes) would
    read ahead of the others and take the frontier with it."""
    owners = np.full(max_parallelism, -1, dtype=np.int16)
    kept = np.setdiff1d(np.arange(max_parallelism), np.asarray(released, dtype=np.int64))
    if kept.size < parallelism:
        return None
    owners[kept] = (np.arange(kept.size) * parallelism // kept.size).astype(np.int16)
    return owners


def _rows_from(gate, first: int, position: int, key_groups: np.ndarray) -> tuple[list[pa.RecordBatch], int]:
    """The records of ``key_groups`` in the gate from entry ``first`` (from ``position`` in it) to
    its tail (pinned), copied, each batch tagged with its input transaction; and the tail."""
    out = []
    wanted = np.zeros(1 << 16, dtype=bool)  # a lookup: faster than np.isin over a backlog's rows
    wanted[key_groups] = True
    end = gate.tail
    for seq in range(first, end):
        entry = gate.read(seq)
        if entry.kind is not Kind.DATA:
            continue
        batch = entry.batch.slice(max(position - entry.start, 0))
        mine = wanted[batch.column(KG_COLUMN).to_numpy()]
        if mine.any():
            out.append(tagged(not_laid_out(batch.filter(pa.array(mine))), entry.arg1))
    return out, end
