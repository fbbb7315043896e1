"""Where the UI's jobs come from: this user's jobs on this machine (their control sockets), one
job of this process, or a cluster's nodes (``stretch.cluster.ui_source``). Each source answers
the same three questions, so the page draws them alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from stretch.runtime.control_socket import request, running_jobs

STATUS_TIMEOUT = 2.0  # seconds: a job that does not answer a status by then is shown as silent
CHANGE_TIMEOUT = 600.0  # a rescale waits while the job works through a backlog


class JobSource(Protocol):
    is_cluster: bool  # a cluster's source also answers ``cluster()``: its nodes and key-group map

    def statuses(self) -> dict[str, dict]:
        """Job key -> its status (``stretch status --json``'s), plus ``where`` it runs."""

    def rescale(self, key: str, operator: str, parallelism: int) -> dict:
        """A live rescale of one job's operator; its report (raises what the job refused)."""

    def close(self) -> None:
        """Let go of what the source holds (connections), when the UI stops."""


class Refused(Exception):
    """A change the job refused, with its reason (shown to the user as it is)."""


def _checked(reply: dict) -> dict:
    if not reply.get("ok"):
        raise Refused(reply.get("error", "refused"))
    return reply


class LocalJobs:
    """This user's running jobs on this machine, each asked over its control socket."""

    is_cluster = False

    def __init__(self):
        self._sockets: dict[str, str] = {}

    def statuses(self) -> dict[str, dict]:
        found = {}
        for info in running_jobs():
            self._sockets[info["job_id"]] = info["socket"]
            try:
                status = request(info["socket"], {"op": "status"}, STATUS_TIMEOUT)
            except (OSError, ValueError):
                continue  # ended between listing and asking
            if status.get("ok"):
                found[info["job_id"]] = {**status, "where": "this machine", "pid": info["pid"]}
        return found

    def rescale(self, key: str, operator: str, parallelism: int) -> dict:
        if key not in self._sockets:
            raise LookupError(f"no running job {key!r} on this machine")
        msg = {"op": "scale", "operator": operator, "parallelism": parallelism}
        try:
            return _checked(request(self._sockets[key], msg, CHANGE_TIMEOUT))
        except (ConnectionError, FileNotFoundError) as e:
            raise LookupError(f"job {key!r} is not running any more") from e

    def close(self) -> None:
        pass


class ProcessJob:
    """One job of this process (``execute_async(..., ui=True)``), asked directly."""

    is_cluster = False

    def __init__(self, job_id: str, control: Callable[[dict], dict]):
        self.job_id, self._control = job_id, control

    def statuses(self) -> dict[str, dict]:
        status = self._control({"op": "status"})
        return {self.job_id: {**status, "where": "this process"}} if status.get("ok") else {}

    def rescale(self, key: str, operator: str, parallelism: int) -> dict:
        if key != self.job_id:
            raise LookupError(f"this page serves job {self.job_id}, not {key!r}")
        return _checked(self._control({"op": "scale", "operator": operator, "parallelism": parallelism}))

    def close(self) -> None:
        pass
