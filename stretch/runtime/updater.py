"""The coordinator's side of a live code update (``JobClient.update``; see ``runtime.code_update``).

An update takes its operator's turn (rescales, updates and checkpoints take turns), is checked in a
spare worker, and switches at one position: an epoch of a keyed operator, placed at the readers'
frontier of its gate (runtime.rescaler), or, for a step chained after a source, a control word the
source task reads between two items. A keyed operator's epoch is placed as the check starts, its
code version held: the instances reach its position while the worker checks, and wait there for
the version decided, the new one if the check passes within ``HOLD_S``, else the old one (a slow
check's update then places an epoch of its own once it passed). In a
checkpointed job a checkpoint follows, recording the new version; a recovery runs the versions of
the checkpoint it restores, so an update it did not cover is undone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import queue
import shutil
import time
from pathlib import Path

from stretch.common.job_status import JobStatus
from stretch.errors import InputEnded, UnpicklableFunction, UpdateRefused
from stretch.plan.shipping import pickled_stage
from stretch.runtime import control_block as cbk
from stretch.runtime.code_update import CodeHistory, swapped_stage, target
from stretch.runtime.rescaler import Placed

HOLD_S = 0.025
"""How long a keyed operator's instances may wait at an update's position for its check: a check
takes a few milliseconds, about as long as the instances take to reach the position."""


class _Held:
    """An update's epoch placed while its check runs; its code version is decided once."""

    def __init__(self, co, placed: Placed, old: int):
        self.co, self.placed, self.old = co, placed, old
        self.decided = False

    def decide(self, version: int) -> None:
        if self.decided:
            return
        self.decided = True
        try:
            self.co.control.decide_code(self.placed.op, self.placed.epoch, version)
        except ValueError:  # a recovery released the control block: the update is undone anyway
            if self.co.generation == self.placed.generation:
                raise

    def release(self) -> None:
        """The instances go on under the old code."""
        self.decide(self.old)


