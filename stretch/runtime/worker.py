"""A worker process: connects to its job, runs the tasks it is assigned, reports how they ended."""

from __future__ import annotations

import contextlib
import importlib
import os
import queue
import socket
import threading
import time
import traceback

import cloudpickle
import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet

from stretch.common.batch_decoding import from_batch
from stretch.common.records import to_batch
from stretch.errors import UpdateRefused
from stretch.runtime import control_socket as cs
from stretch.runtime.code_update import check
from stretch.runtime.gate import GateClosed
from stretch.runtime.keyed_instance import KeyedInstanceTask
from stretch.runtime.outputs import StepError, exception_text
from stretch.runtime.source_task import SourceTask
from stretch.runtime.task import Assignment, Stopped, Task, _Attached
from stretch.runtime.user_metrics import REPORT_PERIOD, snapshot
from stretch.state.key_groups import warm_up as warm_key_groups
from stretch.state.keyed_table import KeyedTable
from stretch.state.warm import warm_fused_kernels, warm_table_kernels, warm_timer_kernels


def warm_up(preload: list[str] = (), kernels: bool = True) -> None:
    """Import and compile (or load from numba's cache) everything a task needs, ahead of time, and
    the ``preload`` modules (the function libraries the API builds jobs from).

    Runs in the zygote, so every forked worker starts with all of it in memory.
    """
    for module in preload:
        importlib.import_module(module)
    if not kernels:
        return
    warm_key_groups()
    warm_table_kernels()
    warm_fused_kernels()
    warm_timer_kernels()
    batch = to_batch([("a", 1, 1.5, True, None)])
    from_batch(batch.filter(pa.array([True])).take(pa.array([0])))
    pa.array([1, None]).fill_null(0).is_valid()


def failure_report(e: BaseException) -> dict:
    """What the coordinator needs to raise a clear error in the user's process."""
    report = {
        "type": type(e).__name__,
        "module": type(e).__module__,
        "message": exception_text(e),
        "traceback": "".join(traceback.format_exception(e)),
    }
    if isinstance(e, StepError):
        report["user_traceback"] = e.user_traceback
        report["cause_type"] = type(e.cause).__name__
        cause = e.cause
    else:
        cause = e
    try:
        report["exception"] = cloudpickle.dumps(cause)
    except Exception:
        report["exception"] = None
    return report


def _park(attached, stages: dict, stage_id: int, should_stop):
    """A keyed operator's task, built ahead of time with its own copy of the user functions."""
    stage = cloudpickle.loads(stages[stage_id])
    return make_task(Assignment(attached.resources, stage), attached, should_stop).build()


def _check_update(attached, msg) -> dict:
    """A spare worker's check of a live update (``runtime.code_update.check``)."""
    answer = {"op": "update_checked", "id": msg["id"]}
    try:
        try:
            new = cloudpickle.loads(msg["new"])
        except Exception as e:
            raise UpdateRefused(f"the new code does not unpickle in a worker: {type(e).__name__}: {e}") from e
        arena = attached.resources.arenas.get(new.id)  # a source stage's steps have no keyed state
        table = KeyedTable(attached.arena(arena)) if arena is not None else None
        return {**answer, "ok": True, **check(cloudpickle.loads(msg["old"]), new, table)}
    except Exception as e:
        return {**answer, "ok": False, "error": exception_text(e), "refused": isinstance(e, UpdateRefused)}


def _send_metrics(task, tag: dict, reply) -> None:
    rows = snapshot(task.metrics)
    if rows:
        with contextlib.suppress(ConnectionError, OSError):  # the job is gone: the worker ends with it
            reply({"op": "user_metrics", **tag, "metrics": rows})


def _report_metrics(running: dict, busy: threading.Event, reply) -> None:
    """Every ``REPORT_PERIOD`` while a task runs: its user metrics, if it has any. A spare's
    reporter sleeps until its worker is given a task, rather than wake every period for nothing
    (on a small machine, each wake-up takes a core from a busy instance for a moment)."""
    while True:
        busy.wait()
        time.sleep(REPORT_PERIOD)
        now = running.get("now")
        if now is not None:
            _send_metrics(*now, reply)


