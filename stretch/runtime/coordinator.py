"""The coordinator: one job's control plane on this machine (the node engine's head).

It owns the job's shared-memory segments, its control socket and its workers: it starts the job,
answers for it to other threads (rescales, updates, checkpoints, status) and shuts it down. What its
thread does meanwhile (hand stages to worker processes, move end-of-stream markers from finished
producers into the gates they fed, turn a worker's failure into a clear error in the user's process,
recover from a worker's death) is runtime.job_loop. Data never passes through it: workers read and
write the gates directly.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field

from stretch import _shm as shm
from stretch.common.job_status import JobStatus
from stretch.errors import JobExecutionError, RestoreRefused, job_ended
from stretch.plan.shipping import pickled_stage
from stretch.plan.stages import JobPlan
from stretch.runtime import job_info
from stretch.runtime.channels import JobChannels
from stretch.runtime.checkpointing import Checkpointer, CheckpointSettings, CheckpointStore
from stretch.runtime.control_block import ControlBlock
from stretch.runtime.control_socket import ControlServer, running_jobs, runtime_dir
from stretch.runtime.dataplane import build_dataplane
from stretch.runtime.elastic_controller import ElasticController, ElasticityConfig
from stretch.runtime.gate import Gate
from stretch.runtime.input_logger import salvage_dead_runs
from stretch.runtime.job_loop import JobLoop
from stretch.runtime.metrics import serve
from stretch.runtime.requests import ControlRequests
from stretch.runtime.rescaler import Rescaler
from stretch.runtime.resources import JobResources
from stretch.runtime.sink_runner import SinkRunner
from stretch.runtime.state_dir import JobDir
from stretch.runtime.status import InstanceRates, describe_job
from stretch.runtime.updater import Updater
from stretch.runtime.worker_pool import Worker, WorkerPool
from stretch.state.arena import Arena


@dataclass
class EngineConfig:
    """Sizes of the node engine's structures; defaults suit a laptop-sized machine."""

    gate_slots: int = 64
    gate_bytes: int | None = None  # None: 32 MiB, less on a small /dev/shm (gate.default_data_bytes)
    sink_gate_bytes: int | None = None
    channel_retention_bytes: int = 1 << 30  # an output channel's log keeps at most this much
    metrics: tuple[str, int] | None = None  # (host, port) of the Prometheus endpoint, if any
    spare_workers: int = 4  # warm, idle workers kept for rescales (replenished after each)
    checkpointing: bool = False  # barriers, snapshots and transactional sinks (enable_checkpointing)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    restore: bool = False  # start from the job's latest complete checkpoint, if it has one
    restore_code: str = "refuse"  # code updated live since the script: "checkpoint" | "script" | "refuse"
    elasticity: ElasticityConfig | None = None
    shutdown_timeout: float = 10.0
    preload: tuple[str, ...] = ()  # modules every worker imports ahead of time (see runtime.zygote)


