"""A worker process: connects to its job, runs the tasks it is assigned, reports how they ended."""

from __future__ import annotations

import os
import queue
import socket
import threading
import traceback

import cloudpickle

from stretch.runtime import control_socket as cs
from stretch.runtime.chain import StepError
from stretch.runtime.gate import GateClosed
from stretch.runtime.tasks import Stopped, _Attached, make_task


def warm_up() -> None:
    """Import and compile (or load from numba's cache) everything a task needs, ahead of time.

    Runs in the zygote, so every forked worker starts with all of it in memory.
    """
    import pyarrow as pa
    import pyarrow.compute
    import pyarrow.parquet

    import stretch.datastream.connectors
    import stretch.datastream.keyed_functions  # noqa: F401
    from stretch.common.records import from_batch, to_batch
    from stretch.state import _hash_kernels
    from stretch.state.warm import warm_fused_kernels, warm_table_kernels

    _hash_kernels.warm_up()
    warm_table_kernels()
    warm_fused_kernels()
    batch = to_batch([("a", 1, 1.5, True, None)])
    from_batch(batch.filter(pa.array([True])).take(pa.array([0])))
    pa.array([1, None]).fill_null(0).is_valid()


def failure_report(e: BaseException) -> dict:
    """What the coordinator needs to raise a clear error in the user's process."""
    report = {
        "type": type(e).__name__,
        "module": type(e).__module__,
        "message": str(e),
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


def main(sock_path: str, token: str, worker_id: int) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sock_path)
    cs.send(sock, {"op": "hello", "worker": worker_id, "pid": os.getpid(), "token": token})
    inbox: queue.Queue = queue.Queue()
    stop = threading.Event()
    send_lock = threading.Lock()

    def reply(obj, fmt=cs.JSON) -> None:
        with send_lock:
            cs.send(sock, obj, fmt)

    def receive() -> None:
        try:
            while True:
                msg = cs.recv(sock, trusted=True)  # the peer is the job's own coordinator
                if msg.get("op") == "stop":
                    stop.set()
                inbox.put(msg)
        except (ConnectionError, OSError):
            stop.set()
            inbox.put({"op": "exit"})

    threading.Thread(target=receive, name="stretch-inbox", daemon=True).start()
    attached = None
    while True:
        msg = inbox.get()
        op = msg.get("op")
        if op == "exit":
            break
        if op != "run":
            continue
        stop.clear()
        assignment = msg["assignment"]
        tag = {"worker": worker_id, "stage": assignment.stage.id, "index": assignment.index}
        try:
            if attached is None:
                attached = _Attached(assignment.resources)
            task = make_task(assignment, attached, stop.is_set)
            task.run()
            reply({"op": "done", "retired": getattr(task, "retired", False), **tag})
        except (Stopped, GateClosed):
            reply({"op": "stopped", **tag})
        except BaseException as e:  # report every failure; the coordinator decides
            reply({"op": "failed", **tag, "error": failure_report(e)}, cs.PICKLE)
    sock.close()
    return 0