def main(sock_path: str, token: str, worker_id: int) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sock_path)
    cs.send(sock, {"op": "hello", "worker": worker_id, "pid": os.getpid(), "token": token})
    inbox: queue.Queue = queue.Queue()
    stop = threading.Event()
    prepared = threading.Event()  # set once attached: checks are answered by the inbox's thread
    attached = None
    send_lock = threading.Lock()

    def reply(obj, fmt=cs.JSON) -> None:
        with send_lock:
            cs.send(sock, obj, fmt)

    def receive() -> None:
        try:
            while True:
                msg = cs.recv(sock, trusted=True)  # the peer is the job's own coordinator
                op = msg.get("op")
                if op == "stop":
                    stop.set()
                if op == "check_update" and prepared.is_set():  # at once: a live update waits for it
                    reply(_check_update(attached, msg), cs.PICKLE)
                    continue
                inbox.put(msg)
        except (ConnectionError, OSError):
            stop.set()
            inbox.put({"op": "exit"})

    threading.Thread(target=receive, name="stretch-inbox", daemon=True).start()
    running: dict = {}  # the task that runs now and its tag, for the metrics reporter
    busy = threading.Event()  # set while a task runs
    threading.Thread(
        target=_report_metrics, args=(running, busy, reply), name="stretch-user-metrics", daemon=True
    ).start()
    stages: dict = {}
    parked: dict = {}
    while True:
        try:
            msg = inbox.get(timeout=1.0)
        except queue.Empty:
            if attached is not None:
                attached.populate()  # idle spare: stay warm as the state grows
            continue
        op = msg.get("op")
        if op == "exit":
            break
        if op == "prepare":
            attached = _Attached(msg["resources"])
            attached.attach_all()
            stages = msg["stages"]  # pickled per stage: each task unpickles its own functions
            parked = {
                sid: _park(attached, stages, sid, stop.is_set) for sid in attached.resources.keyed_index
            }
            prepared.set()
            continue
        if op == "code":  # a live update: later tasks of this operator run the new version
            stages[msg["stage"]] = msg["blob"]
            if msg["stage"] in attached.resources.keyed_index:  # a source's chained step: none parked
                parked[msg["stage"]] = _park(attached, stages, msg["stage"], stop.is_set)
            continue
        if op == "check_update":
            reply(_check_update(attached, msg), cs.PICKLE)
            continue
        if op != "run":
            continue
        stop.clear()
        tag = {"worker": worker_id, "stage": msg["stage"], "index": msg["index"]}
        try:
            task = parked.pop(msg["stage"], None)
            if task is None:
                stage = cloudpickle.loads(stages[msg["stage"]])
                task = make_task(Assignment(attached.resources, stage), attached, stop.is_set)
            task.a.index, task.a.epoch = msg["index"], msg["epoch"]
            task.a.position = msg.get("position", 0)
            task.a.start = msg.get("start", 0)
            task.a.code = msg.get("code", 0)
            running["now"] = (task, tag)
            busy.set()
            try:
                task.run()
            finally:
                busy.clear()
                running.clear()
            reply({"op": "done", "retired": getattr(task, "retired", False), **tag})
            if msg["stage"] in attached.resources.keyed_index:  # park a fresh one for the next rescale
                parked[msg["stage"]] = _park(attached, stages, msg["stage"], stop.is_set)
        except (Stopped, GateClosed):
            reply({"op": "stopped", **tag})
        except BaseException as e:  # report every failure; the coordinator decides
            reply({"op": "failed", **tag, "error": failure_report(e)}, cs.PICKLE)
    sock.close()
    return 0


def make_task(assignment: Assignment, attached: _Attached, should_stop) -> Task:
    if assignment.stage.kind == "source":
        return SourceTask(assignment, attached, should_stop)
    return KeyedInstanceTask(assignment, attached, should_stop)
