"""Handles on submitted jobs: JobClient, JobExecutionResult, and the collect iterator."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import pyarrow as pa

from stretch.common.batch_decoding import from_batch
from stretch.common.job_status import JobStatus
from stretch.errors import JobCancellationError, JobEnded
from stretch.runtime import termination
from stretch.runtime.coordinator import Coordinator
from stretch.runtime.gate import GateClosed, Kind
from stretch.state.key_groups import key_group
from stretch.state.keyed_table import KeyedTable
from stretch.state.queryable import read_state
from stretch.ui.config import UIConfig


class CompletableFuture(Future):
    """PyFlink's future: ``result()``, ``done()``, ``exception()``."""

    @classmethod
    def completed(cls, value) -> CompletableFuture:
        f = cls()
        f.set_result(value)
        return f


@dataclass(frozen=True)
class RescaleReport:
    """What a live rescale did: it ended when every instance ran under the new epoch."""

    operator: str
    epoch: int
    old_parallelism: int
    new_parallelism: int
    elapsed_ms: float
    state_bytes_copied: int  # always 0: ownership moved, the state did not
    queued: int = 0  # records queued behind the position it applied from: not waited for, they run under it

    def __str__(self) -> str:
        return (
            f"rescaled {self.operator!r} {self.old_parallelism} -> {self.new_parallelism} in {self.elapsed_ms:.2f} ms "
            f"(epoch {self.epoch}, {self.state_bytes_copied} state bytes copied, {self.queued} records queued behind it)"
        )


@dataclass(frozen=True)
class UpdateReport:
    """What a live code update did: it ended when every instance ran the new version."""

    operator: str
    version: int  # the operator's code version now running (0: the script's)
    epoch: int | None  # the ownership epoch it ran under (None for a dry run)
    elapsed_ms: float  # from the request until every instance ran the new code
    states_added: list  # states the new code declares that the operator did not have
    states_orphaned: list  # states the old code declared and the new one does not
    checkpoint: int | None  # the checkpoint that made it durable, in a checkpointed job
    dry_run: bool = False
    # records queued behind the position it applied from, which run the new code (not waited for);
    # None for a step chained after a source, which switches between two of the source's reads
    queued: int | None = 0

    def __str__(self) -> str:
        if self.dry_run:
            return f"update of {self.operator!r} to version {self.version} would be accepted"
        queued = "" if self.queued is None else f" ({self.queued:,} queued records run the new code)"
        return f"updated {self.operator!r} to version {self.version} in {self.elapsed_ms:.2f} ms{queued}"


class JobExecutionResult:
    """What ``execute()`` returns once the job finished."""

    def __init__(self, job_id: str, net_runtime_ms: int):
        self._job_id = job_id
        self._net_runtime = net_runtime_ms

    def get_job_id(self) -> str:
        return self._job_id

    def get_net_runtime(self) -> int:
        return self._net_runtime

    def get_accumulator_result(self, accumulator_name: str):
        return None

    def get_all_accumulator_results(self) -> dict:
        return {}

    def __str__(self) -> str:
        return f"JobExecutionResult{{jobId={self._job_id}, netRuntime={self._net_runtime} ms}}"


