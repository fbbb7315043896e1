"""The job's control block: per keyed operator, the ownership table by epoch and instance counters.

Ownership is only a table (key group -> instance index). A rescale, a live update or a barrier
publishes the next epoch here: its table, its code version and the position of the operator's
gate from which it applies (placed at the readers' frontier, see runtime.frontier); instances
switch when they reach that position. Each instance also publishes the epoch it runs under, how far
it has committed to read, and its counters here, so the coordinator, the CLI and other instances
can see progress without asking.
"""

from __future__ import annotations

import json
import time

import numpy as np

from stretch._shm import Segment

TABLE_RING = 8  # epochs kept readable; a rescale waits until its slot is no longer in use
MAX_INSTANCES = 256

# Per-instance words (int64).
I_EPOCH, I_RECORDS_IN, I_RECORDS_OUT, I_BUSY_NS, I_BATCHES, I_HEARTBEAT_NS, I_STATE, I_GATE_SEQ = range(8)
I_STALL_NS, I_MAX_STALL_NS = 8, 9  # time spent waiting for previous owners at epochs' positions
I_LAST_STALL_NS, I_LAST_GAINED = 10, 11  # the latest epoch: how long it waited, whether it gained
I_ACTIVE = 12  # the epoch whose ownership the instance processes under (after its handoff waits)
I_ACTIVE_AT_NS = 13  # CLOCK_MONOTONIC time it became active under that epoch
I_WATERMARK = 14  # the instance's input watermark (event time, ms); 0 before the first
I_CHECKPOINT = 15  # the latest checkpoint barrier the instance passed (its key groups copied)
I_BARRIER_AT_NS = 16  # CLOCK_MONOTONIC time it read that barrier (it stands still from then)
I_CODE = 17  # the code version the instance runs (it passed that version's epoch)
I_CODE_AT_NS = 18  # CLOCK_MONOTONIC time it switched to that version
I_CLAIM = 19  # the gate position up to which it has committed to read under its epoch (runtime.frontier)
I_RATE = 20  # its recent reading time per position of pace, in ns/1024 (0: not known yet)
I_PACE = 21  # its claim as a position of pace: its share of the entry it reads (runtime.frontier)
I_WORDS = 24
CODE_HELD = 1 << 62  # an epoch's code version while its live update is still checked (runtime.updater)
# Instance states.
FREE, RUNNING, DONE = 0, 1, 2

_OP_HEADER = 64  # epoch, parallelism, switch futex...
_WM_BYTES = 64 * 1024  # the watermark tracking state saved at the latest epoch's position
O_EPOCH, O_PARALLELISM, O_SWITCH_FUTEX = 0, 1, 2
O_KEY_GROUPS = 3  # the operator's own max parallelism (its tables' length), if not the job's
O_PLACING = 4  # the epoch being placed, or the latest placed (runtime.frontier)
O_PROGRESS = 5  # a futex bumped when an instance claims more while others wait for it (runtime.frontier)
O_WAITING_AHEAD = 6  # how many instances wait for others to catch up (runtime.frontier)
O_EPOCHS = 16  # per epoch of the ring, three words: the gate position it applies from, its code
_EPOCH_WORDS = 3  # version, its parallelism (instances at or above it retire there)
# Job-wide words after the operators' areas: checkpoint barriers (see runtime.checkpointing).
_JOB_WORDS = 1024
J_REQUEST, J_FUTEX, _J_STAGES = 0, 1, 16
S_REACHED, S_RELEASED, S_POSITION = 0, 1, 2  # per stage, 8 words each (checkpoint barriers)
S_CODE, S_CODE_DONE = 3, 4  # a source stage's chained steps: the code version asked for, and reached
MAX_STAGES = (_JOB_WORDS - _J_STAGES) // 8


