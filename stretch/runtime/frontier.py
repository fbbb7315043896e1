"""Frontier epochs: the gate position from which a rescale, a live update or a barrier applies.

The instances of one keyed operator read the same gate, each at its own pace. An epoch (a new
ownership table, or a new code version) applies from one gate position P for every instance:
records before P run under the old epoch, records from P under the new one (positions count rows,
so P may fall inside a batch; see runtime.gate). The coordinator places P at the readers'
frontier, at or just past the furthest position an instance has committed to read, so an epoch
takes effect within about the time the instances are apart, whatever is queued behind them. An
instance that gains a key group at P waits only for the key group's previous owner to reach P.

Placing P is a handshake over sequentially consistent words of the control block. Before an
instance processes gate positions up to ``end``, it stores ``end`` as its *claim*, then reads the
epoch being placed. The coordinator stores the epoch it is placing, then reads every claim, and
places P at or past all of them. So either the coordinator sees an instance's claim, or the
instance sees the placement; then it waits the microseconds until P is fixed and reads no further
than P. No instance ever has to undo what it read.

A per-record function reads all its rows of a batch (a run, or rows scattered among others') in
one call (its keys' state is then loaded and written back once a batch), yet it claims them piece
by piece from inside the call, so a claim never runs far ahead of what the instance has processed.

The frontier is only as close to every instance as the instances are to each other. Under a
backlog, a reader that runs faster than another (its key groups hold fewer rows, or it got more
CPU) would read on to the gate's tail, and an epoch placed there would wait for the slower one to
work off the whole gate. So an instance reads ahead of another by at most its *lead* of the
other's work (``LEAD_PIECES`` of the pieces it claims, from the rate each one publishes): under a
backlog the slowest instance sets the operator's pace in any case. How far apart two instances
are is measured by their *pace*, not their gate positions: a batch is laid out by key group, so
instances that read the same entry at the same moment are far apart in positions (each in its own
run of rows) though not in time. An instance's
pace through an entry is the share of its own rows of the entry it has claimed, spread over the
entry's positions; outside an entry, and for rows not laid out in runs, it is the position itself.
The frontier thus stays within a lead and one run of rows of every instance, and a run is one
block's (``key_group_runs.BLOCK_NS``), not a whole batch's.

Once an instance has passed an epoch's position, it reads on only as far as any instance still
before that position, with no lead: an epoch is in force when the slowest instance reaches it, and
on a machine with fewer cores than instances every core the others leave goes to that one. Its
remaining work (a lead and a piece at most) then takes that long on a core of its own, not that
long several times over on a core it shares; the others wait a few milliseconds once per epoch.
"""

from __future__ import annotations

import time

from stretch.runtime import control_block as cbk

UNSET = -1  # an epoch's position while the coordinator places it
NEVER = 1 << 62  # the position of a placement withdrawn (nothing was left to read)
PIECE_NS = 2_000_000
"""About the work of one piece of a batch an instance claims and then reads: the longest an epoch
placed while it reads waits for it. A piece is a call of a vectorized operator, whose kernels run
slower per row over smaller calls."""
CLAIM_PIECE_NS = 1_000_000
"""The same for a per-record function, whose pieces are claims from inside one call (microseconds
each): half the piece, and so half the lead, halves the work an epoch under a backlog waits for."""
LEAD_PIECES = 2
"""How far, in the other's work, an instance may read ahead of another instance of its operator, in
pieces it claims (keyed_instance): with a lead shorter than a piece two instances take turns, each
waiting for the other's next claim. An epoch waits for the slowest instance to read up to the
furthest claim, so a lead and a piece of work at most."""


