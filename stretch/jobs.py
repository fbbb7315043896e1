"""Find a stretch job on this machine and talk to it: the one public way to a running job.

>>> job = jobs.find("clicks")            # a job name, a job id (or a unique prefix), or a JobClient
>>> job.status()["operators"]            # what `stretch status` shows
>>> job.rescale("per-user windows", 4)   # what `stretch scale` does
>>> job.cancel()                         # what `stretch cancel` does

Every job listens on an owner-only control socket in this user's runtime directory; ``find``
looks there, and a name that matches several running jobs is refused (give more of the id). A
``JobClient`` of this process is asked directly, also after its job ended. A job that ended in a
process that still runs is not found but known: ``find`` raises ``JobNotRunning`` (a
``JobNotFound`` and a ``JobEnded``) saying how it ended, with its final status. The CLI, the
channel clients and the Spark connector all come through here.
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stretch.errors import JobEnded, UnknownOperator, UpdateRefused
from stretch.runtime.control_socket import local_jobs, request

if TYPE_CHECKING:
    import pyarrow as pa

    from stretch.datastream.job_client import JobClient

# The command line comes through here for every request to a job: what it needs (the control
# socket, JSON) imports in milliseconds. The DataStream API (a JobClient), pyarrow and the state
# store are imported only by the functions that use them.


class JobNotFound(LookupError):
    """No running job of that name or id on this machine."""


class AmbiguousJob(LookupError):
    """A name or id prefix that matches several running jobs."""


class JobGone(ConnectionError):
    """The job ended (or its process died) while it was being asked."""


@dataclass(frozen=True)
class JobInfo:
    """What a job says about itself in the runtime directory."""

    job_id: str
    name: str
    pid: int
    started: float
    socket: str | None = None  # its control socket (None once it ended)
    operators: list[str] = field(default_factory=list)
    metrics: str | None = None  # the Prometheus endpoint, if the job serves one
    ui: str | None = None  # the job's web page (execute_async(..., ui=...)), without its secret
    ended: str | None = None  # FINISHED, CANCELED or FAILED once it ended (its process still runs)
    how: str | None = None  # how it ended, as its errors say it: "job 'clicks' has finished"
    ended_at: float | None = None

    @classmethod
    def of(cls, info: dict) -> JobInfo:
        return cls(**{k: info[k] for k in cls.__dataclass_fields__ if k in info})


class JobNotRunning(JobNotFound, JobEnded):
    """The job ended (finished, failed, was cancelled) in a process that still runs: ``info.how``
    says how, ``status`` is its status at its end (``Job.status()``'s, or None)."""

    def __init__(self, info: JobInfo, status: dict | None):
        super().__init__(info.how or f"job {info.name!r} has ended")
        self.info, self.status = info, status


def list_jobs(ended: bool = False) -> list[JobInfo]:
    """This user's running jobs on this machine (what dead jobs left behind is removed); with
    ``ended``, also those that ended in a process that still runs (their ``ended`` is set)."""
    return [JobInfo.of(info) for info in local_jobs() if ended or not info.get("ended")]


def find(job: str | JobClient) -> Job:
    """The job given by a JobClient, a job id (or a unique prefix of one) or a job name."""
    if isinstance(job, Job):
        return job
    job_client = sys.modules.get("stretch.datastream.job_client")  # not imported: job is no JobClient
    if job_client is not None and isinstance(job, job_client.JobClient):
        return Job(job.get_job_id(), job.name, local=job.control)
    if not isinstance(job, str) or not job:
        raise TypeError(f"job must be a JobClient, a job id or a job name, got {job!r}")
    found = local_jobs()
    matches = _matching([JobInfo.of(info) for info in found if not info.get("ended")], job)
    if not matches:  # a job that ended, in a process that still runs: say how
        ended = {info["job_id"]: info for info in found if info.get("ended")}
        matches = _matching([JobInfo.of(info) for info in ended.values()], job)
        named = len(matches) > 1 and all(j.name == job for j in matches)
        if len(matches) == 1 or named:  # a name that several runs had: the latest
            last = max(matches, key=lambda j: j.ended_at or 0.0)
            raise JobNotRunning(last, ended[last.job_id].get("final_status"))
    if not matches:
        raise JobNotFound(f"no running stretch job {job!r} on this machine (see `stretch jobs`)")
    if len(matches) > 1:
        ids = ", ".join(j.job_id[:12] for j in matches)
        raise AmbiguousJob(f"{job!r} matches {len(matches)} running jobs ({ids}): give more of the job id")
    info = matches[0]
    return Job(info.job_id, info.name, socket=info.socket, info=info)


def _matching(found: list[JobInfo], job: str) -> list[JobInfo]:
    """The jobs ``job`` names: by id or name, else by a prefix of the id."""
    return [j for j in found if job in (j.job_id, j.name)] or [j for j in found if j.job_id.startswith(job)]


class Job:
    """A handle on one job: each method is one request, answered by the job."""

    def __init__(
        self,
        job_id: str,
        name: str,
        socket: str | None = None,
        local: Callable[[dict], dict] | None = None,
        info: JobInfo | None = None,
    ):
        self.job_id, self.name, self.socket, self.info = job_id, name, socket, info
        self._local = local

    def __repr__(self) -> str:
        return f"Job({self.name!r}, {self.job_id[:12]})"

    def request(self, msg: dict, timeout: float | None = 30.0, on_progress: Callable | None = None) -> dict:
        """One control request; ``timeout`` bounds the job's silence (long operations report
        progress, each passed to ``on_progress``). Raises JobGone if the job is not there any more."""
        if self._local is not None:
            return self._local(msg)
        try:
            return request(self.socket, msg, timeout, on_progress)
        except (ConnectionError, FileNotFoundError, ConnectionRefusedError) as e:
            raise JobGone(f"job {self.name!r} ({self.job_id[:12]}) is not running any more") from e

    def _ok(self, msg: dict, **kw) -> dict:
        reply = self.request(msg, **kw)
        if not reply.get("ok"):
            kind = _REFUSALS.get(reply.get("type"), RuntimeError)
            raise kind(reply.get("error", "refused"))
        return reply

    def status(self) -> dict:
        """Operators, parallelism, epochs, gate depths, per-instance counters, checkpoints."""
        return self._ok({"op": "status"})

    def metrics(self) -> str:
        """The job's metrics in Prometheus' text format."""
        return self._ok({"op": "metrics"})["text"]

    def rescale(self, operator: str, parallelism: int, on_progress: Callable | None = None) -> dict:
        """A live rescale (see ``JobClient.rescale``); waits while the job works off a backlog."""
        return self._ok(
            {"op": "scale", "operator": operator, "parallelism": parallelism}, on_progress=on_progress
        )

    def update(
        self,
        operator: str,
        function: str,
        dry_run: bool = False,
        drop_orphaned: bool = False,
        on_progress: Callable | None = None,
    ) -> dict:
        """A live code update (see ``JobClient.update``); ``function`` is ``module:Name`` or
        ``file.py:Name``, resolved in the job's process."""
        msg = {"op": "update", "operator": operator, "function": function}
        msg.update(dry_run=dry_run, drop_orphaned=drop_orphaned)
        return self._ok(msg, on_progress=on_progress)

    def cancel(self, on_progress: Callable | None = None) -> dict:
        """Cancel the job (as ``JobClient.cancel``): answered once it stopped processing, with its
        ``status`` (CANCELED, or how it ended if it ended first) and ``how``; its process lets go
        of the job's resources just after. A job that has ended raises ``JobEnded``."""
        return self._ok({"op": "cancel"}, on_progress=on_progress)

    def checkpoint(self, on_progress: Callable | None = None) -> dict:
        """Take a checkpoint now; its report once it is complete."""
        return self._ok({"op": "checkpoint"}, on_progress=on_progress)

    def state_location(self, operator: str) -> dict:
        """Where an operator's keyed state is (``arena``, ``max_parallelism``), for readers in
        other processes (``QueryableState``)."""
        return self._ok({"op": "state", "operator": operator})

    def join_channel(self, name: str, role: str) -> dict:
        """Where a ``writer`` or ``reader`` of channel ``name`` finds it."""
        return self._ok({"op": "channel", "name": name, "role": role})

    def channel_shape(self, name: str, schema: pa.Schema) -> pa.Schema:
        """An untyped input channel's schema: ``schema`` if this is the channel's first, else the
        first one any writer offered."""
        import pyarrow as pa

        offered = base64.b64encode(schema.serialize().to_pybytes()).decode()
        reply = self._ok({"op": "channel_shape", "name": name, "schema": offered})
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(reply["schema"])))

    def end_channel(self, name: str) -> None:
        """The end of input channel ``name``: the job finishes once it has processed it."""
        self._ok({"op": "channel_end", "name": name})

    def publish(self, channel: str, query: str, batch: int, files: list[str]) -> dict:
        """Publish staged Arrow IPC files into ``channel`` once per (query, batch) (Spark's commit)."""
        msg = {"op": "channel_publish", "name": channel, "query": query, "batch": batch, "files": files}
        return self._ok(msg, timeout=600)

    def publish_txn(
        self, channel: str, output: str, query: str, batch: int, partition: int, files: list[str]
    ) -> dict:
        """One stage transaction (``stretch.spark.stage``): publish staged Arrow IPC files into
        ``channel`` once per (query, batch, partition) and wait for the results they cause in
        output channel ``output``: ``log`` (its directory) and ``offsets`` (of the result batches).
        A transaction seen before gets the first attempt's results again."""
        msg = {
            "op": "stage_txn",
            "name": channel,
            "output": output,
            "query": query,
            "batch": batch,
            "partition": partition,
            "files": files,
        }
        return self._ok(msg, timeout=600)

    def discard(self, channel: str, files: list[str]) -> None:
        """Remove staged files of an aborted transaction."""
        self._ok({"op": "channel_discard", "name": channel, "files": files})


