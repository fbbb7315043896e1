"""Requests from outside the job (the CLI, channel writers and readers, Spark): each is answered
in the thread of the connection that asked, never in the job's event loop.

So a request can fail but the job never fails because of one: a malformed request gets an error
reply, a client that vanishes or never reads its answer costs only its own thread, and requests
are answered concurrently. Long operations (a rescale under a backlog, a checkpoint, a publish
that waits for room in a channel) send a progress frame every second until their answer, so a
client knows the job is still at it.
"""

from __future__ import annotations

import importlib
import os
import runpy
import threading
import time
from pathlib import Path

from stretch.common.job_status import JobStatus
from stretch.errors import JobEnded, UnknownOperator, UpdateRefused
from stretch.runtime.control_socket import Connection
from stretch.runtime.metrics import render

PROGRESS_INTERVAL = 1.0  # seconds between progress frames of a long operation
_ENDING = (JobStatus.CANCELLING, JobStatus.FAILING)


class ControlRequests:
    def __init__(self, job):
        self.job = job  # the Coordinator

    def answer(self, conn: Connection, msg) -> None:
        """Answer one request on its connection; a client gone is no error."""
        conn.reply(self.handle(msg, conn))

    def handle(self, msg, conn: Connection | None = None) -> dict:
        """The reply to one request; every failure is an error reply (``type`` names its kind)."""
        try:
            if not isinstance(msg, dict):
                raise ValueError(f"a request must be a JSON object, got {type(msg).__name__}")
            op = msg.get("op")
            handler = _HANDLERS.get(op) if isinstance(op, str) else None
            if handler is None:
                raise ValueError(f"unknown request {op!r}")
            return handler(self, conn, msg)
        except Exception as e:
            return {"ok": False, "error": _message(e), "type": _kind(e)}

    # ---- quick requests ---------------------------------------------------------------------
    def _status(self, conn, msg) -> dict:
        return self.job.describe()

    def _metrics(self, conn, msg) -> dict:
        return {"ok": True, "text": render(self.job)}

    def _state(self, conn, msg) -> dict:
        return self.job.state_location(msg.get("operator"))

    def _timeline(self, conn, msg) -> dict:
        """When recent transactions were published into the input channels and results appended
        to the output channels (this host's monotonic clock): for latency plots."""
        channels = self.job.channels
        appended = {n: list(o.writer.appended_at) for n, o in channels.outputs.items() if o.writer}
        return {"ok": True, "published": list(channels.publisher.published_at), "appended": appended}

    def _channel(self, conn, msg) -> dict:
        return self.job.channels.request(msg["op"], msg)

    # ---- long operations --------------------------------------------------------------------
    def _scale(self, conn, msg) -> dict:
        operator, parallelism = msg.get("operator"), msg.get("parallelism")
        if not isinstance(operator, str):
            raise ValueError(f"operator must be a string, got {operator!r}")
        return {
            "ok": True,
            **_with_progress(conn, lambda: self.job.rescale(operator, parallelism, timeout=None)),
        }

    def _barrier(self, conn, msg) -> dict:
        operator = msg.get("operator")
        if not isinstance(operator, str):
            raise ValueError(f"operator must be a string, got {operator!r}")
        return {"ok": True, **_with_progress(conn, lambda: self.job.barrier(operator))}

    def _update(self, conn, msg) -> dict:
        """A live code update from the CLI: the function is named ``module:Name`` (importable in
        the job's process) or ``path/to/file.py:Name``; a class is instantiated without arguments."""
        operator, target = msg.get("operator"), msg.get("function")
        if not isinstance(operator, str) or not isinstance(target, str):
            raise ValueError("an update needs an operator name and a function as module:Name")
        function = resolve_function(target)
        options = {k: bool(msg.get(k)) for k in ("dry_run", "drop_orphaned")}
        return {
            "ok": True,
            **_with_progress(conn, lambda: self.job.update(operator, function, source=target, **options)),
        }

    def _cancel(self, conn, msg) -> dict:
        """Cancel the job (``JobClient.cancel``); answered once it stopped processing, with how it
        ended (a job that ended first says so). Its process lets go of the job's resources after
        this answer, with the control socket; the CLI waits for that (``stretch cancel``)."""
        job = self.job
        if job.stopping or job.status.is_globally_terminal_state() or job.status in _ENDING:
            raise JobEnded(f"{job.ended_as()}: there is nothing to cancel")
        t0 = time.monotonic()

        def cancel() -> dict:
            job.cancel()
            while not (job.status.is_globally_terminal_state() or job.done):
                time.sleep(0.005)
            elapsed = (time.monotonic() - t0) * 1000
            return {"ok": True, "status": job.status.name, "how": job.ended_as(), "elapsed_ms": elapsed}

        return _with_progress(conn, cancel)

    def _checkpoint(self, conn, msg) -> dict:
        return {"ok": True, **_with_progress(conn, self.job.trigger_checkpoint)}

    def _stage(self, conn, msg) -> dict:
        _checked_txn(msg)
        return _with_progress(conn, lambda: self.job.channels.publish_txn(msg))

    def _publish(self, conn, msg) -> dict:
        files = msg.get("files")
        if not (isinstance(files, list) and all(isinstance(f, str) for f in files)):
            raise ValueError("files must be a list of staged file paths")
        if msg["op"] == "channel_publish" and not (
            isinstance(msg.get("name"), str)
            and isinstance(msg.get("query"), str)
            and type(msg.get("batch")) is int
        ):
            raise ValueError("a publish needs a channel name, a query name and an int batch id")
        return _with_progress(conn, lambda: self.job.channels.publish(msg["op"], msg))