class ControlBlock:
    """Typed views over the control segment (the same layout in every process of the job)."""

    def __init__(self, segment: Segment, n_operators: int, max_parallelism: int):
        self.segment = segment
        self.n_operators = n_operators
        self.max_parallelism = max_parallelism
        table_bytes = TABLE_RING * max_parallelism * 2
        self._table_bytes = (table_bytes + 63) // 64 * 64
        self._inst_bytes = MAX_INSTANCES * I_WORDS * 8
        self._op_bytes = _OP_HEADER * 8 + self._table_bytes + self._inst_bytes + _WM_BYTES

    @staticmethod
    def size(n_operators: int, max_parallelism: int) -> int:
        table_bytes = (TABLE_RING * max_parallelism * 2 + 63) // 64 * 64
        per_op = _OP_HEADER * 8 + table_bytes + MAX_INSTANCES * I_WORDS * 8 + _WM_BYTES
        return max(n_operators, 1) * per_op + _JOB_WORDS * 8

    @classmethod
    def create(cls, prefix: str, n_operators: int, max_parallelism: int) -> ControlBlock:
        seg = Segment.create(prefix, "control", cls.size(n_operators, max_parallelism))
        return cls(seg, n_operators, max_parallelism)

    @classmethod
    def attach(cls, name: str, n_operators: int, max_parallelism: int) -> ControlBlock:
        return cls(Segment.attach(name), n_operators, max_parallelism)

    def _base(self, op: int) -> int:
        return op * self._op_bytes

    def _wm_area(self, op: int) -> int:
        return self._base(op) + _OP_HEADER * 8 + self._table_bytes + self._inst_bytes

    def save_watermarks(self, op: int, epoch: int, state: dict) -> None:
        """The operator's watermark tracking as of an epoch's position (for instances added there).

        Every instance computes the same state at the same position, so whichever writes first wins.
        """
        r = self.segment.region
        base = self._wm_area(op)
        if r.load64(base) >= epoch:  # written already: the others need not queue for the lock
            return
        r.lock(base + 24)
        try:
            if r.load64(base) >= epoch:
                return
            raw = json.dumps(state).encode()
            if len(raw) > _WM_BYTES - 64:
                raise ValueError("too many watermark producers for one operator")
            self.segment.bytes[base + 64 : base + 64 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            r.store64(base + 8, len(raw))
            r.store64(base, epoch)
        finally:
            r.unlock(base + 24)

    def load_watermarks(self, op: int, epoch: int) -> dict | None:
        r = self.segment.region
        base = self._wm_area(op)
        if r.load64(base) != epoch:
            return None
        n = r.load64(base + 8)
        return json.loads(bytes(self.segment.bytes[base + 64 : base + 64 + n]))

    def header(self, op: int) -> np.ndarray:
        return self.segment.view(np.int64, self._base(op), _OP_HEADER)

    def table(self, op: int, epoch: int) -> np.ndarray:
        """The ownership table (int16 instance index per key group) of an epoch."""
        off = self._base(op) + _OP_HEADER * 8 + (epoch % TABLE_RING) * self.max_parallelism * 2
        return self.segment.view(np.int16, off, int(self.header(op)[O_KEY_GROUPS]) or self.max_parallelism)

    def instances(self, op: int) -> np.ndarray:
        """Per-instance words, shape (MAX_INSTANCES, I_WORDS); row i is written by instance i."""
        off = self._base(op) + _OP_HEADER * 8 + self._table_bytes
        return self.segment.view(np.int64, off, MAX_INSTANCES * I_WORDS).reshape(MAX_INSTANCES, I_WORDS)

    def epoch_word(self, op: int) -> int:
        """Byte offset of the operator's current-epoch word (for native atomics)."""
        return self._base(op) + O_EPOCH * 8

    def instance_word(self, op: int, instance: int, word: int) -> int:
        return self._base(op) + _OP_HEADER * 8 + self._table_bytes + (instance * I_WORDS + word) * 8

    def announce(self, op: int, instance: int, word: int, epoch: int) -> None:
        """Publish an instance's progress (I_EPOCH: passed the epoch's position with everything before it
        done and flushed; I_ACTIVE: processing under the epoch) and wake whoever waits on it."""
        r = self.segment.region
        if word in (I_ACTIVE, I_CODE):
            at = I_ACTIVE_AT_NS if word == I_ACTIVE else I_CODE_AT_NS
            r.store64(self.instance_word(op, instance, at), time.monotonic_ns())
        r.store64(self.instance_word(op, instance, word), epoch)
        futex = self._base(op) + O_SWITCH_FUTEX * 8
        r.fetch_add32(futex, 1)
        r.wake32(futex)

    def wait_epochs(
        self, op: int, instances, epoch: int, timeout: float | None = None, word: int = I_EPOCH
    ) -> bool:
        """Sleep until every listed instance's ``word`` reaches `epoch`; False on timeout."""
        r = self.segment.region
        futex = self._base(op) + O_SWITCH_FUTEX * 8
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            seen = r.load32(futex)
            if all(r.load64(self.instance_word(op, i, word)) >= epoch for i in instances):
                return True
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                return False
            r.wait32(futex, seen, left)

    def op_word(self, op: int, word: int) -> int:
        """Byte offset of one of the operator's header words (O_...)."""
        return self._base(op) + word * 8

    def position_word(self, op: int, epoch: int) -> int:
        """Byte offset of the gate position from which an epoch applies."""
        return self.op_word(op, O_EPOCHS + _EPOCH_WORDS * (epoch % TABLE_RING))

    def code_word(self, op: int, epoch: int) -> int:
        """Byte offset of an epoch's code version."""
        return self.position_word(op, epoch) + 8

    def parallelism_word(self, op: int, epoch: int) -> int:
        """Byte offset of an epoch's parallelism."""
        return self.position_word(op, epoch) + 16

    def publish(
        self,
        op: int,
        epoch: int,
        owners: np.ndarray,
        code: int = 0,
        position: int = 0,
        parallelism: int | None = None,
    ) -> None:
        """Write an epoch's table, code version, parallelism (default: its highest owner + 1; an
        instance may own nothing, its key groups released) and position, then make it the
        operator's current epoch. Instances read the rest once they see the position."""
        r = self.segment.region
        self.table(op, epoch)[:] = owners
        r.store64(self.code_word(op, epoch), code)
        p = int(owners.max()) + 1 if parallelism is None else parallelism
        r.store64(self.parallelism_word(op, epoch), p)
        h = self.header(op)
        h[O_PARALLELISM] = p
        r.store64(self.position_word(op, epoch), position)
        r.store64(self.epoch_word(op), epoch)
        r.max64(self.op_word(op, O_PLACING), epoch)
        for word in (O_SWITCH_FUTEX, O_PROGRESS):  # those at the position, those keeping pace
            futex = self.op_word(op, word)
            r.fetch_add32(futex, 1)
            r.wake32(futex)

    def position(self, op: int, epoch: int) -> int:
        return self.segment.region.load64(self.position_word(op, epoch))

    def epoch_at(self, op: int, position: int) -> int:
        """The published epoch in force at a gate position: the latest whose position is at or
        before it (of those the ring still holds)."""
        epoch = self.epoch(op)
        oldest = max(0, epoch - TABLE_RING + 1)
        while epoch > oldest and self.position(op, epoch) > position:
            epoch -= 1
        return epoch

    def code(self, op: int, epoch: int) -> int:
        return self.segment.region.load64(self.code_word(op, epoch))

    def decide_code(self, op: int, epoch: int, version: int) -> None:
        """The code version of an epoch published with ``CODE_HELD``: instances at its position go
        on with it."""
        r = self.segment.region
        r.store64(self.code_word(op, epoch), version)
        futex = self.op_word(op, O_SWITCH_FUTEX)
        r.fetch_add32(futex, 1)
        r.wake32(futex)

    def wait_code(self, op: int, epoch: int, waiting) -> int:
        """An epoch's code version, once decided; ``waiting()`` is called meanwhile (it raises to
        stop)."""
        r = self.segment.region
        futex = self.op_word(op, O_SWITCH_FUTEX)
        while True:
            seen = r.load32(futex)
            code = r.load64(self.code_word(op, epoch))
            if code != CODE_HELD:
                return code
            waiting()
            r.wait32(futex, seen, 0.01)

    def parallelism(self, op: int, epoch: int) -> int:
        return self.segment.region.load64(self.parallelism_word(op, epoch))

    def epoch(self, op: int) -> int:
        return self.segment.region.load64(self.epoch_word(op))

    # ---- checkpoint barriers -------------------------------------------------------------------
    def _job_word(self, word: int) -> int:
        return max(self.n_operators, 1) * self._op_bytes + word * 8

    def stage_word(self, stage: int, word: int) -> int:
        """Byte offset of a stage's checkpoint word (S_REACHED, S_RELEASED, S_POSITION)."""
        if stage >= MAX_STAGES:
            raise ValueError(f"a checkpointed job has at most {MAX_STAGES} stages")
        return self._job_word(_J_STAGES + stage * 8 + word)

    def load(self, offset: int) -> int:
        return self.segment.region.load64(offset)

    def signal(self, offset: int, value: int) -> None:
        """Store a checkpoint word and wake everyone waiting on one (request, reached, released)."""
        r = self.segment.region
        r.store64(offset, value)
        futex = self._job_word(J_FUTEX)
        r.fetch_add32(futex, 1)
        r.wake32(futex)

    @property
    def request_word(self) -> int:
        return self._job_word(J_REQUEST)

    def wait_checkpoint(self, ready, timeout: float) -> bool:
        """Sleep until ``ready()`` (re-checked at every checkpoint signal); False on timeout."""
        r = self.segment.region
        futex = self._job_word(J_FUTEX)
        deadline = time.monotonic() + timeout
        while True:
            seen = r.load32(futex)
            if ready():
                return True
            left = min(0.05, deadline - time.monotonic())
            if left <= 0:
                return False
            r.wait32(futex, seen, left)

    def signals(self) -> int:
        """A count of checkpoint signals so far (for ``wait_signal``)."""
        return self.segment.region.load32(self._job_word(J_FUTEX))

    def wait_signal(self, seen: int, timeout: float) -> None:
        """Until a checkpoint signal after ``seen`` (a ``signals()`` value), or the timeout."""
        self.segment.region.wait32(self._job_word(J_FUTEX), seen, timeout)

    def close(self) -> None:
        self.segment.close()