class Coordinator:
    """Runs one job: call ``run()`` in a dedicated thread; everything else is thread-safe."""

    def __init__(self, plan: JobPlan, job_name: str, config: EngineConfig | None = None):
        self.plan = plan
        self.config = config or EngineConfig()
        self.exclusive = threading.RLock()  # rescales, checkpoints and recoveries take turns
        self.generation = 0  # bumped by each recovery: waiters of an earlier one give up
        self.checkpointer: Checkpointer | None = None
        self.recoveries: list[dict] = []  # reports of recoveries from worker failures
        self.restored_from: int | None = None  # the checkpoint this run started from
        self.checkpoint_failures = 0  # checkpoints that failed (the job went on)
        self.checkpoint_failures_in_a_row = 0  # since the last complete one
        self.recoveries_in_a_row = 0  # since the last complete checkpoint
        self.last_checkpoint_error: str | None = None
        self.job_name = job_name
        self.job_id = secrets.token_hex(16)
        self.status = JobStatus.CREATED
        self.error: BaseException | None = None
        self.started_at = time.time()
        self.finished_at: float | None = None
        self.output_complete_at: float | None = None  # monotonic: every stage and sink has ended
        self._done = threading.Event()
        self._started = threading.Event()
        self._token = secrets.token_hex(32)
        self._parallelism: dict[int, int] = {}  # stage id -> current parallelism
        self._stopping = False  # set before segments close: waiters must stop touching them
        self.final_status: dict | None = None  # describe() as the job ended, kept after its segments go
        self._segments: list = []
        self.gates: dict[int, Gate] = {}
        self.sink_gates: dict[int, Gate] = {}
        self.arenas: dict[int, Arena] = {}
        self.control: ControlBlock | None = None
        self.resources: JobResources | None = None
        # stage id -> the broadcast state (pickled) a broadcast operator starts from when no
        # checkpoint gives one: a cluster node that joins starts from what the other nodes hold
        self.broadcast_start: dict[int, bytes] = {}
        self._sink_runners: list[SinkRunner] = []
        self.collected: dict = {}  # sink id -> QueueWriter, for execute_and_collect in checkpointed jobs
        self.controller: ElasticController | None = None
        self.rescales: list[dict] = []  # every completed rescale's report, in order
        # the latest user metrics of each instance, {(operator, index): rows} (runtime.user_metrics)
        self.user_metrics: dict[tuple[str, int], list] = {}
        self.job_dir: JobDir | None = None  # held while the job runs, if it keeps logs or checkpoints
        self._dataplane: list = []  # segments rebuilt by a recovery (see _build_dataplane)
        self.prefix: str | None = None  # of the job's shared-memory segments, once it starts
        self._metrics = None  # (server, thread, port) of the Prometheus endpoint
        self.info_extra: dict = {}  # more for the job's info file (``ui``: its web page's address)
        self.rates = InstanceRates()  # the instances' recent rates, for a status that answers at once
        self._server: ControlServer | None = None
        self.socket_path = runtime_dir() / f"{self.job_id}.sock"
        self.info_path = runtime_dir() / f"{self.job_id}.json"
        self.workers = WorkerPool(str(self.socket_path), self._token, self.config.preload)
        self.channels = JobChannels(self, runtime_dir() / "staging" / self.job_id)
        self.requests = ControlRequests(self)
        self.updater = Updater(self)  # live code updates (runtime.updater)
        self.rescaler = Rescaler(self)  # rescales and barriers (runtime.rescaler)
        self.loop = JobLoop(self)  # the job thread's events, and recovery (runtime.job_loop)
        self.stage_blobs: dict[int, bytes] = {}  # pickled stages, as workers get them

    # ---- public, thread-safe ------------------------------------------------------------
    def wait_started(self, timeout: float | None = None) -> bool:
        return self._started.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        self.loop.events.put(("cancel",))

    def sink_finished(self, sink: int, error: BaseException | None = None) -> None:
        self.loop.events.put(("sink_done", sink, error))

    # ---- the job thread -----------------------------------------------------------------
    def run(self) -> None:
        try:
            self._start()
            self.loop.run()
        except BaseException as e:
            if self.error is None:
                self.error = e
            self.status = JobStatus.FAILED
        finally:
            try:
                self._shutdown()
            finally:
                self.finished_at = time.time()
                self._started.set()
                self._done.set()

    def _start(self) -> None:
        salvage_dead_runs()  # what dead runs' channel gates hold unlogged, before the reap
        shm.reap_dead_engines()
        running_jobs()  # and removes what dead jobs left in the runtime directory
        cfg, plan = self.config, self.plan
        self.prefix = shm.engine_prefix()
        restore, store = None, None
        if cfg.checkpointing:
            for stage in plan.stages:
                if getattr(stage.source, "channel_name", None) is not None:
                    if not getattr(stage.source, "durable", False):
                        raise ValueError(
                            f"channel {stage.source.channel_name!r} is not durable, so a checkpointed job "
                            "could not replay it: use ChannelSource(..., durable=True)"
                        )
                    stage.direct = False  # writers append to the channel's gate; the job reads its log
            self.job_dir = JobDir(self.job_name, self.job_id)
            store = CheckpointStore(self.job_dir.path / "checkpoints")
            if cfg.restore:
                restore = self._restorable(store)
        code_dir = (
            self.job_dir.path / "code" if self.job_dir is not None else runtime_dir() / "code" / self.job_id
        )
        self.updater.start(code_dir, self.job_dir is not None, restore, cfg.restore_code)
        self.channels.open_outputs(restore)
        self.channels.open_inputs()
        if restore is not None:
            self.channels.restore_txns(restore)
        if store is not None:
            if restore is None:  # a restore from nothing left to restore starts over too
                outputs = {name: out.run_start for name, out in self.channels.outputs.items()}
                sources = {str(stage): offset for stage, offset in self.channels.log_starts.items()}
                store.begin({"max_parallelism": plan.max_parallelism, "sources": sources, "outputs": outputs})
            self.checkpointer = Checkpointer(self, store, cfg.checkpoint)
        self._build_dataplane(restore)
        if restore is not None:
            self.restored_from = restore["id"]
        self.channels.pin_inputs(self.loop.positions)  # what a recovery would read again
        self.channels.log_direct_inputs(self.gates)
        self.stage_blobs = {s.id: pickled_stage(s) for s in plan.stages}
        self.channels.publisher.create()
        self._server = ControlServer(
            self.socket_path,
            self._token,
            self.loop.on_worker_message,
            self.loop.on_close,
            self.requests.answer,
        )
        if cfg.metrics is not None:
            self._metrics = serve(self, *cfg.metrics)
        self._write_info()
        for _ in range(len(self.loop.pending) + cfg.spare_workers):
            self.spawn_worker()
        for sink in plan.sinks:
            if sink.runs_in == "job" or (sink.runs_in == "reader" and cfg.checkpointing):
                writer = self.channels.writer_for(sink)
                if writer is None and sink.runs_in == "reader":  # execute_and_collect: committed batches only
                    writer = self.collected[sink.id] = sink.sink.create_writer(sink.upstream_parallelism)
                runner = SinkRunner(sink, self.sink_gates[sink.id], self, writer, cfg.checkpointing)
                runner.txns = self.channels.txns_of(sink)
                self._sink_runners.append(runner)
                runner.start()
        self.channels.start()
        self.status = JobStatus.RUNNING
        if cfg.elasticity is not None:
            self.controller = ElasticController(self, cfg.elasticity)
            self.controller.start()
        if self.checkpointer is not None:
            self.checkpointer.start()
        self._started.set()

    def _restorable(self, store: CheckpointStore) -> dict | None:
        """What a restore starts from: the latest complete checkpoint, or the start of the run that
        died before completing one (None: the job never ran, so this run starts afresh)."""
        finished = store.finished_at()
        if finished is not None:
            raise RestoreRefused(
                f"job {self.job_name!r} finished (at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(finished))}): "
                "there is nothing to restore; run it without restore to run it again"
            )
        restore = store.latest()
        if restore is not None and restore["max_parallelism"] != self.plan.max_parallelism:
            raise RestoreRefused(
                f"checkpoint {restore['id']} has max parallelism {restore['max_parallelism']}; "
                f"the job has {self.plan.max_parallelism}: key groups must match to restore"
            )
        return restore

    def _build_dataplane(self, restore: dict | None) -> None:
        """The segments workers use and the tasks to start (runtime.dataplane), anew: a recovery
        builds them afresh and drops the old ones."""
        plane = build_dataplane(self, restore, self._parallelism)
        self._dataplane = plane.segments
        self.control, self.resources = plane.control, plane.resources
        self.gates, self.sink_gates, self.arenas = plane.gates, plane.sink_gates, plane.arenas
        self._parallelism.update(plane.parallelism)
        self.loop.restart(plane.pending, plane.positions)

    def rebuild_dataplane(self, restore: dict) -> None:
        """A recovery's: the dataplane built anew from checkpoint ``restore``, the job's sinks moved
        onto their new gates (dropping what it had not committed), the old segments closed."""
        old = self._dataplane
        try:
            self._build_dataplane(restore)
            for runner in self._sink_runners:
                offset = self.channels.output_offset(runner.spec, restore)
                runner.replace_gate(self.sink_gates[runner.spec.id], offset, self.config.shutdown_timeout)
        finally:
            for seg in old:
                with contextlib.suppress(Exception):
                    seg.close()

    def spawn_worker(self) -> Worker | None:
        return self.workers.spawn()

    def idle_workers(self) -> list[Worker]:
        return self.workers.idle()

    def _info(self) -> dict:
        return {
            "job_id": self.job_id,
            "name": self.job_name,
            "pid": os.getpid(),
            "started": self.started_at,
            "operators": [s.name for s in self.plan.stages if s.kind == "keyed"],
        }

    def _write_info(self) -> None:
        info = {**self._info(), "socket": str(self.socket_path)}
        if self._metrics is not None:
            info["metrics"] = f"http://{self.config.metrics[0]}:{self._metrics[2]}/metrics"
        info.update(self.info_extra)
        job_info.write(self.info_path, info)

    def _keep_ended(self) -> None:
        """The job's info file becomes its ended record (runtime.job_info): while this process
        lives, other processes learn how the job ended, and its final status."""
        if not self.info_path.exists():  # it never started: execute() raised instead
            return
        info = {
            **self._info(),
            "ended": self.status.name,
            "how": self.ended_as(),
            "ended_at": time.time(),
        }
        if self.final_status is not None:
            info["final_status"] = {**self.final_status, "status": self.status.name}
        try:
            job_info.keep_ended(self.info_path, info)
        except (OSError, TypeError, ValueError):  # not JSON, or no room: the job is gone all the same
            with contextlib.suppress(FileNotFoundError):
                self.info_path.unlink()

    # ---- checkpoints (see runtime.checkpointing) ------------------------------------------
    def trigger_checkpoint(self) -> dict:
        if self.checkpointer is None:
            raise RuntimeError("checkpointing is off for this job: call env.enable_checkpointing() first")
        return self.checkpointer.trigger()

    def checkpoint_completed(self, metadata: dict) -> None:
        """Input logs may now let go of what comes before the checkpoint's offsets."""
        self.checkpoint_failures_in_a_row = self.recoveries_in_a_row = 0
        self.channels.pin_inputs(metadata["sources"])

    def accepting_checkpoints(self) -> bool:
        return self.status is JobStatus.RUNNING and not self._stopping

    def parallelism_of(self, stage_id: int) -> int:
        return self._parallelism[stage_id]

    def stage_finished(self, stage_id: int) -> bool:
        return self.loop.stage_finished(stage_id)

    def instance_done(self, stage_id: int, index: int) -> None:
        """In the job thread: instance ``index`` of the stage ended (see ``JobLoop.instance_done``)."""
        self.loop.instance_done(stage_id, index)

    @property
    def sink_runners(self) -> list[SinkRunner]:
        return self._sink_runners

    def checkpoint_failed(self, error: BaseException) -> None:
        """Counted; beyond the tolerable number in a row (if one is set) the job fails."""
        self.checkpoint_failures += 1
        self.checkpoint_failures_in_a_row += 1
        self.last_checkpoint_error = f"{type(error).__name__}: {error}"
        tolerable = self.config.checkpoint.tolerable_failures
        if tolerable is not None and self.checkpoint_failures_in_a_row > tolerable:
            failure = JobExecutionError(
                f"{self.checkpoint_failures_in_a_row} checkpoints in a row failed (tolerable: {tolerable}); "
                f"the last: {self.last_checkpoint_error}"
            )
            failure.__cause__ = error
            self.loop.events.put(("fail", failure))

    def stop_everything(self) -> None:
        self._close_gates()
        for w in self.workers.live():
            with contextlib.suppress(OSError):
                w.conn.send({"op": "stop"})

    def _close_gates(self) -> None:
        """Close every gate, saying how the job ended: writers in other processes that still hold
        a channel's gate learn it at their next write instead of writing into the void."""
        reason = (
            self.ended_as() if self.status is not JobStatus.RUNNING else f"job {self.job_name!r} has finished"
        )
        for g in (*self.gates.values(), *self.sink_gates.values()):
            g.close(reason)
        self.channels.close_gates(reason)

    # ---- rescale (runtime.rescaler) ---------------------------------------------------------
    def rescale(self, operator: str, parallelism: int, timeout: float | None = None) -> dict:
        """Change an operator's parallelism live; returns once every instance runs the new epoch.

        The new epoch applies from the readers' frontier of the operator's gate, so it takes
        effect within about the time its instances are apart, however much input is queued;
        ``timeout`` (None: as long as the job runs) bounds the wait, after which the new epoch
        still takes effect. Thread-safe; rescales of one operator are serialized, of different
        operators independent. A rescale to the current parallelism publishes nothing.
        """
        return self.rescaler.rescale(operator, parallelism, timeout)

    def release(self, operator: str, key_groups, timeout: float | None = None, hold: bool = False):
        """Stop processing ``key_groups`` from the readers' frontier (see ``Rescaler.release``)."""
        return self.rescaler.release(operator, key_groups, timeout, hold)

    def release_rest(self, operator: str, key_groups) -> list:
        """The records of ``key_groups`` appended since their held release (``Rescaler.rest``)."""
        return self.rescaler.rest(operator, key_groups)

    def own(self, operator: str, key_groups) -> int:
        """Process released ``key_groups`` again (see ``Rescaler.own``)."""
        return self.rescaler.own(operator, key_groups)

    def barrier(self, operator: str, timeout: float | None = None) -> dict:
        """Return once every instance of ``operator`` has processed everything its gate held when
        this was called: an epoch at the gate's tail, with the current ownership (a node hands key
        groups away behind it)."""
        return self.rescaler.barrier(operator, timeout)

    def set_parallelism(
        self, stage_id: int, parallelism: int, added: list[tuple[int, int, int, int]]
    ) -> None:
        """In the job thread: the operator runs ``parallelism`` instances from now on; ``added``
        (index, start epoch, code version, gate position) are the instances to start."""
        self._parallelism[stage_id] = parallelism
        self.loop.start_tasks([(stage_id, *task) for task in added])

    def replenish(self) -> None:
        """Refill the warm pool (after a rescale took workers from it)."""
        self.loop.events.put(("replenish",))

    def ended_as(self) -> str:
        """How the job ended or is ending, as its errors say it: "job 'x' has finished"."""
        if self.status in (JobStatus.FAILED, JobStatus.FAILING):
            error = self.error
            try:  # its first line: a user function's error goes on with the worker's traceback
                detail = (
                    f": {type(error).__name__}: {str(error).splitlines()[0]}" if error is not None else ""
                )
            except Exception:  # an exception whose str fails still tells its type
                detail = f": {type(error).__name__}"
            return f"job {self.job_name!r} failed{detail}"
        if self.status in (JobStatus.CANCELED, JobStatus.CANCELLING):
            return f"job {self.job_name!r} was cancelled"
        if self.status is JobStatus.FINISHED:
            return f"job {self.job_name!r} has finished"
        return f"job {self.job_name!r} is {self.status.name.lower()}"

    def refuse_if_ended(self, what: str) -> None:
        """Raise, saying how, unless the job runs: ``JobEnded`` if it ended (or is ending)."""
        if self.status is JobStatus.RESTARTING:
            raise RuntimeError(
                f"job {self.job_name!r} is recovering from a failure; it is {what} once it runs"
            )
        if self.status is not JobStatus.RUNNING or self._stopping:
            raise job_ended(self.ended_as(), what)

    # ---- live code update (runtime.updater) ---------------------------------------------------
    def update(self, operator: str, function, **options) -> dict:
        """Swap a keyed operator's function (or a chained step's) live: checked in a spare worker,
        then switched at one record, so every record before it runs the old code and every record
        after it the new. Returns once the new code runs everywhere (and, in a checkpointed job, a
        checkpoint has recorded it). Updates, rescales and checkpoints take turns."""
        return self.updater.update(operator, function, **options)

    def stage_blob(self, stage_id: int) -> bytes:
        return self.stage_blobs[stage_id]

    def stage_blobs_changed(self, stage_id: int | None = None, blob: bytes | None = None) -> None:
        """The plan's stage (None: every stage) has new code (pickled as ``blob``, if given):
        workers that start tasks get it (a task started with older code loads the version it is
        told to run)."""
        ids = [s.id for s in self.plan.stages] if stage_id is None else [stage_id]
        for sid in ids:
            self.stage_blobs[sid] = blob if blob is not None else pickled_stage(self.plan.stages[sid])

    def in_job_thread(self, fn, *args) -> None:
        """Run ``fn(*args)`` in the job's thread, in order with its events."""
        self.loop.events.put(("call", fn, args))

    @property
    def stopping(self) -> bool:
        return self._stopping

    def live_workers(self) -> list[Worker]:
        return self.workers.live()

    def state_location(self, operator) -> dict:
        """Where another process reads an operator's keyed state (queryable state)."""
        stage = next((s for s in self.plan.stages if s.name == operator), None)
        if stage is None or stage.id not in self.arenas:
            keyed = ", ".join(s.name for s in self.plan.stages if s.id in self.arenas) or "none"
            return {
                "ok": False,
                "error": f"job has no keyed operator {operator!r} (keyed operators: {keyed})",
                "type": "UnknownOperator",
            }
        return {"ok": True, "arena": self.arenas[stage.id].name, "max_parallelism": stage.max_parallelism}

    # ---- channels (see runtime.channels) ------------------------------------------------------
    def add_segment(self, segment) -> None:
        """A segment the job keeps for its whole run (channel gates and tails)."""
        self._segments.append(segment)

    def end_channel(self, name: str) -> None:
        """A writer ended input channel ``name``; handled in the job thread, in order with the rest."""
        done = threading.Event()
        self.loop.events.put(("end_channel", name, done))
        while not done.wait(0.05):
            if self._stopping or self.status in (JobStatus.FAILING, JobStatus.CANCELLING) or self.done:
                raise RuntimeError(
                    f"job {self.job_name!r} is {self.status.name}: channel {name!r} was not ended"
                )

    # ---- status -----------------------------------------------------------------------------
    def describe(self) -> dict:
        """The job's operators and counters; after the job ended, their values at its end."""
        return describe_job(self)

    # ---- shutdown ------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        self._stopping = True
        if self.controller is not None:
            self.controller.stop.set()
        if self.checkpointer is not None:
            self.checkpointer.stop.set()
        if self.status is not JobStatus.FINISHED:
            self.stop_everything()
        self.workers.stop(self.config.shutdown_timeout)
        if self._server is not None:
            self._server.close()
        if self._metrics is not None:
            self._metrics[0].shutdown()
            self._metrics[0].server_close()
        for r in self._sink_runners:
            r.join(self.config.shutdown_timeout)
        self.channels.stop_loggers(self.config.shutdown_timeout)
        self._close_gates()  # a finished job's too: a write after the end is refused, not lost
        if self.controller is not None:
            self.controller.join(self.config.shutdown_timeout)
        if self.checkpointer is not None:
            self.checkpointer.join(self.config.shutdown_timeout)
        deadline = time.monotonic() + self.config.shutdown_timeout
        while self.rescaler.busy and time.monotonic() < deadline:  # rescale waiters read the control block
            time.sleep(0.01)
        with contextlib.suppress(Exception):
            self.final_status = describe_job(self, live=True)
        self.channels.close(finished=self.status is JobStatus.FINISHED)
        if self.checkpointer is not None:
            store = self.checkpointer.store
            if self.status is JobStatus.FINISHED:
                store.finish()
            elif self.status is JobStatus.CANCELED and self.config.checkpoint.delete_on_cancel:
                shutil.rmtree(store.dir, ignore_errors=True)
            else:
                store.discard_incomplete()
        if self.job_dir is not None:
            self.job_dir.release()
        for seg in (*self._segments, *self._dataplane):
            with contextlib.suppress(Exception):
                seg.close()
        if self.prefix is not None:  # also what a start that failed halfway had made
            shm.unlink_prefix(self.prefix)
        self._keep_ended()
        self.updater.close()