class Updater:
    """Live code updates of one job; ``co`` is its Coordinator."""

    def __init__(self, coordinator):
        self.co = coordinator
        self.history: CodeHistory | None = None  # every stage's code versions
        self.reports: list[dict] = []  # every completed update's report, in order
        self._checks: dict[int, queue.Queue] = {}  # checks under way, by id
        self._ids = itertools.count(1)
        self._waiting: list[tuple] = []  # checks that wait for a worker to start
        self._durable = False

    def start(self, directory: Path, durable: bool, restore: dict | None, mode: str) -> None:
        """Keep the versions in ``directory`` (kept after the run if ``durable``); a restored run
        runs the checkpoint's versions as ``mode`` says (``CodeHistory.at_checkpoint``)."""
        self._durable = durable
        self.history = CodeHistory(directory, self.co.plan.stages, restore=restore is not None)
        if restore is not None:
            self.run_code_of(restore, mode)

    def run_code_of(self, checkpoint: dict, mode: str) -> None:
        """Run each stage's code version recorded in ``checkpoint``."""
        versions, stages = checkpoint.get("code", {}), self.co.plan.stages
        for i, stage in enumerate(stages):
            stages[i] = self.history.at_checkpoint(stage, versions.get(stage.name, 0), mode)
        self.co.stage_blobs_changed()

    def close(self) -> None:
        if not self._durable and self.history is not None:
            shutil.rmtree(self.history.dir, ignore_errors=True)

    # ---- an update, in the caller's thread ----------------------------------------------------
    def update(
        self,
        operator: str,
        function,
        *,
        output_type=None,
        dry_run: bool = False,
        drop_orphaned: bool = False,
        source: str = "",
        timeout: float | None = None,
    ) -> dict:
        """See ``Coordinator.update``."""
        co = self.co
        t0 = time.monotonic_ns()
        stage, step = target(co.plan, operator)
        swapped_stage(stage, function, output_type, step)  # refuse a wrong kind before waiting a turn
        co.refuse_if_ended("updated")
        with co.rescaler.reconfiguring(stage), co.exclusive:
            generation = co.generation  # a recovery from now on bumps it: this update is undone
            co.refuse_if_ended("updated")
            stage = co.plan.stages[stage.id]  # the latest version
            new = self.history.numbered(swapped_stage(stage, function, output_type, step))
            blob = _pickled(new, operator)
            ticket = self._start_check(stage, blob)
            held = None
            if stage.kind == "keyed" and not dry_run:  # the instances reach it during the check
                held = _Held(co, co.rescaler.new_epoch(stage, code=cbk.CODE_HELD), stage.code_version)
            try:
                report = self._check_and_switch(
                    stage,
                    new,
                    blob,
                    ticket,
                    held,
                    generation,
                    timeout,
                    dry_run=dry_run,
                    drop_orphaned=drop_orphaned,
                    source=source or _source_of(function),
                )
            except BaseException:
                if held is not None:  # the instances at its position go on with the old code
                    held.release()
                raise
            if not dry_run:
                report["elapsed_ms"] = (report.pop("done_at") - t0) / 1e6
                report["checkpoint"] = co.checkpointer.trigger()["id"] if co.checkpointer else None
                self.reports.append({**report, "at": time.time()})
            return report

    def _check_and_switch(
        self,
        stage,
        new,
        blob: bytes,
        ticket,
        held,
        generation: int,
        timeout,
        *,
        dry_run,
        drop_orphaned,
        source,
    ) -> dict:
        """The check's answer, then (unless ``dry_run``) the switch to ``new``; the report."""
        co = self.co
        early = not dry_run and not drop_orphaned  # the version file is written during the check
        entry = self.history.write(new, blob, source) if early else None
        try:
            checked = self._checked(stage, ticket, held)
            if not dry_run and held is None and co.stage_finished(stage.id):
                raise InputEnded(f"operator {stage.name!r} has read all its input: nothing is left to update")
        except BaseException:
            if early:
                self.history.unwrite(new)
            raise
        report = {
            "operator": stage.name,
            "version": new.code_version,  # an undone update's number is not reused
            "states_added": checked["added"],
            "states_orphaned": checked["orphaned"],
        }
        if dry_run:
            return {
                **report,
                "epoch": None,
                "elapsed_ms": 0.0,
                "checkpoint": None,
                "dry_run": True,
                "queued": 0,
            }
        if drop_orphaned:
            new = dataclasses.replace(new, drop_states=tuple(checked["orphaned"]))
            blob = _pickled(new, stage.name)
            entry = self.history.write(new, blob, source)
        self.history.record(new, entry)
        old_blob = co.stage_blob(stage.id)
        self._run(new, blob)
        try:
            if held is not None and not held.decided:
                held.decide(new.code_version)
                epoch, done_at, queued = self._await_keyed(new, held.placed, generation, timeout)
            elif stage.kind == "keyed":
                epoch, done_at, queued = self._switch_keyed(new, generation, timeout)
            else:
                epoch, done_at, queued = self._switch_source(new, generation, timeout)
        except InputEnded:  # nothing left to read where the new code could start: undone
            self._run(stage, old_blob)
            raise
        finally:  # off the switch's path: the history, and the spares' parked tasks
            self.history.save_index()
            co.in_job_thread(self.send_code, stage.id, co.stage_blob(stage.id))
        return {**report, "epoch": epoch, "done_at": done_at, "queued": queued, "dry_run": False}

    def _run(self, stage, blob: bytes) -> None:
        """The plan runs ``stage`` (pickled as ``blob``) from now on."""
        self.co.plan.stages[stage.id] = stage
        self.history.current[stage.id] = stage.code_version
        self.co.stage_blobs_changed(stage.id, blob)

    def _switch_keyed(self, stage, generation: int, timeout) -> tuple[int, int, int]:
        """An epoch with the new code version, at the readers' frontier of the operator's gate;
        until every instance has reached it. The records queued behind it when it was placed run
        the new code: their number is the report's ``queued``, as a rescale's."""
        placed = self.co.rescaler.new_epoch(stage, code=stage.code_version)
        return self._await_keyed(stage, placed, generation, timeout)

    def _await_keyed(self, stage, placed: Placed, generation: int, timeout) -> tuple[int, int, int]:
        """Until every instance runs ``stage``'s code from ``placed``'s position."""
        cb = self.co.control
        op, epoch, instances = placed.op, placed.epoch, placed.instances
        self._await(
            stage,
            lambda: cb.wait_epochs(op, instances, stage.code_version, 0.05, word=cbk.I_CODE),
            generation,
            timeout,
        )
        done_at = max(int(cb.instances(op)[i, cbk.I_CODE_AT_NS]) for i in instances)
        return epoch, done_at, placed.queued

    def _switch_source(self, stage, generation: int, timeout) -> tuple[None, int, None]:
        """A source's chained step: the source task switches between two items when it sees the
        version asked for; until it says it did. What the source had not read then is in its
        input, not in a gate of the job: not counted (None)."""
        cb = self.co.control
        cb.signal(cb.stage_word(stage.id, cbk.S_CODE), stage.code_version)
        done = cb.stage_word(stage.id, cbk.S_CODE_DONE)

        def switched() -> bool:
            seen = cb.signals()
            if cb.load(done) >= stage.code_version:
                return True
            cb.wait_signal(seen, 0.05)
            return False

        self._await(stage, switched, generation, timeout)
        return None, time.monotonic_ns(), None

    def _await(self, stage, switched, generation: int, timeout) -> None:
        in_effect = f"is in effect (version {stage.code_version})"
        self.co.rescaler.await_(f"update of {stage.name!r}", in_effect, switched, generation, timeout)

    def _start_check(self, stage, blob: bytes) -> tuple[int, queue.Queue]:
        """Have a spare worker run ``code_update.check`` of the new code; ``_checked`` awaits it."""
        co = self.co
        cid = next(self._ids)
        ticket = self._checks[cid] = queue.Queue()
        # from this thread, between two events of the job thread: waking that one takes a while
        failed = co.loop.place(self.dispatch_check, cid, co.stage_blob(stage.id), blob)
        if failed is not None:
            self._checks.pop(cid, None)
            raise failed
        return cid, ticket

    def _checked(self, stage, check: tuple[int, queue.Queue], held: _Held | None = None) -> dict:
        """The spare worker's answer; a refused update raises. A ``held`` epoch is released if the
        answer takes longer than ``HOLD_S``."""
        co, (cid, ticket) = self.co, check
        now = time.monotonic()
        deadline, hold_until = now + 60, now + HOLD_S
        while True:
            try:
                answer = ticket.get(timeout=0.1 if held is None else max(hold_until - time.monotonic(), 0))
                break
            except queue.Empty:
                if held is not None and time.monotonic() >= hold_until:
                    held.release()
                    held = None
                    continue
                if co.stopping or co.status is not JobStatus.RUNNING or time.monotonic() > deadline:
                    self._checks.pop(cid, None)
                    raise RuntimeError(
                        f"the update of {stage.name!r} was not checked: no worker answered"
                    ) from None
        if not answer["ok"]:
            raise UpdateRefused(
                answer["error"] if answer.get("refused") else f"the check failed: {answer['error']}"
            )
        return answer

    # ---- in the job thread, or between two of its events ---------------------------------------
    def dispatch_check(self, cid: int, old: bytes, new: bytes) -> None:
        """Hand a check to an idle worker, or to the next one that starts."""
        idle = self.co.idle_workers()
        if not idle:
            self._waiting.append((cid, old, new))
            self.co.spawn_worker()
            return
        w = idle[0]
        w.task = ("check", cid)
        w.conn.send({"op": "check_update", "id": cid, "old": old, "new": new}, fmt=ord("P"))

    def worker_ready(self, w) -> None:
        """A worker started and was given nothing to run: a waiting check may have it."""
        if w.task is None and self._waiting:
            self.dispatch_check(*self._waiting.pop(0))

    def answered(self, answer: dict) -> None:
        """A worker's answer to a check, for the update that waits for it (in the thread that read
        it)."""
        self._checks.pop(answer["id"], queue.Queue()).put(answer)

    def checked(self, w) -> None:
        """A worker answered its check: it is free again."""
        w.task = None

    def worker_died(self, w) -> bool:
        """True if ``w`` was checking new code (its death is a refused update, not a failure)."""
        if w.task is None or w.task[0] != "check":
            return False
        answer = {"ok": False, "error": f"the worker checking the new code (pid {w.pid}) died"}
        self._checks.pop(w.task[1], queue.Queue()).put(answer)
        return True

    def workers_gone(self) -> None:
        """A recovery killed every worker: the checks they had are answered."""
        for ticket in self._checks.values():
            ticket.put({"ok": False, "error": "the job is recovering from a failure; retry the update"})
        self._checks.clear()
        self._waiting.clear()

    def send_code(self, stage_id: int, blob: bytes) -> None:
        """Idle workers re-park the stage's task with its new code."""
        for w in self.co.live_workers():
            with contextlib.suppress(OSError):
                w.conn.send({"op": "code", "stage": stage_id, "blob": blob}, fmt=ord("P"))


def _pickled(stage, operator: str) -> bytes:
    """The stage as workers get it; code that does not pickle is refused, not a failure, naming the
    function and what it captures as a job's start does (``plan.shipping``)."""
    try:
        return pickled_stage(stage)
    except UnpicklableFunction as e:
        raise UpdateRefused(f"the new code of {operator!r} is refused: {e}") from e
    except Exception as e:
        raise UpdateRefused(f"the new code of {operator!r} does not pickle: {type(e).__name__}: {e}") from e


def _source_of(function) -> str:
    """How a version's history names where its code came from."""
    if isinstance(function, str):
        return function
    kind = function if isinstance(function, type) else type(function)
    return f"{kind.__module__}:{kind.__qualname__}"