class JobClient:
    """A running (or finished) job: its id and status, cancel, wait."""

    def __init__(self, coordinator: Coordinator):
        self._coordinator = coordinator
        self._thread = threading.Thread(
            target=self._run, name=f"stretch-job-{coordinator.job_id[:8]}", daemon=True
        )
        self._ui = None  # the job's web UI (execute_async(..., ui=...)), served while it runs

    def _run(self) -> None:
        try:
            self._coordinator.run()
        finally:
            if self._ui is not None:
                self._ui.stop()

    def _serve_ui(self, config: UIConfig) -> None:
        """Serve the job's page from this process (before the job starts: its info names it)."""
        from stretch.ui.server import UIServer
        from stretch.ui.sources import ProcessJob

        self._ui = UIServer([ProcessJob(self.get_job_id(), self.control)], config).start()
        self._coordinator.info_extra["ui"] = self._ui.address

    @property
    def ui_url(self) -> str | None:
        """The job's web UI with its secret (open it to watch and rescale the job), while the job
        runs; None without ``ui=``."""
        return self._ui.url if self._ui is not None else None

    def _start(self) -> JobClient:
        termination.register(self._coordinator)
        self._thread.start()
        self._coordinator.wait_started()
        if self._coordinator.done and self._coordinator.error is not None:
            raise self._coordinator.error
        return self

    def get_job_id(self) -> str:
        return self._coordinator.job_id
        """The job's id (a hex string; ``stretch jobs`` lists it)."""

    @property
    def name(self) -> str:
        """The job's name (``execute_async(job_name)``)."""
        return self._coordinator.job_name

    def control(self, request: dict) -> dict:
        """Answer one control request (what ``stretch.jobs`` sends to jobs of other processes over
        their socket), in this process, also after the job ended."""
        return self._coordinator.requests.handle(request)

    def get_job_status(self) -> CompletableFuture:
        """The job's current ``JobStatus``, as a completed future (as PyFlink returns it)."""
        return CompletableFuture.completed(self._coordinator.status)

    def cancel(self) -> CompletableFuture:
        """Stop the job now; returns once everything it started has ended."""
        self._coordinator.cancel()
        self._thread.join()
        return CompletableFuture.completed(None)

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Block until the job ends (or the timeout passes); raises the job's error if it failed."""
        self._thread.join(timeout)
        c = self._coordinator
        if c.done and c.status is JobStatus.FAILED and c.error is not None:
            raise c.error
        return c.status

    def rescale(self, operator_name: str, parallelism: int, timeout: float | None = None) -> RescaleReport:
        """Change a keyed operator's parallelism while the job runs, moving no state.

        Returns once every instance runs under the new ownership table, which applies from the
        readers' frontier of the operator's input: records queued behind it (``queued`` in the
        report) run under the new parallelism, so a rescale takes about as long as the instances
        are apart (a few milliseconds), however much input waits. Instances that gain no key group
        never pause. ``timeout`` (seconds; None: as long as the job runs) bounds the wait with a
        ``TimeoutError``, and the new parallelism is in effect all the same. Rescales of one
        operator are serialized. A job that ended raises ``JobEnded``; an operator that has read
        all its input raises ``InputEnded`` (nothing is left to rescale).
        """
        return RescaleReport(**self._coordinator.rescale(operator_name, parallelism, timeout))

    def update(
        self,
        operator: str,
        new_function,
        *,
        output_type=None,
        dry_run: bool = False,
        drop_orphaned: bool = False,
        timeout: float | None = None,
    ) -> UpdateReport:
        """Swap an operator's function (or a chained step's) while the job runs, keeping its state.

        ``new_function`` is of the kind the operator runs: a KeyedProcessFunction, a Map/FlatMap/
        Filter/Reduce/AggregateFunction, a (Process)WindowFunction, a Join/ProcessJoinFunction, a
        co-function, or (built-in rolling aggregates) ``"sum"``/``"min"``/``"max"``; a chained
        map/flat_map/filter/process step is named by its own ``.name(...)``. A spare worker
        first checks that it unpickles and opens against the operator's state and that every state
        it keeps keeps its kind and type; a refused update raises ``UpdateRefused`` and changes
        nothing. Then every instance switches at one record of the operator's input: ``close()`` of
        the old function, ``open()`` of the new; timers the old code set fire into the new code.
        States the new code no longer declares are kept (reported as orphaned) unless
        ``drop_orphaned``. ``dry_run`` only checks.
        """
        report = self._coordinator.update(
            operator,
            new_function,
            output_type=output_type,
            dry_run=dry_run,
            drop_orphaned=drop_orphaned,
            timeout=timeout,
        )
        return UpdateReport(**report)

    def code_history(self) -> dict:
        """Each keyed operator's code versions: version, when, where from, a digest of the code."""
        return self._coordinator.updater.history.describe()

    def trigger_checkpoint(self) -> dict:
        """Take a checkpoint now (the job must have checkpointing enabled); returns its report
        (id, duration_ms, bytes) once it is complete."""
        return self._coordinator.trigger_checkpoint()

    def describe(self) -> dict:
        """Operators, parallelism, epoch, gate depth and per-instance counters (as `stretch status`)."""
        return self._coordinator.describe()

    def query_state(self, operator: str, key=None, key_groups=None) -> pa.Table:
        """Keyed state of a running operator as a table (key, then one column per state).

        Reads shared memory directly, without stopping or slowing the job. ``key`` narrows the
        result to one key; ``key_groups`` to some key groups.
        """
        c = self._coordinator
        stage = c.plan.stage(operator)
        if c.done:
            raise JobEnded(
                f"job {c.job_name!r} has ended and its state with it: a checkpointed job's state stays "
                "readable from its latest checkpoint (stretch.state.read_checkpoint)"
            )
        if stage.kind != "keyed" or stage.id not in c.arenas:
            raise ValueError(f"operator {operator!r} has no keyed state (or the job is not running)")
        table = KeyedTable(c.arenas[stage.id])
        if key is not None:
            kg = key_group(key, stage.max_parallelism)
            rows = read_state(table, [kg])
            return rows.filter(pa.array([k == key for k in rows.column("key").to_pylist()], pa.bool_()))
        return read_state(table, key_groups)

    def get_job_execution_result(self) -> CompletableFuture:
        """A future of the ``JobExecutionResult``, completed when the job finishes."""
        f = CompletableFuture()

        def complete() -> None:
            try:
                self.wait()
                c = self._coordinator
                if c.status is JobStatus.CANCELED:
                    raise JobCancellationError(f"job {c.job_name!r} ({c.job_id}) was cancelled")
                f.set_result(
                    JobExecutionResult(c.job_id, int(((c.finished_at or time.time()) - c.started_at) * 1000))
                )
            except BaseException as e:
                f.set_exception(e)

        threading.Thread(target=complete, daemon=True).start()
        return f


