"""Driver-side sinks: a thread per sink reads its sink gate in order and writes the records out.

In a checkpointed job a sink is transactional: what arrives after checkpoint n-1's barrier is
output only once checkpoint n completes (an output channel appends it to its log at once but moves
the log's visible end at the commit; other sinks hold the batches until then). After a failure the
uncommitted part is dropped and the sink continues on the rebuilt gate, where the job replays it.

A sink that carries event time (``timed``: a checkpointed cluster job's forward log) also gets its
producers' watermarks, and hands the least of them on (SinkWriter.watermark), after the records
before it.
"""

from __future__ import annotations

import threading

from stretch.errors import JobExecutionError
from stretch.plan.stages import SinkSpec
from stretch.runtime.channel_writers import ChannelLogWriter
from stretch.runtime.event_time import WatermarkTracker, producer_id
from stretch.runtime.gate import Gate, GateClosed, Kind
from stretch.runtime.outputs import exception_text
from stretch.runtime.transactions import TxnResults

_FINAL = 1 << 62
_TIME = (Kind.WATERMARK, Kind.IDLE, Kind.LEAVE)


class SinkRunner(threading.Thread):
    """Feeds one sink's writer from its gate until end of stream, then closes the writer."""

    def __init__(self, spec: SinkSpec, gate: Gate, coordinator, writer=None, transactional: bool = False):
        """``writer``: the job's own writer for sinks it serves itself (output channels)."""
        super().__init__(name=f"stretch-sink-{spec.name}", daemon=True)
        self.spec = spec
        self.writer = writer
        self.gate = gate
        self.coordinator = coordinator
        self.transactional = transactional
        self.reached = 0  # the latest checkpoint barrier read
        self.finished = False
        self._lock = threading.Lock()  # the writer, between this thread and commits
        self._open: list = []  # batches since the latest barrier (held sinks)
        self._staged: list[tuple[int, object]] = []  # (checkpoint, its batches or log offset)
        self._active = None  # the writer in use while the thread runs
        self._channel = isinstance(writer, ChannelLogWriter)  # appends at once, commits by offset
        self._next_gate: Gate | None = None
        self._rollback_to: int | None = None
        self._switched = threading.Event()  # the runner let go of the gate replace_gate replaced
        self.txns: TxnResults | None = None  # an output channel's: results per input transaction
        self.clock = self._tracker(coordinator) if getattr(spec.sink, "timed", False) else None

    # ---- called by the coordinator ----------------------------------------------------------
    def output_offset(self, checkpoint: int) -> int | None:
        """An output channel's log offset at this checkpoint's barrier (None for other sinks)."""
        with self._lock:
            return next((held for n, held in self._staged if n == checkpoint and self._channel), None)

    def commit(self, checkpoint: int) -> None:
        """Checkpoint ``checkpoint`` completed: output everything before its barrier."""
        with self._lock:
            done = [s for s in self._staged if s[0] <= checkpoint]
            self._staged = [s for s in self._staged if s[0] > checkpoint]
            try:
                for _, held in done:
                    if self._channel:
                        self._active.commit(held)
                    else:
                        for batch, producer in held:
                            self._active.write(batch, producer)
            except Exception as e:  # the sink's own failure: it fails the job, as it would unheld
                self.coordinator.sink_finished(self.spec.id, self._named(e))
                raise

    def replace_gate(self, gate: Gate, committed_offset: int | None, timeout: float) -> None:
        """The job rebuilt its gates after a failure: drop what was not committed, read ``gate``.

        Returns once the runner no longer touches the old gate, so it may be unmapped.
        """
        if self.finished:  # it already output everything: what the job replays into it is dropped
            threading.Thread(target=_drain, args=(gate,), daemon=True).start()
            return
        self._rollback_to = committed_offset
        self._switched.clear()
        self._next_gate = gate
        self.gate.close()
        while not self._switched.wait(0.01) and self.is_alive() and timeout > 0:
            timeout -= 0.01
        if not self._switched.is_set():  # it ended meanwhile: nobody else reads the new gate
            threading.Thread(target=_drain, args=(gate,), daemon=True).start()

    # ---- the thread -------------------------------------------------------------------------
    def run(self) -> None:
        error = None
        try:
            self._active = self.writer or self.spec.sink.create_writer(self.spec.upstream_parallelism)
            while not self._consume():
                self._rollback()
            with self._lock:
                self._active.close()
                self._active = None
        except BaseException as e:
            error = e
        finally:
            if self._active is not None:
                try:
                    self._active.abort()
                except Exception:
                    pass
            self.finished = True
            if self.txns is not None:
                self.txns.fail(f"the job's sink {self.spec.name!r} stopped before the transaction completed")
            self.coordinator.sink_finished(self.spec.id, error if error is None else self._named(error))

    def _named(self, error: BaseException) -> BaseException:
        """The sink's failure as the job's error: it names the sink as the user named it (or its
        default name, the sink's class) and keeps the original as its cause."""
        if isinstance(error, (GateClosed, JobExecutionError)):  # the job stopping, or named already
            return error
        named = JobExecutionError(
            f"sink {self.spec.name!r} failed: {type(error).__name__}: {exception_text(error)}"
        )
        named.__cause__ = error
        return named

    def _consume(self) -> bool:
        """Read the gate to its end (True); False when the gate was replaced after a failure."""
        gate, seq = self.gate, 0
        try:
            while True:
                if not gate.wait(seq, timeout=0.2):
                    continue
                # a view of the gate lasts only until the cursor moves on: only a channel's writer,
                # which appends it to its log at once, takes it as it is
                entry = gate.read(seq, copy=not self._channel)
                if entry.kind is Kind.DATA:
                    self._write(
                        entry.batch, entry.arg0, entry.arg1, gate.payload(seq) if self._channel else None
                    )
                elif entry.kind is Kind.CHECKPOINT:
                    self._barrier(entry.arg0)
                elif entry.kind is Kind.MARK and entry.arg1 and self.txns is not None:
                    self.txns.mark(entry.arg1, entry.arg0)
                elif self.clock is not None and entry.kind in _TIME:
                    self._time(entry.kind, entry.arg0, entry.arg1)
                seq += 1
                gate.advance(0, seq)
                if entry.kind is Kind.END_OF_STREAM:  # everything upstream ended: all of it is final
                    self._barrier(_FINAL)
                    self.commit(_FINAL)
                    return True
        except GateClosed:
            if self._next_gate is None:
                raise
            return False

    def _write(self, batch, producer: int, txn: int, ipc=None) -> None:
        """``ipc``: an output channel's batch as its gate holds it (ChannelLogWriter.write)."""
        with self._lock:
            if self.transactional and not self._channel:
                self._open.append((batch, producer))
                return
            offset = (
                self._active.write(batch, producer)
                if ipc is None
                else self._active.write(batch, producer, ipc)
            )
        if txn and offset is not None and self.txns is not None:
            self.txns.output(txn, offset)

    def _tracker(self, coordinator) -> WatermarkTracker:
        """The watermarks of the producing instances the job starts with (those a rescale adds
        join with their first watermark, as at a gate)."""
        stages = coordinator.plan.stages
        return WatermarkTracker(
            [producer_id(sid, i) for sid in self.spec.producers for i in range(stages[sid].parallelism)]
        )

    def _time(self, kind: Kind, producer: int, value: int) -> None:
        """A producer's watermark, idleness or leaving; the sink hears the least, once it moves."""
        if kind is Kind.WATERMARK:
            watermark = self.clock.watermark(producer, value)
        elif kind is Kind.IDLE:
            watermark = self.clock.go_idle(producer)
        else:
            watermark = self.clock.leave(producer)
        if watermark is not None:
            with self._lock:
                self._active.watermark(watermark)

    def _barrier(self, checkpoint: int) -> None:
        if self.txns is not None:
            self.txns.barrier(checkpoint)
        with self._lock:
            if self._channel:
                self._staged.append((checkpoint, self._active.log.end_offset))
            else:
                self._staged.append((checkpoint, self._open))
                self._open = []
            self.reached = checkpoint

    def _rollback(self) -> None:
        with self._lock:
            self._open, self._staged = [], []
            if self._channel and self._rollback_to is not None:
                self._active.rollback(self._rollback_to)
            if self.txns is not None:
                self.txns.reset()
            self.gate, self._next_gate = self._next_gate, None
            self.reached = 0
        self._switched.set()


def _drain(gate: Gate) -> None:
    """Read a gate to its end, keeping nothing (its producers must not block)."""
    seq = 0
    try:
        while True:
            if gate.wait(seq, timeout=0.2):
                kind = gate.read(seq).kind
                seq += 1
                gate.advance(0, seq)
                if kind is Kind.END_OF_STREAM:
                    return
    except (GateClosed, ValueError):  # the job ended (and unmapped the gate)
        pass
