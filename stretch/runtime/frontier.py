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

A per-record function reads a whole run of its rows in one call (its keys' state is then loaded
and written back once a run), yet it claims that run piece by piece from inside the call, so a
claim never runs far ahead of what the instance has processed.

The frontier is only as close to every instance as the instances are to each other. Under a
backlog, a reader that runs faster than another (its key groups hold fewer rows, or it got more
CPU) would read on to the gate's tail, and an epoch placed there would wait for the slower one to
work off the whole gate. So an instance reads ahead of another by at most ``LEAD_NS`` of the other's
work (from the rate each one publishes): under a backlog the slowest instance sets the operator's
pace in any case. A batch is laid out by key group, so the instances of one operator read the same
entry at once, each in its own run of rows, far apart in positions though not in time: an instance
may always read to the end of the entry another one reads. The frontier thus stays within the
larger of ``LEAD_NS`` and one entry's work of every instance.
"""

from __future__ import annotations

from stretch.runtime import control_block as cbk

UNSET = -1  # an epoch's position while the coordinator places it
NEVER = 1 << 62  # the position of a placement withdrawn (nothing was left to read)
LEAD_NS = 4_000_000
"""How far, in the other's work, an instance may read ahead of another instance of its operator."""


class Frontier:
    """An instance's side: its claims, and the position of the next epoch once placed."""

    def __init__(self, control, op: int, index: int, epoch: int):
        self.control = control
        self.op = op
        self.index = index
        self.epoch = epoch  # the epoch this instance runs under
        self._region = control.segment.region
        self._claim = control.instance_word(op, index, cbk.I_CLAIM)
        self._rate = control.instance_word(op, index, cbk.I_RATE)
        self._entry_end = control.instance_word(op, index, cbk.I_ENTRY_END)
        self._placing = control.op_word(op, cbk.O_PLACING)
        self._futex = control.op_word(op, cbk.O_SWITCH_FUTEX)
        self._progress = control.op_word(op, cbk.O_PROGRESS)
        self._waiting_ahead = control.op_word(op, cbk.O_WAITING_AHEAD)

    def publish_rate(self, ns_per_position: float) -> None:
        """This instance's recent reading time per gate position (others pace themselves by it)."""
        self._region.store64(self._rate, max(1, int(ns_per_position * 1024)))

    def reading(self, end: int) -> None:
        """This instance reads the gate entry that ends at ``end`` (others may read up to there)."""
        self._region.store64(self._entry_end, end)

    def lead_limit(self, here: int, instances: int) -> int | None:
        """The furthest position this instance, at ``here``, may read to and stay within LEAD_NS
        (or the entry it reads) of every instance of its epoch (``instances`` of them) that is
        behind it (no further than that entry while its pace is not known yet); None if none is
        behind."""
        r, cb, op = self._region, self.control, self.op
        limit = None
        for j in range(instances):
            if j == self.index:
                continue
            claim = r.load64(cb.instance_word(op, j, cbk.I_CLAIM))
            if claim >= here:
                continue
            rate = r.load64(cb.instance_word(op, j, cbk.I_RATE))
            reach = claim + LEAD_NS * 1024 // rate if rate > 0 else claim
            reach = max(reach, r.load64(cb.instance_word(op, j, cbk.I_ENTRY_END)))
            limit = reach if limit is None else min(limit, reach)
        return limit

    def keep_up(self, here: int, instances: int, waiting, need: int | None = None) -> int | None:
        """``lead_limit``, once it is past ``here`` (at ``need`` or past, if given: an instance
        that reads whole batches): waits while this instance is as far ahead of a slower one as it
        may be. ``waiting()`` is called meanwhile (it raises to stop)."""
        need = here + 1 if need is None else need
        limit = self.lead_limit(here, instances)
        if limit is None or limit >= need:
            return limit
        r = self._region
        r.fetch_add32(self._waiting_ahead, 1)
        try:
            while True:
                seen = r.load32(self._progress)
                limit = self.lead_limit(here, instances)
                if limit is None or limit >= need:
                    return limit
                waiting()
                r.wait32(self._progress, seen, 0.005)
        finally:
            r.fetch_add32(self._waiting_ahead, 0xFFFFFFFF)

    def claim(self, end: int, waiting) -> int | None:
        """Commit to reading up to gate position ``end`` under the current epoch, unless the next
        epoch applies before: returns the next epoch's position once it is placed (that may be
        before ``end``: read no further then; it is never before what was claimed earlier), else
        None. ``waiting()`` is called while a placement is under way (it raises to stop)."""
        r = self._region
        r.store64(self._claim, end)
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
    region.store64(control.instance_word(op, instance, cbk.I_ENTRY_END), position)
    region.store64(control.instance_word(op, instance, cbk.I_CLAIM), position)