class CloseableIterator:
    """The results of ``execute_and_collect()``; iterate, and close (or use ``with``) when done."""

    def __init__(self, client: JobClient, sink_id: int):
        self._client = client
        self._coordinator = client._coordinator
        self._sink = sink_id
        self._gate = self._coordinator.sink_gates[sink_id]
        self._seq = 0
        self._buffer: list = []
        self._pos = 0
        self._finished = False

    def __iter__(self):
        return self

    def __next__(self):
        while self._pos >= len(self._buffer):
            if self._finished:
                raise StopIteration("No more data.")
            self._fill()
        item = self._buffer[self._pos]
        self._pos += 1
        return item

    def next(self):
        return self.__next__()

    def _fill(self) -> None:
        c = self._coordinator
        served = c.collected.get(self._sink)
        if served is not None:  # a checkpointed job serves it: only committed results arrive
            batch = served.queue.get()
            if batch is None:
                self._end()
            else:
                self._buffer, self._pos = from_batch(batch), 0
            return
        try:
            while not self._gate.wait(self._seq, timeout=0.2):
                if c.done:
                    self._end()
                    return
            entry = self._gate.read(self._seq)
            if entry.kind is Kind.DATA:
                self._buffer = from_batch(entry.batch)
                self._pos = 0
            self._seq += 1
            self._gate.advance(0, self._seq)
            if entry.kind is Kind.END_OF_STREAM:
                c.sink_finished(self._sink)
                self._end()
        except GateClosed:
            self._end()
        except ValueError:  # the job ended meanwhile and released the gate: say how it ended
            if not (c.stopping or c.done):
                raise
            self._end()

    def _end(self) -> None:
        self._finished = True
        self._buffer, self._pos = [], 0
        self._client.wait()  # raises the job's error, if any

    def close(self) -> None:
        if not self._coordinator.done:
            self._client.cancel()
        self._finished = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
