"""The job thread's loop: what one job does with its workers' events, and how it recovers.

Every change to a running job goes through one queue, handled in order by the job's thread: its
workers' messages and exits, cancels and failures, sinks that ended, and calls other threads make
in it (sending new code). An epoch is placed by the thread that asks for it, between two events
(``place``): the job thread may wait milliseconds for a core. Here tasks are handed to workers, a stage's end moves
end-of-stream markers into the gates it fed, a worker's failure becomes the user's error, and a
worker's death restarts the job from its latest checkpoint. The Coordinator owns the job (its
segments, socket and workers); this is its thread at work.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field

import cloudpickle

from stretch.common.job_status import JobStatus
from stretch.errors import JobExecutionError, UserFunctionError
from stretch.runtime.gate import Kind
from stretch.runtime.status import InstanceRates
from stretch.runtime.worker_pool import Worker


@dataclass
class _StageState:
    running: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    finished: bool = False


class JobLoop:
    """The events of one job, handled in its thread (``run``); ``co`` is its Coordinator."""

    def __init__(self, coordinator):
        self.co = coordinator
        self.events: queue.Queue = queue.Queue()  # what the job thread handles, in order
        self.lock = threading.RLock()  # held while one event is handled, or an epoch placed (``place``)
        # (stage id, instance index, start epoch, code version, gate position): tasks waiting for a worker
        self.pending: list[tuple[int, int, int, int, int]] = []
        self.positions: dict[int, int] = {}  # source stage id -> position to restart at
        self._stages = {s.id: _StageState() for s in coordinator.plan.stages}
        self._sinks_done: set[int] = set()
        self._finished_gates: set[int] = set()

    def restart(self, pending: list, positions: dict[int, int]) -> None:
        """A new dataplane: its tasks wait for workers and every stage starts over."""
        self.pending, self.positions = pending, positions
        self._stages = {s.id: _StageState() for s in self.co.plan.stages}
        self._finished_gates = set()

    # ---- events (put by any thread) -----------------------------------------------------------
    def on_worker_message(self, conn, msg) -> None:
        if msg.get("op") == "update_checked":  # its caller waits: not for this thread's turn too
            self.co.updater.answered(msg)
        self.events.put(("msg", conn, msg))

    def on_close(self, conn) -> None:
        self.events.put(("closed", conn))

    def place(self, fn, *args):
        """``fn(*args)`` (placing an epoch) in the caller's thread, between two events of the job
        thread: a rescale, update or release need not wait for the job thread to be scheduled,
        which on busy cores takes milliseconds. A recovery under way refuses it (its caller may
        hold the turn the recovery waits for, ``Coordinator.exclusive``)."""
        while not self.lock.acquire(timeout=0.002):
            if self.co.status is JobStatus.RESTARTING:
                return RuntimeError("the job is recovering from a failure; retry")
        try:
            return fn(*args)
        finally:
            self.lock.release()

    # ---- the job thread -----------------------------------------------------------------
    def run(self) -> None:
        """Handle events until the job finishes, fails or is cancelled."""
        co = self.co
        while True:
            with self.lock:
                if self._finished():
                    co.output_complete_at = time.monotonic()
                    co.status = JobStatus.FINISHED
                    return
                co.rates.tick(co)
            try:
                event = self.events.get(timeout=InstanceRates.EVERY)
            except queue.Empty:
                continue
            if event[0] == "replenish":  # without the lock: forks take tens of ms on busy cores
                self._replenish()
                continue
            with self.lock:
                if self._dispatch(event):
                    return

    def _dispatch(self, event) -> bool:
        """Handle one event; True once the job ended (failed or cancelled)."""
        co = self.co
        kind = event[0]
        if kind == "msg":
            self._handle(event[1], event[2])
        elif kind == "closed":
            self._worker_gone(event[1])
        elif kind == "fail":
            self._fail(event[1])
        elif kind == "sink_done":
            if event[2] is not None:
                self._fail(event[2])
            self._sinks_done.add(event[1])
        elif kind == "call":
            event[1](*event[2])
        elif kind == "end_channel":
            co.channels.end(event[1])
            event[2].set()
        elif kind == "cancel" and not co.status.is_globally_terminal_state():
            co.status = JobStatus.CANCELLING
            co.stop_everything()
            co.status = JobStatus.CANCELED
            return True
        if co.status is JobStatus.FAILING:
            co.stop_everything()
            co.status = JobStatus.FAILED
            return True
        return False

    def _finished(self) -> bool:
        return all(s.finished for s in self._stages.values()) and len(self._sinks_done) == len(
            self.co.plan.sinks
        )

    def _fail(self, error: BaseException) -> None:
        """The job fails with ``error`` (its first error is the one kept); ``run`` then stops it."""
        co = self.co
        if co.error is None:
            co.error = error
        if not co.status.is_globally_terminal_state():
            co.status = JobStatus.FAILING

    def _handle(self, conn, msg) -> None:
        """A message of one of the job's own workers (requests from outside: ``runtime.requests``)."""
        co = self.co
        op = msg.get("op")
        if op == "hello":
            w = co.workers.of(conn)
            if w is None:
                return
            w.conn = conn
            # every worker gets the job once: segments to attach and the stages, so that starting a
            # task (also in a rescale) is a small message to an already warm, attached process
            conn.send({"op": "prepare", "resources": co.resources, "stages": co.stage_blobs}, fmt=ord("P"))
            self._assign(w)
            co.updater.worker_ready(w)
        elif op == "user_metrics":
            w = co.workers.of(conn)
            if w is not None and w.task == (msg["stage"], msg["index"]):  # not a late one of an ended task
                co.user_metrics[(co.plan.stages[msg["stage"]].name, msg["index"])] = msg["metrics"]
        elif op == "update_checked":
            w = co.workers.of(conn)
            if w is not None:
                co.updater.checked(w)
                if co.status is JobStatus.RUNNING:
                    self._assign(w)
        elif op in ("done", "stopped", "failed"):
            w = co.workers.of(conn)
            if w is None:  # a worker of an attempt that a recovery ended
                return
            w.task = None
            co.user_metrics.pop((co.plan.stages[msg["stage"]].name, msg["index"]), None)
            if op == "failed":
                self._fail(_job_error(msg["error"], co.plan.stages[msg["stage"]].name))
            elif op == "done" and msg.get("retired"):
                self._stages[msg["stage"]].running.discard(msg["index"])  # its worker rejoins the pool
                self._check_finished(msg["stage"])  # the other instances may have ended before it
            elif op == "done":
                self.instance_done(msg["stage"], msg["index"])
            if co.status is JobStatus.RUNNING:
                self._assign(w)

    # ---- tasks ------------------------------------------------------------------------------
    def _assign(self, w: Worker) -> None:
        """Hand ``w`` the next task waiting for a worker, if any."""
        if not self.pending or w.conn is None:
            return
        co = self.co
        stage_id, index, epoch, code, start = self.pending.pop(0)
        if not self.pending and co.recoveries and "running_at" not in co.recoveries[-1]:
            co.recoveries[-1]["running_at"] = time.time()  # every task of the new attempt is handed out
        w.task = (stage_id, index)
        self._stages[stage_id].running.add(index)
        w.conn.send(
            {
                "op": "run",
                "stage": stage_id,
                "index": index,
                "epoch": epoch,
                "code": code,  # the version in force where it starts reading
                "position": self.positions.get(stage_id, 0),
                "start": start,  # a keyed instance's: the gate position it reads from
            }
        )

    def start_tasks(self, tasks: list[tuple[int, int, int, int, int]]) -> None:
        """Start ``tasks`` ahead of those waiting: in idle workers, and in workers spawned for the rest."""
        co = self.co
        self.pending[:0] = tasks
        idle = co.idle_workers()
        for w in idle[: len(tasks)]:
            self._assign(w)
        for _ in range(len(tasks) - len(idle)):
            co.spawn_worker()

    def _replenish(self) -> None:
        """Keep the warm pool at its size (spares are forked from the zygote, ready in milliseconds).

        In the job thread but outside its lock, so that a rescale or an update placing its epoch
        meanwhile (``place``) is not held up by the forks; the pool makes forks and stopping take
        turns, and a spare too many (counted while a task took a worker) does no harm."""
        co = self.co
        missing = co.config.spare_workers + len(self.pending) - len(co.workers.idle()) - co.workers.starting()
        for _ in range(max(missing, 0)):
            if co.status is not JobStatus.RUNNING:
                return
            co.spawn_worker()

    # ---- stages ending ------------------------------------------------------------------------
    def stage_finished(self, stage_id: int) -> bool:
        st = self._stages[stage_id]
        return st.finished or (self.co.plan.stages[stage_id].kind == "source" and 0 in st.done)

    def instance_done(self, stage_id: int, index: int) -> None:
        st = self._stages[stage_id]
        st.running.discard(index)
        st.done.add(index)
        self._check_finished(stage_id)

    def _check_finished(self, stage_id: int) -> None:
        """A stage ends when as many instances as its parallelism ended and none still runs (an
        instance a rescale removed may report after the others ended)."""
        st = self._stages[stage_id]
        if len(st.done) >= self.co.parallelism_of(stage_id) and not st.running and not st.finished:
            st.finished = True
            self._producer_finished(stage_id)

    def _producer_finished(self, stage_id: int) -> None:
        """A stage ended: every gate and sink whose producers have all ended gets end-of-stream."""
        co = self.co
        done = {s for s, st in self._stages.items() if st.finished}
        for gate_id, producers in co.plan.gate_producers.items():
            if gate_id not in self._finished_gates and set(producers) <= done:
                self._finished_gates.add(gate_id)
                co.gates[gate_id].append_control(Kind.END_OF_STREAM)
        for sink in co.plan.sinks:
            key = -1 - sink.id
            if key not in self._finished_gates and set(sink.producers) <= done:
                self._finished_gates.add(key)
                if sink.runs_in == "instance":
                    self._sinks_done.add(sink.id)
                else:
                    co.sink_gates[sink.id].append_control(Kind.END_OF_STREAM)

    # ---- a worker's death, and recovery -----------------------------------------------------
    def _worker_gone(self, conn) -> None:
        co = self.co
        w = co.workers.of(conn)
        if w is None:
            return
        w.exited = True
        if co.updater.worker_died(w):
            pass
        elif w.task is not None and co.status is JobStatus.RUNNING:
            stage = co.plan.stages[w.task[0]]
            message = f"worker {w.pid} running operator {stage.name!r} exited unexpectedly"
            limit = co.config.checkpoint.max_recoveries_in_a_row
            if co.checkpointer is None:
                self._fail(JobExecutionError(message))
            elif co.recoveries_in_a_row >= limit:  # it would only die again: a crash loop
                self._fail(
                    JobExecutionError(
                        f"{message}; the job gives up: {limit} recoveries in a row without a completed "
                        "checkpoint in between"
                    )
                )
            else:
                co.recoveries_in_a_row += 1
                self._recover(message)

    def _recover(self, reason: str) -> None:
        """A worker died: restart every task from the latest complete checkpoint.

        Every worker is killed and every gate, arena and the control block are built anew; the
        state comes from the checkpoint's key-group files, sources restart at its positions, and
        the sinks drop what they had not committed. Readers of the output thus see each result
        exactly once. Input channel gates and logs, which outside writers use, are kept.
        """
        co = self.co
        t0 = time.monotonic()
        co.status = JobStatus.RESTARTING
        co.generation += 1  # a checkpoint or rescale under way gives up and lets go
        co.exclusive.acquire()  # a caller that holds it and places an epoch meanwhile is refused (place)
        try:
            co.workers.kill_all(co.config.shutdown_timeout)
            co.updater.workers_gone()
            latest = co.checkpointer.store.latest()  # at least the run's start
            co.updater.run_code_of(latest, "checkpoint")  # an update after it is undone with the rest
            co.rebuild_dataplane(latest)
            for _ in range(len(self.pending) + co.config.spare_workers):
                co.spawn_worker()
            co.status = JobStatus.RUNNING
            co.recoveries.append(
                {
                    "reason": reason,
                    "checkpoint": latest["id"],
                    "elapsed_ms": (time.monotonic() - t0) * 1000,
                    "at": time.time(),
                }
            )
        finally:
            co.exclusive.release()


def _job_error(report: dict, operator: str) -> BaseException:
    """Rebuild a worker's failure as the exception the user sees."""
    cause = None
    if report.get("exception"):
        with contextlib.suppress(Exception):
            cause = cloudpickle.loads(report["exception"])
    message = report["message"]
    if "user_traceback" in report:
        err: BaseException = UserFunctionError(
            f"{message}\n\nUser code traceback (worker process):\n{report['user_traceback']}"
        )
    elif report["type"] in ("TypeError", "ValueError", "KeyError", "IndexError", "OverflowError"):
        err = {
            "TypeError": TypeError,
            "ValueError": ValueError,
            "KeyError": KeyError,
            "IndexError": IndexError,
            "OverflowError": OverflowError,
        }[report["type"]](message)
    else:
        err = JobExecutionError(
            f"operator {operator!r} failed: {report['type']}: {message}\n{report['traceback']}"
        )
    if cause is not None:
        err.__cause__ = cause
    return err