class QueryableState:
    """An operator's keyed state, read from shared memory while the job runs, without stopping or
    slowing it: each key group under its seqlock, so every row is a consistent snapshot of its key.
    ``arena`` is where ``Job.state_location`` says the state is (readers in other processes of this
    user, such as Spark's executors, attach it by that name)."""

    def __init__(self, arena: str):
        from stretch.state.arena import Arena
        from stretch.state.keyed_table import KeyedTable

        self._arena = Arena.attach(arena)
        self._table = KeyedTable(self._arena)

    def read(self, key_groups: Iterable[int] | None = None) -> pa.Table:
        """One row per key (key group, key, one column per declared state)."""
        from stretch.state.queryable import read_state

        return read_state(self._table, key_groups)

    def schema(self) -> pa.Schema:
        """The rows' schema, as the first key group with keys has it."""
        from stretch.state.queryable import read_key_group

        table = self._table
        kg = next((kg for kg in range(table.maxp) if table.n_keys(kg)), 0)
        return read_key_group(table, kg).schema

    def close(self) -> None:
        self._arena.close()

    def __enter__(self) -> QueryableState:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_REFUSALS = {
    "UpdateRefused": UpdateRefused,
    "UnknownOperator": UnknownOperator,
    "JobEnded": JobEnded,
    "LookupError": LookupError,
    "ValueError": ValueError,
    "TypeError": TypeError,
    "TimeoutError": TimeoutError,
}