def resolve_function(target: str):
    """``module:Name`` or ``file.py:Name`` -> the object (an instance, if Name is a class)."""
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise ValueError(f"name the new function as module:Name or path/to/file.py:Name, got {target!r}")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise LookupError(f"no file {where!r} (a path is read in the job's directory {os.getcwd()})")
        namespace = runpy.run_path(str(path), run_name=f"stretch_update_{path.stem}")
    else:
        try:
            namespace = vars(importlib.import_module(where))
        except ImportError as e:
            raise LookupError(f"module {where!r} does not import in the job's process: {e}") from None
    if name not in namespace:
        raise LookupError(f"{where!r} has no {name!r}")
    found = namespace[name]
    if not isinstance(found, type):
        return found
    try:
        return found()
    except TypeError as e:
        raise TypeError(
            f"{target} is a class whose constructor needs arguments ({e}): name an instance of it, "
            "or a subclass that passes them"
        ) from None


def _checked_txn(msg: dict) -> None:
    if not (
        isinstance(msg.get("name"), str)
        and isinstance(msg.get("output"), str)
        and isinstance(msg.get("query"), str)
        and type(msg.get("batch")) is int
        and type(msg.get("partition")) is int
        and isinstance(msg.get("files"), list)
        and all(isinstance(f, str) for f in msg["files"])
    ):
        raise ValueError(
            "a stage transaction needs channel names, a query, int batch and partition ids and files"
        )


_HANDLERS = {
    "status": ControlRequests._status,
    "metrics": ControlRequests._metrics,
    "state": ControlRequests._state,
    "timeline": ControlRequests._timeline,
    "channel": ControlRequests._channel,
    "channel_end": ControlRequests._channel,
    "channel_shape": ControlRequests._channel,
    "scale": ControlRequests._scale,
    "barrier": ControlRequests._barrier,
    "checkpoint": ControlRequests._checkpoint,
    "cancel": ControlRequests._cancel,
    "update": ControlRequests._update,
    "channel_publish": ControlRequests._publish,
    "channel_discard": ControlRequests._publish,
    "stage_txn": ControlRequests._stage,
}


def _with_progress(conn: Connection | None, operation):
    """Run ``operation`` while telling the client, every second, that it is still under way."""
    if conn is None:  # asked in the job's own process
        return operation()
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = operation()
        except BaseException as e:
            result["error"] = e

    worker = threading.Thread(target=run, name="stretch-request", daemon=True)
    t0 = time.monotonic()
    worker.start()
    while True:
        worker.join(PROGRESS_INTERVAL)
        if not worker.is_alive():
            break
        conn.reply({"progress": True, "elapsed_ms": round((time.monotonic() - t0) * 1000)})
    if "error" in result:
        raise result["error"]
    return result["value"]


def _kind(e: BaseException) -> str:
    """The exception a client raises for this refusal."""
    for kind in (UpdateRefused, UnknownOperator, JobEnded):
        if isinstance(e, kind):
            return kind.__name__
    for kind in (TimeoutError, LookupError, TypeError, ValueError):
        if isinstance(e, kind):
            return kind.__name__
    return "RuntimeError"


def _message(e: BaseException) -> str:
    """An exception as the client reads it; one whose ``str`` fails still says what it was."""
    try:
        text = str(e.args[0]) if isinstance(e, (KeyError, ValueError, RuntimeError)) and e.args else str(e)
    except Exception:
        text = "<no message>"
    return text if isinstance(e, (ValueError, RuntimeError, LookupError)) else f"{type(e).__name__}: {text}"