class Frontier:
    """An instance's side: its claims, and the position of the next epoch once placed."""

    def __init__(self, control, op: int, index: int, epoch: int, piece_ns: int = PIECE_NS):
        self.control = control
        self.lead_ns = LEAD_PIECES * piece_ns
        self.op = op
        self.index = index
        self.epoch = epoch  # the epoch this instance runs under
        self._region = control.segment.region
        self._claim = control.instance_word(op, index, cbk.I_CLAIM)
        self._rate = control.instance_word(op, index, cbk.I_RATE)
        self._pace = control.instance_word(op, index, cbk.I_PACE)
        self._start, self._n, self._spans, self._own = 0, 0, None, 0  # the entry read (``reading``)
        self.waited_ns = 0  # time spent waiting for slower instances (not reading: not in its rate)
        self._placing = control.op_word(op, cbk.O_PLACING)
        self._futex = control.op_word(op, cbk.O_SWITCH_FUTEX)
        self._progress = control.op_word(op, cbk.O_PROGRESS)
        self._waiting_ahead = control.op_word(op, cbk.O_WAITING_AHEAD)
        self.passing = 0  # instances of the previous epoch, until all have passed its position

    def publish_rate(self, ns_per_position: float) -> None:
        """This instance's recent reading time per position of pace (others pace themselves by it)."""
        self._region.store64(self._rate, max(1, int(ns_per_position * 1024)))

    def reading(self, start: int, n: int, spans=None) -> None:
        """This instance reads the gate entry of positions [start, start + n), its own rows in
        ``spans`` (row ranges of the entry), or all rows alike (None)."""
        self._start, self._n, self._spans = start, n, spans
        self._own = sum(b - a for a, b in spans) if spans is not None else n

    def pace(self, position: int) -> int:
        """``position`` of the entry read, as the share of this instance's own rows before it spread
        over the entry's positions (an entry without rows of its own is read at once); elsewhere
        ``position`` itself. Instances that read in step have the same pace."""
        start, n = self._start, self._n
        if self._spans is None or not start <= position < start + n:
            return position
        if not self._own:
            return start + n
        row = position - start
        done = sum(min(max(row - a, 0), b - a) for a, b in self._spans)
        return start + n * done // self._own

    def position_at(self, pace: int) -> int:
        """The furthest position of the entry read whose pace is at most ``pace`` (``pace`` itself
        past the entry)."""
        start, n = self._start, self._n
        if self._spans is None or not start <= pace < start + n:
            return pace
        left = ((pace - start + 1) * self._own - 1) // n  # the most own rows read at that pace
        for a, b in self._spans:
            if left <= b - a:
                return start + a + left
            left -= b - a
        return start + n

    def lead_limit(self, at: int, instances: int) -> int | None:
        """The furthest position this instance, at pace ``at``, may read to and stay within
        ``lead_ns`` of every instance of its epoch (``instances`` of them) behind it in pace (of its
        work at this one's rate while its own is not known yet), and no further than any instance
        of the previous epoch still before its position; None if none is behind. One that has
        passed this instance's next epoch's position is not behind."""
        r, cb, op = self._region, self.control, self.op
        own_rate = r.load64(self._rate)
        limit, passing = None, False
        for j in range(max(instances, self.passing)):
            if j == self.index:
                continue
            epoch = r.load64(cb.instance_word(op, j, cbk.I_EPOCH))
            if epoch > self.epoch or (j >= instances and epoch == self.epoch):  # ahead, or retired
                continue
            before = epoch < self.epoch  # not past this epoch's position yet: no lead over it
            passing |= before
            pace = r.load64(cb.instance_word(op, j, cbk.I_PACE))
            if pace >= at:
                continue
            rate = r.load64(cb.instance_word(op, j, cbk.I_RATE)) or own_rate  # not known yet: as this one's
            reach = pace if before or rate <= 0 else pace + self.lead_ns * 1024 // rate
            limit = reach if limit is None else min(limit, reach)
        if not passing:
            self.passing = 0
        return None if limit is None else self.position_at(limit)

    def passed(self, previous: int) -> None:
        """This instance has passed its next epoch's position, where ``previous`` instances read
        before: it reads on only as far as those still before it, and wakes any that wait for it."""
        self.passing = previous
        r = self._region
        if r.load32(self._waiting_ahead):
            r.fetch_add32(self._progress, 1)
            r.wake32(self._progress)

    def paced(self, instances: int) -> bool:
        """Whether reading needs ``keep_up``: other instances, or some of the previous epoch
        still before its position."""
        return instances > 1 or self.passing > 1

    def keep_up(self, here: int, instances: int, waiting, need: int | None = None) -> int | None:
        """``lead_limit`` at ``here``, once it is past ``here`` (at ``need`` or past, if given: an
        instance that reads whole batches): waits while this instance is as far ahead of a slower
        one as it may be. ``waiting()`` is called meanwhile (it raises to stop). Its pace is
        published as ``here``'s, so two instances never each wait for the other."""
        need = here + 1 if need is None else need
        at = self.pace(here)
        r = self._region
        r.store64(self._pace, at)
        limit = self._limit(at, instances)
        if limit is None or limit >= need:
            return limit
        r.fetch_add32(self._waiting_ahead, 1)
        t0 = time.perf_counter_ns()
        try:
            while True:
                seen = r.load32(self._progress)
                limit = self._limit(at, instances)
                if limit is None or limit >= need:
                    return limit
                waiting()
                r.wait32(self._progress, seen, 0.005)
        finally:
            r.fetch_add32(self._waiting_ahead, 0xFFFFFFFF)
            self.waited_ns += time.perf_counter_ns() - t0

    def _limit(self, at: int, instances: int) -> int | None:
        """``lead_limit``, but never short of the next epoch's position once it is placed: every
        instance reads up to there in any case, and the sooner the slowest does, the sooner the
        epoch is in force."""
        limit = self.lead_limit(at, instances)
        if limit is None or self._region.load64(self._placing) <= self.epoch:
            return limit
        placed = self._region.load64(self.control.position_word(self.op, self.epoch + 1))
        return limit if placed in (UNSET, NEVER) else max(limit, placed)

    def claim(self, end: int, waiting) -> int | None:
        """Commit to reading up to gate position ``end`` under the current epoch, unless the next
        epoch applies before: returns the next epoch's position once it is placed (that may be
        before ``end``: read no further then; it is never before what was claimed earlier), else
        None. ``waiting()`` is called while a placement is under way (it raises to stop)."""
        r = self._region
        r.store64(self._claim, end)
        r.store64(self._pace, self.pace(end))
        if r.load32(self._waiting_ahead):  # instances ahead wait for this one to go on
            r.fetch_add32(self._progress, 1)
            r.wake32(self._progress)
        following = self.epoch + 1
        if r.load64(self._placing) < following:
            return None
        word = self.control.position_word(self.op, following)
        while True:
            seen = r.load32(self._futex)
            position = r.load64(word)
            if position != UNSET:
                return None if position == NEVER else position
            waiting()
            r.wait32(self._futex, seen, 0.01)


