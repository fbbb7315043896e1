"""One instance of a keyed operator, reading its gate at the frontier of its epochs."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from stretch.common.records import gc_paused
from stretch.plan.stages import IN_ORDER
from stretch.runtime import control_block as cbk
from stretch.runtime.batch import KG_COLUMN
from stretch.runtime.broadcast_board import BroadcastBoard
from stretch.runtime.chain import Chain
from stretch.runtime.checkpointing import Barrier, broadcast_file, snapshot_file, write_snapshot_or_report
from stretch.runtime.code_update import load_version, updated_step
from stretch.runtime.event_time import (
    MAX_WATERMARK,
    MIN_WATERMARK,
    WatermarkTracker,
    judge_of,
    producer_id,
)
from stretch.runtime.frontier import CLAIM_PIECE_NS, LEAD_PIECES, PIECE_NS, Frontier
from stretch.runtime.gate import Gate, Kind
from stretch.runtime.key_group_runs import laid_out, owned_ranges, owns_all, spans
from stretch.runtime.operators import InstanceRuntimeContext, make_operator
from stretch.runtime.operators.broadcast import SAVER_GROUP
from stretch.runtime.outputs import open_function
from stretch.runtime.state_dir import write_private
from stretch.runtime.task import Stopped, Task
from stretch.runtime.transactions import MarkCounter
from stretch.state.keyed_table import KeyedTable, writable
from stretch.state.snapshot import copy_key_groups
from stretch.state.timers import EVENT, PROCESSING


class KeyedInstanceTask(Task):
    """One instance of a keyed operator: reads every gate entry, processes the rows it owns (of a
    batch in runs of key groups, only those rows: ``runtime.key_group_runs``), and moves to each
    new epoch (ownership, code) at the gate position where the coordinator placed it
    (``runtime.frontier``). It reads a batch in pieces of about ``PIECE_NS`` of work, committing
    to each piece before it reads it, so that an epoch placed meanwhile applies within a piece. A
    per-record function gets all its rows of a batch (a run, or its rows picked out of a batch not
    laid out, such as the backlog written while one instance read) in one call instead (its keys'
    state then moves once a batch), and the call's pieces are claimed from inside it
    (``ProcessOperator.go_on``)."""

    retired = False  # set when a rescale removed this instance (it ended at the epoch's position)
    _parts = None
    board: BroadcastBoard | None = None  # a broadcast operator's: its broadcast state's versions
    frontier: Frontier | None = None

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
        self.gate, self.operator, self.chain = gate, operator, chain
        self.fused = hasattr(operator, "process_owned")
        self._note_operator()
        if self.claiming_operator and not gate.read_ns_per_row:  # blocks from the first batches on
            gate.note_read_rate(FIRST_RATE_NS, measured=False)
        outputs.producer = index + 1
        outputs.producer_id = producer_id(stage.id, index)
        epoch = self.a.epoch
        self._own(cb.table(op, epoch).copy(), cb.parallelism(op, epoch))
        stats = self.stats = cb.instances(op)[index]
        self._records_out = int(stats[cbk.I_RECORDS_OUT])  # a slot used before: continue its count
        stats[cbk.I_STATE] = cbk.RUNNING
        cb.announce(op, index, cbk.I_EPOCH, epoch)
        cb.announce(op, index, cbk.I_ACTIVE, epoch)
        # an instance added by a rescale learns the watermarks at its epoch's position instead
        self.tracker = WatermarkTracker(self.res.producers.get(stage.input_gate, ()))
        self.fresh = index >= self.instances  # added by a rescale: not one of its start epoch's
        cb.announce(op, index, cbk.I_CODE, stage.code_version)
        if self.board is not None:  # the broadcast state in force where this instance starts
            self._bind_board(operator, gate)
            operator.load_broadcast(self.board.before(gate.cursor(index)))
        open_function(operator, self._context(operator), stage.name)
        chain.open(self._context(operator))
        self.frontier = Frontier(cb, op, index, epoch, self._piece_ns)
        self.whole = stage.operator.kind in IN_ORDER  # read across keys in order: whole batches
        self.all_mine = False  # every row of the entry it reads is its own (_owns_every_row)
        self._mine = None  # its rows of the entry when scattered, or in runs of blocks read in one call
        self._spans = None  # its runs of rows in the entry, when it is laid out (key_group_runs)
        self._piece = _FIRST_PIECE
        self._rate = 0.0  # ns per position of pace read, recently (Frontier.publish_rate)
        marks = MarkCounter()
        seq = gate.cursor(index)
        here = self.a.start  # the gate position it reads from
        next_processing_check = 0.0
        batch_mode = stage.batch  # BATCH mode: processing-time timers wait for the end of input, as in Flink
        while not self.retired:
            now = time.monotonic()
            if now >= next_processing_check and not batch_mode:  # processing-time timers, every few ms
                next_processing_check = now + 0.005
                chain.push(self.operator.fire(PROCESSING, time.time_ns() // 1_000_000))
                chain.flush(wait=False)
            soon = not batch_mode and self.operator.next_timer(PROCESSING) < MAX_WATERMARK
            since = gate.wake_count()
            self._bound(here, here)  # the epochs placed where it waits apply now
            if self.retired:
                break
            if not gate.wait(seq, timeout=0.005 if soon else 0.1, since=since):
                if self.should_stop():
                    raise Stopped()
                continue
            if self.should_stop():  # cancelled: stop now, not after draining the backlog
                raise Stopped()
            if self.board is None:
                entry, seq = gate.read_joined(seq, self._joinable())
            else:  # a broadcast operator places its state's versions at entries' seqs: one at a time
                entry = gate.read(seq)
            here = max(here, entry.start)
            if entry.kind is Kind.DATA:
                outputs.txn = entry.arg1
                here = self._data(entry, here)
                if self.retired:
                    break
            else:
                self._bound(here, entry.end)
                if self.retired:
                    break
                if entry.kind is Kind.WATERMARK:
                    self._advance(self.tracker.watermark(entry.arg0, entry.arg1))
                elif entry.kind is Kind.IDLE:
                    self._advance(self.tracker.go_idle(entry.arg0))
                elif entry.kind is Kind.LEAVE:
                    self._advance(self.tracker.leave(entry.arg0))
                elif entry.kind is Kind.CHECKPOINT:
                    self._checkpoint(entry.arg0)
                elif entry.kind is Kind.MARK and entry.arg1 and marks.ended(entry.arg1, entry.arg0):
                    chain.end_txn(entry.arg1, self.instances)  # the parallelism of this epoch
                elif entry.kind is Kind.END_OF_STREAM:
                    gate.advance(index, seq + 1)
                    if batch_mode:
                        chain.push(self.operator.fire(PROCESSING, MAX_WATERMARK))
                    self._advance(MAX_WATERMARK if self.tracker.current < MAX_WATERMARK else None)
                    break
                here = entry.end
            chain.flush(wait=False)  # before its cursor passes the entry: what it produced is on its way
            seq += 1
            gate.advance(index, seq)
            stats[cbk.I_GATE_SEQ] = seq
        self.operator.close()
        chain.close()
        stats[cbk.I_RECORDS_OUT] = self._records_out
        stats[cbk.I_STATE] = cbk.DONE

    # ---- reading up to the next epoch ---------------------------------------------------------
    def _joinable(self) -> int:
        """How many rows of small entries queued to read as one: about a claim piece of work at
        its rate (an epoch waits for what an instance claimed), none before it knows its rate."""
        return int(CLAIM_PIECE_NS / self._rate) if self._rate else 0

    def _waiting(self) -> None:
        if self.should_stop():
            raise Stopped()

    def _bound(self, here: int, end: int, paced: bool = False) -> int:
        """How far to read now, at most to ``end``: the next epoch's position if it comes first,
        and (``paced``) no further ahead of a slower instance than the frontier allows. Every epoch
        placed at ``here`` is applied before (which may retire this instance)."""
        while True:
            if paced and self.frontier.paced(self.instances):
                need = end if self.whole else None  # whole batches: wait until all of it may be read
                limit = self.frontier.keep_up(here, self.instances, self._waiting, need)
                if limit is not None:
                    end = min(end, limit)
            position = self.frontier.claim(end, self._waiting)
            if position is None:
                return end
            if position > here:
                return min(position, end)
            self._switch()
            if self.retired:
                return here

    def _data(self, entry, here: int) -> int:
        """Process the rows of a data entry from ``here`` on, in pieces, switching epochs where
        they were placed; returns the position reached (the entry's end unless retired). Rows
        taken again elsewhere are judged late by the watermark they first met, if lower
        (event_time.JUDGE_KEY). The cyclic collector waits for the entry's end (gc_paused): a
        collection inside a per-record call, which finds the batch's records and results all
        alive, would stall this instance and so, through the frontier's lead, the others."""
        judge = judge_of(entry.batch)
        now = self.operator.watermark
        with gc_paused(entry.batch.num_rows):
            if judge is None or judge >= now:
                return self._rows(entry, here)
            self.operator.watermark = judge
            try:
                return self._rows(entry, here)
            finally:
                self.operator.watermark = now

    def _rows(self, entry, here: int) -> int:
        batch, start = entry.batch, entry.start
        n = batch.num_rows
        kgs = batch.column(KG_COLUMN).to_numpy()
        runs = laid_out(batch)
        self._busy = 0  # ns spent processing this entry's pieces (not waiting between them)
        rows_in = 0
        lo = here - start
        judged_at = paced_from = None
        while True:
            epoch = self.frontier.epoch
            if judged_at != epoch:  # under this epoch's ownership
                self.all_mine, judged_at = self._owns_every_row(kgs, runs), epoch
                scattered = not (runs or self.everything or self.whole or self.all_mine)
                self._mine = np.flatnonzero(self.owners[kgs] == self.a.index) if scattered else None
                mine = spans(kgs, self.ranges, runs) if runs and not (self.everything or self.whole) else None
                self._spans = mine
                if mine is not None and len(mine) > 1 and self._claims_in_call():
                    # runs of blocks: picked out, CALL_RUNS runs a call (_next_piece)
                    self._mine = np.concatenate([np.arange(a, b) for a, b in mine])
                self.frontier.reading(start, n, mine)
                if paced_from is None:
                    paced_from = self.frontier.pace(start + lo)
            x, y = self._next_piece(kgs, runs, lo, n)
            in_call = self._claims_in_call()  # all its rows of the batch, claimed inside the call
            reach = x if in_call else y
            stop = self._bound(start + lo, start + max(reach, lo + (n == 0)), paced=True) - start
            if self.retired:
                return start + lo
            if self.frontier.epoch != epoch:  # an epoch applied at lo: the piece is another now
                continue
            if in_call and y > x <= stop:
                n_in, stop = self._process(entry, kgs, runs, x, y)  # it may end where an epoch applies
                rows_in += n_in
            elif min(y, stop) > x:
                rows_in += self._process(entry, kgs, runs, x, min(y, stop))[0]
            lo = stop
            if lo >= max(n, 1):
                break
        busy = self._busy
        if rows_in:  # ns per position of pace (runtime.frontier), of this entry
            rate = busy / max(start + n - paced_from, 1)
            self._rate = 0.75 * self._rate + 0.25 * rate if self._rate else rate
            self.frontier.publish_rate(self._rate)
            if self.claiming_operator:  # producers lay batches out in blocks of its work (below)
                self.gate.note_read_rate(self._rate)
        stats = self.stats
        stats[cbk.I_RECORDS_IN] += rows_in
        stats[cbk.I_RECORDS_OUT] = self._records_out
        stats[cbk.I_BATCHES] += 1
        stats[cbk.I_BUSY_NS] += busy
        return entry.end

    def _owns_every_row(self, kgs: np.ndarray, runs: int) -> bool:
        """Whether every row of an entry not laid out in runs is this instance's, though it does
        not own every key group: a node's only instance, whose key groups of other nodes are
        released (no rows of theirs come). It then reads the entry as if it owned everything,
        without picking its rows out."""
        if runs or self.everything or not len(kgs):
            return False
        return bool((self.owners[kgs] == self.a.index).all())

    def _next_piece(self, kgs: np.ndarray, runs: int, lo: int, n: int) -> tuple[int, int]:
        """The rows [x, y) to read next from row ``lo`` of a batch: none of those before x are
        this instance's; about a piece's work (all that is left for an operator that reads in
        order). (n, n): nothing of its own is left."""
        if self.whole:
            return lo, n
        in_call = self._claims_in_call()
        piece = n if in_call else self._piece
        if in_call and self._mine is not None:  # its rows of the rest, wherever they are
            i = int(np.searchsorted(self._mine, lo))
            if i == self._mine.size:
                return n, n
            x = int(self._mine[i])
            if self._spans is None:
                return x, n
            # runs of blocks: a call takes CALL_RUNS of them, so the keys' state it loads before
            # its first claim (which an epoch placed meanwhile waits for) stays a few ms of work
            j = next(k for k, (a, b) in enumerate(self._spans) if b > x)
            return x, self._spans[min(j + CALL_RUNS, len(self._spans)) - 1][1]
        if runs and not self.everything:
            for a, b in self._spans:
                if b > lo:
                    x = max(a, lo)
                    return x, min(b, x + piece)
            return n, n
        return lo, min(n, lo + piece)

    def _process(self, entry, kgs: np.ndarray, runs: int, x: int, y: int) -> tuple[int, int]:
        """Run the operator over rows [x, y) of a data entry (those it owns); returns how many
        it processed, and the row it reached (before y if it stopped early)."""
        batch = entry.batch if (x, y) == (0, entry.batch.num_rows) else entry.batch.slice(x, y - x)
        part = writable(kgs[x:y])
        t0, cpu0, waited = time.perf_counter_ns(), time.thread_time_ns(), self.frontier.waited_ns
        chain, operator = self.chain, self.operator
        in_call = False
        if self.fused:
            operator.position = entry.seq  # where a broadcast operator's versions are placed
            out = operator.process_owned(batch, part, self.owners, self.a.index)
            if isinstance(out, list):  # results in order, of runs of the batch
                for piece in out:
                    chain.push(piece)
            elif out is not None:
                chain.push(out)
            n = operator.rows_in
        else:
            in_call = self._claims_in_call()
            sel = None  # where its rows are among [x, y), if not all of them
            if in_call and self._mine is not None:  # picked out: scattered, or runs of blocks
                mine = self._mine
                sel = mine[np.searchsorted(mine, x) : np.searchsorted(mine, y)] - x
                if self._spans is None:
                    own, own_kgs = batch.take(sel), part[sel]
                else:
                    own, own_kgs = _joined_runs(batch, part, self._spans, x, y)
            elif runs or self.everything or self.all_mine:
                own, own_kgs = batch, part
            else:
                own, own_kgs = _own_rows(batch, part, self.owners, self.a.index)
            if in_call:  # its claims go on piece by piece from inside the call, its results too
                go_on = self._claimer(entry.start + x, y - x, sel)
                operator.go_on, operator.emit = go_on, chain.push
            n = own.num_rows
            if n:
                chain.push(operator.process(own, own_kgs))
                if in_call and operator.stopped_at is not None:
                    n = operator.stopped_at
                if in_call and go_on.reached is not None:  # as far as it claimed: to y, or an epoch
                    y = go_on.reached - entry.start
            if in_call:
                operator.go_on = operator.emit = None
        self._busy += time.perf_counter_ns() - t0 - (self.frontier.waited_ns - waited)  # not its waits
        if not self.whole and not in_call:  # about PIECE_NS of work a piece, from this one's (CPU
            # time: not the time others ran meanwhile, which would keep pieces small on a busy
            # machine)
            self._size_piece(y - x, time.thread_time_ns() - cpu0)
        return n, y

    def _size_piece(self, rows: int, took_ns: int) -> None:
        """The next piece: about a piece's work (``_piece_ns``) at the rate of the last ``rows``
        (growing at most 8x a piece)."""
        self._piece = max(1, min(self._piece * 8, int(self._piece_ns * rows / max(took_ns, 1))))

    def _note_operator(self) -> None:
        """Whether its operator takes its claims from inside a call (``ProcessOperator.go_on``), and
        the work of a piece it claims (``runtime.frontier``)."""
        self.claiming_operator = not self.fused and hasattr(self.operator, "go_on")
        self.gate.note_readers_claim(self.claiming_operator)  # how far its producers join (channel_source)
        self._piece_ns = CLAIM_PIECE_NS if self.claiming_operator else PIECE_NS
        if self.frontier is not None:  # a live update changed the operator
            self.frontier.lead_ns = LEAD_PIECES * self._piece_ns

    def _claims_in_call(self) -> bool:
        """Whether it reads all its rows of a batch (or of a run) in one call, claimed from inside
        the call: its keys' state then moves once a batch, not once a piece."""
        return self.claiming_operator and not self.whole

    def _claimer(self, first: int, rows: int, sel: np.ndarray | None = None):
        """``ProcessOperator.go_on`` for a call over gate positions [first, first + rows), whose
        records are at ``sel`` among them (all of them if None): claims the next piece, about
        ``CLAIM_PIECE_NS`` of work (sized by CPU time, as pieces are), after the records done; answers
        up to which record the call may go (not past the records done once the next epoch applies
        there). Its ``reached`` is the position its last answer claimed up to."""
        clock = [time.thread_time_ns(), 0]
        count = rows if sel is None else len(sel)

        def at(k: int) -> int:  # the position of the call's k-th record (past the last: the end)
            return first + (k if sel is None else int(sel[k]) if k < count else rows)

        def go_on(done: int) -> int:
            now = time.thread_time_ns()
            if done > clock[1]:
                self._size_piece(done - clock[1], now - clock[0])
            clock[0], clock[1] = now, done
            here = first if go_on.reached is None else go_on.reached  # all before it is done
            end = at(min(count, done + self._piece))
            if self.frontier.paced(self.instances):
                limit = self.frontier.keep_up(here, self.instances, self._waiting)
                if limit is not None:
                    end = min(end, limit)
            position = self.frontier.claim(end, self._waiting)
            bound = end if position is None else max(here, min(position, end))
            go_on.reached = bound
            return bound - first if sel is None else int(np.searchsorted(sel, bound - first))

        go_on.reached = None
        return go_on

    def _own(self, owners: np.ndarray, parallelism: int) -> None:
        """Take up an epoch's ownership table (and how many instances it has)."""
        index = self.a.index
        self.owners = owners
        self.operator.owned = np.flatnonzero(owners == index)
        self.ranges = owned_ranges(owners, index)
        self.everything = owns_all(self.ranges, self.stage.max_parallelism)
        self.instances = parallelism

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

    def _update(self, version: int) -> None:
        """At an epoch with new code: close the old code, open the new version's on the same
        shared state (its timers, kept with the state, fire into the new code), and say so. A
        version that changed a chained step swaps only that step's function."""
        if version <= self.stage.code_version:
            return  # started with this version already
        old, chain = self.operator, self.chain
        self.stage = load_version(self.res.code, self.stage.id, version)
        if self.stage.updated_step:
            chain.update_step(updated_step(self.stage), self._context(old))
            self.attached.control.announce(self.op_index, self.a.index, cbk.I_CODE, version)
            return
        old.close()
        new = make_operator(self.stage.operator, self.stage.name, old.table)
        new.outputs, new.owned, new.watermark = old.outputs, old.owned, old.watermark
        if self.board is not None:  # the new code reads the same broadcast state
            self._bind_board(new, self.gate)
            new.load_broadcast(old.broadcast_bytes())
        for name in self.stage.drop_states:
            new.drop_state(name)
        new.open(self._context(new))
        self.operator, self.fused = new, hasattr(new, "process_owned")
        self._note_operator()
        self.attached.control.announce(self.op_index, self.a.index, cbk.I_CODE, version)

    def _bind_board(self, operator, gate: Gate) -> None:
        operator.bind(self.board, lambda: int(gate.active_cursors().min()), self._waiting)

    def _checkpoint(self, checkpoint: int) -> None:
        """At a barrier: copy the key groups this instance owns, then wait for the release; the
        copy is written to the checkpoint's directory meanwhile and after (asynchronously)."""
        operator = self.operator
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

    def _advance(self, watermark: int | None) -> None:
        """The input watermark advanced: fire the event-time timers it passed, then forward it."""
        if watermark is None:
            return
        operator, chain = self.operator, self.chain
        self.tracker.current = max(self.tracker.current, watermark)
        operator.watermark = watermark
        self.stats[cbk.I_WATERMARK] = watermark
        chain.push(operator.fire(EVENT, watermark))
        chain.emit(Kind.WATERMARK, watermark)
        self.stats[cbk.I_RECORDS_OUT] = self._records_out

    def _switch(self) -> None:
        """Move to the next epoch at its position (STRETCH's handoff).

        State is already in shared memory (every piece writes back), so this instance announces
        the epoch at once; it then waits only for the previous owners of key groups it gains to
        reach the position too. An instance that gains nothing never waits. An instance scaled
        away gives up its reader slot first, so the slot is free for reuse once the rescale is
        announced complete. Instances record the watermarks they track at the position; an added
        instance starts from those, and (a broadcast operator's) from the broadcast state's version
        there, once an instance that was there before has passed it (so every version before it
        is out). An epoch with a new code version switches the code (``_update``), once the
        coordinator has decided it (an update's epoch is placed while its check runs).
        """
        cb, op, index, gate = self.attached.control, self.op_index, self.a.index, self.gate
        epoch = self.frontier.epoch + 1
        owners, new, parallelism = self.owners, cb.table(op, epoch).copy(), cb.parallelism(op, epoch)
        if not self.fresh:
            cb.save_watermarks(op, epoch, self.tracker.state())
            # downstream learns of the instances added here, with the watermark in force at the
            # position, before anything this one sends from there on: none of theirs is late
            for joined in np.setdiff1d(new[new >= 0], owners[owners >= 0]).tolist():
                self.chain.emit(Kind.WATERMARK, self.tracker.current, producer_id(self.stage.id, joined))
        if index >= parallelism:  # an instance whose key groups were all released stays
            gate.close_reader(index)
            self.retired = True
        self.chain.flush()  # what it produced before the position is out before it says it is there
        if self.retired:
            # downstream stops waiting for its watermark, before the rescale can complete: a later
            # epoch that adds an instance of this index again announces that one after this mark
            # (sent on the way out, it could come after and make downstream forget the new one)
            self.chain.emit(Kind.LEAVE)
        cb.announce(op, index, cbk.I_EPOCH, epoch)
        self.frontier.passed(self.instances)
        gained = (new == index) & (owners != index)
        t0 = time.perf_counter_ns()
        previous = sorted({int(p) for p in owners[gained] if p >= 0})  # -1: released, nobody's
        if self.board is not None and self.fresh:
            previous = sorted({*previous, int(owners[SAVER_GROUP])})
        if previous:
            while not cb.wait_epochs(op, previous, epoch, timeout=0.1):
                self._waiting()
        stall = time.perf_counter_ns() - t0
        self.frontier.epoch = epoch
        self._own(new, parallelism)
        if self.fresh and not self.retired:
            state = cb.load_watermarks(op, epoch)
            if state is not None:
                self.tracker = WatermarkTracker.from_state(state)
                if self.tracker.current > MIN_WATERMARK:
                    self._advance(self.tracker.current)
            if self.board is not None:
                self.operator.load_broadcast(self.board.before(gate.cursor(index)))
            self.fresh = False
        if not self.retired:
            self._update(cb.wait_code(op, epoch, self._waiting))
        stats = self.stats
        stats[cbk.I_STALL_NS] += stall
        stats[cbk.I_MAX_STALL_NS] = max(int(stats[cbk.I_MAX_STALL_NS]), stall)
        stats[cbk.I_LAST_STALL_NS] = stall
        stats[cbk.I_LAST_GAINED] = int(gained.any())
        cb.announce(op, index, cbk.I_ACTIVE, epoch)


FIRST_RATE_NS = 1_000.0
"""A per-record function's work per row until it has measured its own: producers lay out the
batches it first reads in blocks of about that (key_group_runs), not one block each, which would
hold a rescale under a backlog of large batches for tens of milliseconds in a job's first second."""
CALL_RUNS = 2
"""How many of its runs of a batch laid out in blocks a per-record function reads in one call."""
_FIRST_PIECE = 64  # rows of an instance's first piece, before it knows its rate (it grows 8x a piece)


def _joined_runs(batch, kgs: np.ndarray, spans, x: int, y: int):
    """The rows of a batch's runs ``spans`` (rows of the entry) within its rows [x, y), which
    ``batch`` and ``kgs`` hold, as one batch and their key groups: the runs' slices joined (a copy
    of a few contiguous stretches, several times cheaper than gathering the rows one by one)."""
    cuts = [(max(a, x) - x, min(b, y) - x) for a, b in spans if b > x and a < y]
    if len(cuts) == 1:
        a, b = cuts[0]
        return batch.slice(a, b - a), kgs[a:b]
    joined = pa.concat_batches([batch.slice(a, b - a) for a, b in cuts])
    return joined, np.concatenate([kgs[a:b] for a, b in cuts])


def _own_rows(batch, kgs: np.ndarray, owners: np.ndarray, index: int):
    """The rows of a batch (not in runs) whose key groups ``index`` owns, and their key groups."""
    mine = owners[kgs] == index
    if mine.all():
        return batch, kgs
    sel = np.flatnonzero(mine)
    return batch.take(sel), kgs[sel]