def place(control, op: int, epoch: int, instances, floor: int) -> int:
    """The coordinator's side: fix where ``epoch`` applies, at ``floor`` or after (the previous
    epoch's position, or the gate's tail for a barrier) and at or past every claim of the listed
    instances. Until ``control.publish`` (or ``withdraw``) instances that reach the placement wait."""
    r = control.segment.region
    r.store64(control.position_word(op, epoch), UNSET)
    r.store64(control.op_word(op, cbk.O_PLACING), epoch)
    claims = [r.load64(control.instance_word(op, i, cbk.I_CLAIM)) for i in instances]
    return max([floor, *claims])


def withdraw(control, op: int, epoch: int) -> None:
    """Give up a placement (nothing was left to read): waiting instances go on under their epoch."""
    r = control.segment.region
    r.store64(control.position_word(op, epoch), NEVER)
    futex = control.op_word(op, cbk.O_SWITCH_FUTEX)
    r.fetch_add32(futex, 1)
    r.wake32(futex)


def start_claim(control, op: int, instance: int, position: int) -> None:
    """An instance added at ``position`` has committed to nothing before it."""
    region = control.segment.region
    region.store64(control.instance_word(op, instance, cbk.I_PACE), position)
    region.store64(control.instance_word(op, instance, cbk.I_CLAIM), position)
