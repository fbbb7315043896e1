"""The coordinator: one job's control plane on this machine (the node engine's head).

It owns the job's shared-memory segments, its control socket and its zygote; it hands stages to
worker processes, moves end-of-stream markers from finished producers into the gates they fed, and
turns a worker's failure into a clear error in the user's process. Data never passes through it:
workers read and write the gates directly.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import secrets
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field

import cloudpickle

from stretch.common.job_status import JobStatus
from stretch.datastream.connectors.channel import ChannelLogWriter, ChannelSink
from stretch.errors import JobExecutionError, UserFunctionError
from stretch.plan.stages import JobPlan, SinkSpec
from stretch.runtime import control_block as cbk
from stretch import _shm as shm
from stretch.runtime.channel_log import ChannelLog, LogTail
from stretch.runtime.checkpointing import Checkpointer, CheckpointSettings, CheckpointStore
from stretch.runtime.control_block import ControlBlock
from stretch.runtime.control_socket import ControlServer, running_jobs, runtime_dir
from stretch.runtime.elastic_controller import ElasticController, ElasticityConfig
from stretch.runtime.event_time import MAX_WATERMARK, producer_id
from stretch.runtime.gate import Gate, Kind
from stretch.runtime.input_logger import InputLogger
from stretch.runtime.publisher import ChannelPublisher
from stretch.runtime.resources import JobResources
from stretch.runtime.sink_runner import SinkRunner
from stretch.runtime.state_dir import JobDir
from stretch.runtime.zygote import Zygote
from stretch.state.arena import Arena
from stretch.state.key_groups import assignment as range_assignment
from stretch.state.snapshot import prepare_arena, restore_key_groups


@dataclass
class EngineConfig:
    """Sizes of the node engine's structures; defaults suit a laptop-sized machine."""

    gate_slots: int = 64
    gate_bytes: int = 32 << 20
    sink_gate_bytes: int = 32 << 20
    channel_retention_bytes: int = 1 << 30  # an output channel's log keeps at most this much
    metrics: tuple[str, int] | None = None  # (host, port) of the Prometheus endpoint, if any
    spare_workers: int = 4  # warm, idle workers kept for rescales (replenished after each)
    checkpointing: bool = False  # barriers, snapshots and transactional sinks (enable_checkpointing)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    restore: bool = False  # start from the job's latest complete checkpoint, if it has one
    dead_letter_channel: str | None = None  # the dead-letter policy: rejected records go here
    elasticity: ElasticityConfig | None = None
    shutdown_timeout: float = 10.0


@dataclass
class _OutputChannel:
    log: ChannelLog
    tail: LogTail
    run_start: int  # the log's end when this run began: where this run's output starts
    type_info: object = None  # of its records, where the job declares it
    writer: ChannelLogWriter | None = None  # the job's side, once it runs


@dataclass
class _Worker:
    id: int
    pid: int | None = None
    conn: object = None
    task: tuple[int, int] | None = None  # (stage id, instance index)
    exited: bool = False


@dataclass
class _StageState:
    running: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    finished: bool = False


class Coordinator:
    """Runs one job: call ``run()`` in a dedicated thread; everything else is thread-safe."""

    def __init__(self, plan: JobPlan, job_name: str, config: EngineConfig | None = None):
        self.plan = plan
        self.config = config or EngineConfig()
        self.dead_letter_sink: int | None = None
        if self.config.dead_letter_channel is not None:  # a sink that every stage may write to
            self.dead_letter_sink = len(plan.sinks)
            plan.sinks.append(
                SinkSpec(
                    self.dead_letter_sink,
                    "dead letters",
                    ChannelSink(self.config.dead_letter_channel),
                    [s.id for s in plan.stages],
                )
            )
        self.exclusive = threading.RLock()  # rescales, checkpoints and recoveries take turns
        self.generation = 0  # bumped by each recovery: waiters of an earlier one give up
        self.checkpointer: Checkpointer | None = None
        self.recoveries: list[dict] = []  # reports of recoveries from worker failures
        self.restored_from: int | None = None  # the checkpoint this run started from
        self.checkpoint_failures = 0  # checkpoints that failed (the job went on)
        self.checkpoint_failures_in_a_row = 0  # since the last complete one
        self.recoveries_in_a_row = 0  # since the last complete checkpoint
        self.last_checkpoint_error: str | None = None
        self._positions: dict[int, int] = {}  # source stage id -> position to restart at
        self._log_starts: dict[int, int] = {}  # channel source stage -> its log's end as the run began
        self._channel_logs: dict[str, tuple[str, str]] = {}  # input channel -> (log directory, tail)
        self._input_logs: dict[int, ChannelLog] = {}  # channel source stage -> the log it reads
        self._worker_ids = itertools.count()
        self.job_name = job_name
        self.job_id = secrets.token_hex(16)
        self.status = JobStatus.CREATED
        self.error: BaseException | None = None
        self.started_at = time.time()
        self.finished_at: float | None = None
        self.output_complete_at: float | None = None  # monotonic: every stage and sink has ended
        self._events: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._started = threading.Event()
        self._token = secrets.token_hex(32)
        self._workers: dict[int, _Worker] = {}
        self._pending: list[tuple[int, int, int]] = []  # (stage id, instance index, start epoch)
        self._stages = {s.id: _StageState() for s in plan.stages}
        self._parallelism: dict[int, int] = {}  # stage id -> current parallelism
        self._rescale_lock = threading.Lock()
        self._stopping = False  # set before segments close: waiters must stop touching them
        self._final: dict | None = None  # describe() as the job ended, kept after its segments go
        self._rescaling: dict[int, threading.Event] = {}  # stage id -> set when its rescale ends
        self._sinks_done: set[int] = set()
        self._finished_gates: set[int] = set()
        self._segments: list = []
        self.gates: dict[int, Gate] = {}
        self.sink_gates: dict[int, Gate] = {}
        self.arenas: dict[int, Arena] = {}
        self.control: ControlBlock | None = None
        self.resources: JobResources | None = None
        self._sink_runners: list[SinkRunner] = []
        self.collected: dict = {}  # sink id -> QueueWriter, for execute_and_collect in checkpointed jobs
        self.controller: ElasticController | None = None
        self.rescales: list[dict] = []  # every completed rescale's report, in order
        self.input_channels: dict[str, Gate] = {}
        self.direct_channels: dict = {}  # channel name -> source stage whose writers feed a gate
        self.output_channels: dict[str, _OutputChannel] = {}
        self.job_dir: JobDir | None = None  # held while the job runs, if it keeps logs or checkpoints
        self._dataplane: list = []  # segments rebuilt by a recovery (see _build_dataplane)
        self._loggers: list[InputLogger] = []
        self._metrics = None  # (server, thread, port) of the Prometheus endpoint
        self._ended_channels: set[str] = set()
        self._server: ControlServer | None = None
        self._zygote: Zygote | None = None
        self.socket_path = runtime_dir() / f"{self.job_id}.sock"
        self.info_path = runtime_dir() / f"{self.job_id}.json"
        self.publisher = ChannelPublisher(
            runtime_dir() / "staging" / self.job_id,
            lambda name: self._channel_request("channel", {"name": name, "role": "writer"}),
        )

    # ---- public, thread-safe ------------------------------------------------------------
    def wait_started(self, timeout: float | None = None) -> bool:
        return self._started.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        self._events.put(("cancel",))

    def sink_finished(self, sink: int, error: BaseException | None = None) -> None:
        self._events.put(("sink_done", sink, error))

    # ---- the job thread -----------------------------------------------------------------
    def run(self) -> None:
        try:
            self._start()
            self._loop()
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
        for sink in plan.sinks:
            if sink.runs_in == "job" and isinstance(sink.sink, ChannelSink):
                if sink.sink.name in self.output_channels:
                    raise ValueError(f"two sinks write to channel {sink.sink.name!r}: give each its own name")
                log = self._channel_log(sink.sink.name, "out")
                # what no checkpoint covers was never readable: a restored run makes it again
                committed = log.readable_end
                log.truncate(restore["outputs"].get(sink.sink.name, committed) if restore else committed)
                tail = LogTail.create(self.prefix, log.end_offset)
                self._segments.append(tail.segment)
                self.output_channels[sink.sink.name] = _OutputChannel(
                    log, tail, log.end_offset, sink.type_info
                )
        for stage in plan.stages:
            name = getattr(stage.source, "channel_name", None)
            durable = getattr(stage.source, "durable", False)
            if name is not None and stage.direct:
                self.direct_channels[name] = stage
            elif name is not None:
                g = Gate.create(self.prefix, "channel", cfg.gate_slots, cfg.gate_bytes)
                if not cfg.checkpointing:  # else the source reads the channel's log, not its gate
                    g.open_reader(0, 0)
                self.input_channels[name] = g
                self._segments.append(g.segment)
                if durable:
                    log = self._channel_log(name, "in")
                    tail = None
                    if cfg.checkpointing:  # its source reads the log: from here, or a checkpoint's offset
                        tail = LogTail.create(self.prefix, log.end_offset)
                        self._segments.append(tail.segment)
                        self._channel_logs[name] = (str(log.dir), tail.name)
                        self._log_starts[stage.id] = log.end_offset
                        self._input_logs[stage.id] = log
                    self._loggers.append(InputLogger(name, g, 1, log, tail=tail))
        if store is not None:
            if restore is None:  # a restore from nothing left to restore starts over too
                outputs = {name: out.run_start for name, out in self.output_channels.items()}
                sources = {str(stage): offset for stage, offset in self._log_starts.items()}
                store.begin({"max_parallelism": plan.max_parallelism, "sources": sources, "outputs": outputs})
            self.checkpointer = Checkpointer(self, store, cfg.checkpoint)
        self._build_dataplane(restore)
        if restore is not None:
            self.restored_from = restore["id"]
        for stage_id, log in self._input_logs.items():  # what a recovery would read again
            log.pinned = self._positions[stage_id]
        for stage in plan.stages:
            name = getattr(stage.source, "channel_name", None)
            if name is not None and stage.direct and getattr(stage.source, "durable", False):
                gate = self.gates[stage.chain[0].gate]
                self._loggers.append(
                    InputLogger(
                        name,
                        gate,
                        gate.max_readers - 1,
                        self._channel_log(name, "in"),
                        producer_id(stage.id, 0),
                    )
                )
        self._stage_blobs = {s.id: cloudpickle.dumps(s) for s in plan.stages}
        self.publisher.create()
        self._server = ControlServer(self.socket_path, self._token, self._on_message, self._on_close)
        if cfg.metrics is not None:
            from stretch.runtime.metrics import serve

            self._metrics = serve(self, *cfg.metrics)
        self._write_info()
        self._zygote = Zygote(str(self.socket_path), self._token)
        for _ in range(len(self._pending) + cfg.spare_workers):
            self._spawn_worker()
        for sink in plan.sinks:
            if sink.runs_in == "job" or (sink.runs_in == "reader" and cfg.checkpointing):
                channel = self.output_channels.get(getattr(sink.sink, "name", None))
                writer = None
                if channel is not None:
                    writer = channel.writer = ChannelLogWriter(channel.log, channel.tail, cfg.checkpointing)
                elif sink.runs_in == "reader":  # execute_and_collect: committed batches only
                    writer = self.collected[sink.id] = sink.sink.create_writer(sink.upstream_parallelism)
                runner = SinkRunner(sink, self.sink_gates[sink.id], self, writer, cfg.checkpointing)
                self._sink_runners.append(runner)
                runner.start()
        for logger in self._loggers:
            logger.start()
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
            raise ValueError(
                f"job {self.job_name!r} finished (at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(finished))}): "
                "there is nothing to restore; run it without restore to run it again"
            )
        restore = store.latest()
        if restore is not None and restore["max_parallelism"] != self.plan.max_parallelism:
            raise ValueError(
                f"checkpoint {restore['id']} has max parallelism {restore['max_parallelism']}; "
                f"the job has {self.plan.max_parallelism}: key groups must match to restore"
            )
        return restore

    def _build_dataplane(self, restore: dict | None) -> None:
        """Create the segments that workers use (control block, gates, sink gates, state arenas)
        and the tasks to start, from a checkpoint's state and positions if ``restore``.

        A recovery builds them anew and drops the old ones: nothing of a failed attempt is reused.
        """
        cfg, plan, prefix = self.config, self.plan, self.prefix
        self._dataplane = []
        keyed = [s for s in plan.stages if s.kind == "keyed"]
        self.control = ControlBlock.create(prefix, len(keyed), plan.max_parallelism)
        self._dataplane.append(self.control)
        res = JobResources(prefix, self.control.segment.name, len(keyed), plan.max_parallelism)
        res.dead_letter_sink = self.dead_letter_sink
        if self.checkpointer is not None:
            res.checkpoints = str(self.checkpointer.store.dir)
        self.gates, self.sink_gates, self.arenas = {}, {}, {}
        for gate_id in plan.gate_producers:
            consumer = next(s for s in plan.stages if s.input_gate == gate_id)
            g = Gate.create(  # a reader slot per instance, and one for an input channel's log
                prefix, "gate", cfg.gate_slots, cfg.gate_bytes, max_readers=consumer.max_parallelism + 1
            )
            self.gates[gate_id] = g
            res.gates[gate_id] = g.name
            self._dataplane.append(g.segment)
        for sink in plan.sinks:
            if sink.runs_in == "instance":
                res.sinks[sink.id] = sink
                continue
            g = Gate.create(prefix, "sink", cfg.gate_slots, cfg.sink_gate_bytes)
            g.open_reader(0, 0)
            self.sink_gates[sink.id] = g
            res.sink_gates[sink.id] = g.name
            self._dataplane.append(g.segment)
        for name, g in self.input_channels.items():
            res.channels[name] = g.name
        self._pending = []
        self._stages = {s.id: _StageState() for s in plan.stages}
        self._finished_gates = set()
        for op_index, stage in enumerate(keyed):
            arena = Arena.create(prefix, stage.max_parallelism)
            self.arenas[stage.id] = arena
            res.arenas[stage.id] = arena.name
            res.keyed_index[stage.id] = op_index
            self._dataplane.append(arena)
            saved = restore["operators"].get(stage.name) if restore is not None else None
            if saved is not None:
                prepare_arena(arena, saved)
                directory = self.checkpointer.store.path(restore["id"])
                for f in saved["files"]:  # every one is there in a complete checkpoint
                    if not (directory / f).exists():
                        raise FileNotFoundError(
                            f"checkpoint {restore['id']} lacks {directory / f}: it is damaged"
                        )
                    restore_key_groups(arena, directory / f)
            p = self._parallelism.get(stage.id, stage.parallelism)
            self.control.publish(op_index, 0, range_assignment(p, stage.max_parallelism))
            gate = self.gates[stage.input_gate]
            for i in range(p):
                gate.open_reader(i, 0)
            self._pending.extend((stage.id, i, 0) for i in range(p))
            self._parallelism[stage.id] = p
        res.channel_logs = dict(self._channel_logs)
        self._positions = dict(self._log_starts)  # channel sources start at the log's end
        if restore is not None:
            self._positions.update({int(k): v for k, v in restore["sources"].items()})
        for stage in plan.stages:
            if stage.kind == "source":
                self._parallelism[stage.id] = 1
                if not stage.direct:
                    self._pending.append((stage.id, 0, 0))
        for gate_id, stage_ids in plan.gate_producers.items():
            res.producers[gate_id] = [
                producer_id(s, i) for s in stage_ids for i in range(self._parallelism.get(s, 1))
            ]
        self.resources = res

    def _spawn_worker(self) -> _Worker:
        wid = next(self._worker_ids)
        w = self._workers[wid] = _Worker(wid)
        w.pid = self._zygote.fork(wid)
        return w

    def _write_info(self) -> None:
        info = {
            "job_id": self.job_id,
            "name": self.job_name,
            "pid": os.getpid(),
            "socket": str(self.socket_path),
            "started": self.started_at,
            "operators": [s.name for s in self.plan.stages if s.kind == "keyed"],
        }
        if self._metrics is not None:
            info["metrics"] = f"http://{self.config.metrics[0]}:{self._metrics[2]}/metrics"
        tmp = self.info_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(self.info_path)

    # ---- events ---------------------------------------------------------------------------
    def _on_message(self, conn, msg) -> None:
        self._events.put(("msg", conn, msg))

    def _on_close(self, conn) -> None:
        self._events.put(("closed", conn))

    def _loop(self) -> None:
        while True:
            if self._finished():
                self.output_complete_at = time.monotonic()
                self.status = JobStatus.FINISHED
                return
            try:
                event = self._events.get(timeout=0.5)
            except queue.Empty:
                continue
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
            elif kind == "rescale":
                try:
                    event[3].put(self._prepare_rescale(event[1], event[2]))
                except BaseException as e:
                    event[3].put(e)
                    raise
            elif kind == "replenish" and self.status is JobStatus.RUNNING:
                self._replenish()
            elif kind == "cancel" and not self.status.is_globally_terminal_state():
                self.status = JobStatus.CANCELLING
                self._stop_everything()
                self.status = JobStatus.CANCELED
                return
            if self.status is JobStatus.FAILING:
                self._stop_everything()
                self.status = JobStatus.FAILED
                return

    def _finished(self) -> bool:
        return all(s.finished for s in self._stages.values()) and len(self._sinks_done) == len(
            self.plan.sinks
        )

    def _handle(self, conn, msg) -> None:
        op = msg.get("op")
        if op == "hello":
            w = self._workers.get(conn.worker)
            if w is None:
                return
            w.conn = conn
            # every worker gets the job once: segments to attach and the stages, so that starting a
            # task (also in a rescale) is a small message to an already warm, attached process
            conn.send(
                {"op": "prepare", "resources": self.resources, "stages": self._stage_blobs}, fmt=ord("P")
            )
            self._assign(w)
        elif op in ("done", "stopped", "failed"):
            w = self._workers.get(conn.worker)
            if w is None:  # a worker of an attempt that a recovery ended
                return
            w.task = None
            if op == "failed":
                self._fail(_job_error(msg["error"], self.plan.stages[msg["stage"]].name))
            elif op == "done" and msg.get("retired"):
                self._stages[msg["stage"]].running.discard(msg["index"])  # its worker rejoins the pool
            elif op == "done":
                self._instance_done(msg["stage"], msg["index"])
            if self.status is JobStatus.RUNNING:
                self._assign(w)
        elif op == "status":
            conn.send(self.describe())
        elif op == "metrics":
            try:
                from stretch.runtime.metrics import render

                conn.send({"ok": True, "text": render(self)})
            except Exception as e:  # e.g. no prometheus-client: an error for the asker, not the job
                conn.send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        elif op == "state":
            conn.send(self._state_request(msg.get("operator")))
        elif op in ("channel", "channel_end"):
            conn.send(self._channel_request(op, msg))
        elif op == "scale":
            threading.Thread(target=self._scale_request, args=(conn, msg), daemon=True).start()
        elif op == "checkpoint":
            threading.Thread(target=self._checkpoint_request, args=(conn,), daemon=True).start()
        elif op in ("channel_publish", "channel_discard"):
            threading.Thread(target=self._publish_request, args=(conn, op, msg), daemon=True).start()
        else:
            conn.send({"ok": False, "error": f"unknown request {op!r}"})

    def _assign(self, w: _Worker) -> None:
        if not self._pending or w.conn is None:
            return
        stage_id, index, epoch = self._pending.pop(0)
        if not self._pending and self.recoveries and "running_at" not in self.recoveries[-1]:
            self.recoveries[-1]["running_at"] = time.time()  # every task of the new attempt is handed out
        w.task = (stage_id, index)
        self._stages[stage_id].running.add(index)
        w.conn.send(
            {
                "op": "run",
                "stage": stage_id,
                "index": index,
                "epoch": epoch,
                "position": self._positions.get(stage_id, 0),
            }
        )

    def _idle_workers(self) -> list[_Worker]:
        return [w for w in self._workers.values() if w.conn is not None and w.task is None and not w.exited]

    def _instance_done(self, stage_id: int, index: int) -> None:
        st = self._stages[stage_id]
        st.running.discard(index)
        st.done.add(index)
        if len(st.done) >= self._parallelism[stage_id] and not st.running and not st.finished:
            st.finished = True
            self._producer_finished(stage_id)

    def _producer_finished(self, stage_id: int) -> None:
        """A stage ended: every gate and sink whose producers have all ended gets end-of-stream."""
        done = {s for s, st in self._stages.items() if st.finished}
        for gate_id, producers in self.plan.gate_producers.items():
            if gate_id not in self._finished_gates and set(producers) <= done:
                self._finished_gates.add(gate_id)
                self.gates[gate_id].append_control(Kind.END_OF_STREAM)
        for sink in self.plan.sinks:
            key = -1 - sink.id
            if key not in self._finished_gates and set(sink.producers) <= done:
                self._finished_gates.add(key)
                if sink.runs_in == "instance":
                    self._sinks_done.add(sink.id)
                else:
                    self.sink_gates[sink.id].append_control(Kind.END_OF_STREAM)

    def _worker_gone(self, conn) -> None:
        w = self._workers.get(conn.worker) if conn.worker is not None else None
        if w is None:
            return
        w.exited = True
        if w.task is not None and self.status is JobStatus.RUNNING:
            stage = self.plan.stages[w.task[0]]
            message = f"worker {w.pid} running operator {stage.name!r} exited unexpectedly"
            limit = self.config.checkpoint.max_recoveries_in_a_row
            if self.checkpointer is None:
                self._fail(JobExecutionError(message))
            elif self.recoveries_in_a_row >= limit:  # it would only die again: a crash loop
                self._fail(
                    JobExecutionError(
                        f"{message}; the job gives up: {limit} recoveries in a row without a completed "
                        "checkpoint in between"
                    )
                )
            else:
                self.recoveries_in_a_row += 1
                self._recover(message)

    # ---- recovery ---------------------------------------------------------------------------
    def _recover(self, reason: str) -> None:
        """A worker died: restart every task from the latest complete checkpoint.

        Every worker is killed and every gate, arena and the control block are built anew; the
        state comes from the checkpoint's key-group files, sources restart at its positions, and
        the sinks drop what they had not committed. Readers of the output thus see each result
        exactly once. Input channel gates and logs, which outside writers use, are kept.
        """
        t0 = time.monotonic()
        self.status = JobStatus.RESTARTING
        self.generation += 1  # a checkpoint or rescale under way gives up and lets go
        while not self.exclusive.acquire(timeout=0.05):
            self._refuse_rescales()
        try:
            workers = [w for w in self._workers.values() if w.pid]
            for w in workers:
                w.exited = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
            self._workers.clear()
            deadline = time.monotonic() + self.config.shutdown_timeout
            while any(_alive(w.pid) for w in workers) and time.monotonic() < deadline:
                time.sleep(0.001)
            old = self._dataplane
            latest = self.checkpointer.store.latest()  # at least the run's start
            try:
                self._build_dataplane(latest)
                for runner in self._sink_runners:
                    name = getattr(runner.spec.sink, "name", None)
                    out = self.output_channels.get(name)
                    offset = None if out is None else latest["outputs"].get(name, out.run_start)
                    runner.replace_gate(self.sink_gates[runner.spec.id], offset, self.config.shutdown_timeout)
            finally:
                for seg in old:
                    with contextlib.suppress(Exception):
                        seg.close()
            for _ in range(len(self._pending) + self.config.spare_workers):
                self._spawn_worker()
            self.status = JobStatus.RUNNING
            self.recoveries.append(
                {
                    "reason": reason,
                    "checkpoint": latest["id"],
                    "elapsed_ms": (time.monotonic() - t0) * 1000,
                    "at": time.time(),
                }
            )
        finally:
            self.exclusive.release()

    def _refuse_rescales(self) -> None:
        """While recovering: answer rescale requests (their callers hold the turn we wait for)."""
        kept = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event[0] == "rescale":
                event[3].put(RuntimeError("the job is recovering from a failure; retry the rescale"))
            else:
                kept.append(event)
        for event in kept:
            self._events.put(event)

    # ---- checkpoints (see runtime.checkpointing) ------------------------------------------
    def trigger_checkpoint(self) -> dict:
        if self.checkpointer is None:
            raise RuntimeError("checkpointing is off for this job: call env.enable_checkpointing() first")
        return self.checkpointer.trigger()

    def checkpoint_completed(self, metadata: dict) -> None:
        """Input logs may now let go of what comes before the checkpoint's offsets."""
        self.checkpoint_failures_in_a_row = self.recoveries_in_a_row = 0
        for stage_id, log in self._input_logs.items():
            log.pinned = metadata["sources"].get(str(stage_id), log.pinned)

    def accepting_checkpoints(self) -> bool:
        return self.status is JobStatus.RUNNING and not self._stopping

    def parallelism_of(self, stage_id: int) -> int:
        return self._parallelism[stage_id]

    def stage_finished(self, stage_id: int) -> bool:
        st = self._stages[stage_id]
        return st.finished or (self.plan.stages[stage_id].kind == "source" and 0 in st.done)

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
            self._events.put(("fail", failure))

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        if not self.status.is_globally_terminal_state():
            self.status = JobStatus.FAILING

    def _stop_everything(self) -> None:
        for g in (*self.gates.values(), *self.sink_gates.values(), *self.input_channels.values()):
            g.close()
        for w in self._workers.values():
            if w.conn is not None and not w.exited:
                with contextlib.suppress(OSError):
                    w.conn.send({"op": "stop"})

    # ---- rescale ----------------------------------------------------------------------------
    def rescale(self, operator: str, parallelism: int, timeout: float = 60.0) -> dict:
        """Change an operator's parallelism live; returns once every instance runs the new epoch.

        Thread-safe; rescales of one operator are serialized, of different operators may overlap.
        """
        t0 = time.monotonic_ns()
        stage = self.plan.stage(operator)
        if stage.kind != "keyed":
            raise ValueError(f"operator {operator!r} is not a keyed operator; only keyed operators rescale")
        if (
            not isinstance(parallelism, int)
            or isinstance(parallelism, bool)
            or not 1 <= parallelism <= stage.max_parallelism
        ):
            raise ValueError(
                f"parallelism must be an int in 1..{stage.max_parallelism} (max parallelism), got {parallelism!r}"
            )
        while True:
            with self._rescale_lock:
                busy = self._rescaling.get(stage.id)
                if busy is None:
                    done = self._rescaling[stage.id] = threading.Event()
                    break
            busy.wait()
        try:
            with self.exclusive:
                return self._rescale(stage, operator, parallelism, timeout, t0)
        finally:
            with self._rescale_lock:
                del self._rescaling[stage.id]
            done.set()

    def _rescale(self, stage, operator: str, parallelism: int, timeout: float, t0: int) -> dict:
        if self.status is not JobStatus.RUNNING:
            raise RuntimeError(f"the job is {self.status.name}; only a running job rescales")
        generation = self.generation
        ticket: queue.Queue = queue.Queue()
        self._events.put(("rescale", stage.id, parallelism, ticket))
        prepared = ticket.get()
        if isinstance(prepared, BaseException):
            raise prepared
        op, epoch, old, instances = prepared
        deadline = time.monotonic() + timeout
        while True:
            if self._stopping or self.generation != generation or time.monotonic() > deadline:
                raise RuntimeError(
                    f"rescale of {operator!r} did not complete (job {self.status.name})"
                ) from self.error
            if self.control.wait_epochs(op, instances, epoch, timeout=0.05, word=cbk.I_ACTIVE):
                break
        # completed when the last instance became active (its own clock reading), not when this
        # thread got to run again: the report times the rescale, not the caller's scheduling
        done_at = max(int(self.control.instances(op)[i, cbk.I_ACTIVE_AT_NS]) for i in instances)
        elapsed = (done_at - t0) / 1e6
        self._events.put(("replenish",))  # refill the warm pool now that the rescale is done
        report = {
            "operator": operator,
            "epoch": epoch,
            "old_parallelism": old,
            "new_parallelism": parallelism,
            "elapsed_ms": elapsed,
            "state_bytes_copied": 0,
        }
        self.rescales.append({**report, "at": time.time()})
        return report

    def _prepare_rescale(self, stage_id: int, parallelism: int):
        """In the job thread: publish the next epoch, place its marker, start added instances."""
        stage = self.plan.stages[stage_id]
        op = self.resources.keyed_index[stage_id]
        if stage.input_gate in self._finished_gates:
            return RuntimeError(f"operator {stage.name!r} has consumed all its input; nothing to rescale")
        old = self._parallelism[stage_id]
        epoch = self.control.epoch(op) + 1
        oldest = min(int(self.control.instances(op)[i, cbk.I_EPOCH]) for i in range(old))
        if epoch - oldest >= cbk.TABLE_RING:
            return RuntimeError("instances are too many epochs behind; retry the rescale later")
        self.control.publish(op, epoch, range_assignment(parallelism, stage.max_parallelism))
        gate = self.gates[stage.input_gate]
        gate.append_control(Kind.EPOCH, epoch, open_readers=tuple(range(old, parallelism)))
        self._parallelism[stage_id] = parallelism
        added = [(stage_id, i, epoch - 1) for i in range(old, parallelism)]
        self._pending[:0] = added
        idle = self._idle_workers()
        for w in idle[: len(added)]:
            self._assign(w)
        for _ in range(len(added) - len(idle)):
            self._spawn_worker()
        return op, epoch, old, list(range(max(old, parallelism)))

    def _replenish(self) -> None:
        """Keep the warm pool at its size (spares are forked from the zygote, ready in milliseconds)."""
        starting = sum(1 for w in self._workers.values() if w.conn is None and not w.exited)
        missing = self.config.spare_workers + len(self._pending) - len(self._idle_workers()) - starting
        for _ in range(max(missing, 0)):
            self._spawn_worker()

    def _scale_request(self, conn, msg) -> None:
        """`stretch scale` from another process, answered over the control socket."""
        try:
            report = self.rescale(str(msg.get("operator")), msg.get("parallelism"))
            conn.send({"ok": True, **report})
        except (KeyError, ValueError, RuntimeError) as e:
            conn.send({"ok": False, "error": str(e.args[0]) if e.args else str(e)})

    def _checkpoint_request(self, conn) -> None:
        """`stretch checkpoint` from another process."""
        try:
            reply = {"ok": True, **self.trigger_checkpoint()}
        except Exception as e:
            reply = {"ok": False, "error": str(e)}
        with contextlib.suppress(Exception):
            conn.send(reply)

    def _channel_log(self, name: str, direction: str) -> ChannelLog:
        """A channel's durable log in the job's directory, continued by this run."""
        if self.job_dir is None:
            self.job_dir = JobDir(self.job_name, self.job_id)
        log = ChannelLog(self.job_dir.channel(name, direction), self.config.channel_retention_bytes)
        log.resume()
        return log

    def _state_request(self, operator) -> dict:
        """Where another process reads an operator's keyed state (queryable state)."""
        try:
            stage = self.plan.stage(operator)
        except KeyError:
            stage = None
        if stage is None or stage.id not in self.arenas:
            keyed = [s.name for s in self.plan.stages if s.id in self.arenas]
            return {
                "ok": False,
                "error": f"job has no keyed operator {operator!r} (keyed operators: {keyed})",
            }
        return {"ok": True, "arena": self.arenas[stage.id].name, "max_parallelism": stage.max_parallelism}

    # ---- channels ---------------------------------------------------------------------------
    def _publish_request(self, conn, op: str, msg: dict) -> None:
        """A staged transaction (Spark's sink commit or abort); may block while the channel is full."""
        try:
            if op == "channel_publish":
                reply = self.publisher.publish(
                    msg["name"], str(msg["query"]), int(msg["batch"]), msg["files"]
                )
            else:
                self.publisher.discard(msg["files"])
                reply = {"ok": True}
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        with contextlib.suppress(Exception):
            conn.send(reply)

    def _channel_request(self, op: str, msg: dict) -> dict:
        name = msg.get("name")
        if op == "channel":
            if name in self.direct_channels and msg.get("role") == "writer":
                stage = self.direct_channels[name]
                step = stage.chain[0]
                t = stage.source.type_info
                return {
                    "ok": True,
                    "segment": self.gates[step.gate].name,
                    "staging": str(self.publisher.staging),
                    "type": t.to_json() if t else None,
                    "key_field": step.key.field,
                    "max_parallelism": step.key.max_parallelism,
                    "producer": producer_id(stage.id, 0),
                }
            if name in self.input_channels and msg.get("role") == "writer":
                source = next(
                    s.source for s in self.plan.stages if getattr(s.source, "channel_name", None) == name
                )
                t = source.type_info
                return {
                    "ok": True,
                    "segment": self.input_channels[name].name,
                    "staging": str(self.publisher.staging),
                    "type": t.to_json() if t else None,
                }
            if name in self.output_channels and msg.get("role") == "reader":
                out = self.output_channels[name]
                return {
                    "ok": True,
                    "log": str(out.log.dir),
                    "tail": out.tail.name,
                    "run_start": out.run_start,
                    "type": out.type_info.to_json() if out.type_info is not None else None,
                }
            inputs, outputs = (
                sorted([*self.input_channels, *self.direct_channels]),
                sorted(self.output_channels),
            )
            return {
                "ok": False,
                "error": f"job has no channel {name!r} to {'write' if msg.get('role') == 'writer' else 'read'} "
                f"(input channels: {inputs}, output channels: {outputs})",
            }
        if op == "channel_end" and name in self.direct_channels:
            stage = self.direct_channels[name]
            if 0 not in self._stages[stage.id].done:
                # the writers' input ended: as a bounded source does, move their watermark to the end
                self.gates[stage.chain[0].gate].append_control(
                    Kind.WATERMARK, producer_id(stage.id, 0), MAX_WATERMARK
                )
                self._instance_done(stage.id, 0)
            return {"ok": True}
        if op == "channel_end" and name in self.input_channels:
            if name not in self._ended_channels:
                self._ended_channels.add(name)
                self.input_channels[name].append_control(Kind.END_OF_STREAM)
            return {"ok": True}
        return {"ok": False, "error": f"unknown channel {name!r}"}

    # ---- status -----------------------------------------------------------------------------
    def describe(self) -> dict:
        """The job's operators and counters; after the job ended, their values at its end."""
        deadline = time.monotonic() + self.config.shutdown_timeout
        while self._final is None:
            generation = self.generation
            try:
                return self._describe_live()
            except ValueError:  # segments released while reading: the job just ended or recovers
                recovering = self.status is JobStatus.RESTARTING or self.generation != generation
                if self._final is None and not (recovering and time.monotonic() < deadline):
                    raise
                time.sleep(0.01)  # a recovery builds them anew: read those
        return {**self._final, "status": self.status.name}

    def _describe_live(self) -> dict:
        ops = []
        for stage in self.plan.stages:
            if stage.kind != "keyed" or self.control is None:
                continue
            op = self.resources.keyed_index[stage.id]
            epoch = self.control.epoch(op)
            owners = self.control.table(op, epoch)
            p = int(owners.max()) + 1
            inst = self.control.instances(op)[:p]
            ops.append(
                {
                    "name": stage.name,
                    "kind": stage.operator.kind,  # process | aggregate | vector_window (vectorized)
                    "parallelism": p,
                    "epoch": epoch,
                    "gate_depth": self.gates[stage.input_gate].depth(),
                    # totals over every instance slot ever used: they never go down on a rescale
                    "records_in": int(self.control.instances(op)[:, cbk.I_RECORDS_IN].sum()),
                    "records_out": int(self.control.instances(op)[:, cbk.I_RECORDS_OUT].sum()),
                    "state_bytes": self.arenas[stage.id].resident_bytes(),
                    "instances": [
                        {
                            "index": i,
                            "records_in": int(inst[i, cbk.I_RECORDS_IN]),
                            "records_out": int(inst[i, cbk.I_RECORDS_OUT]),
                            "busy_ms": int(inst[i, cbk.I_BUSY_NS]) // 1_000_000,
                            "busy_ns": int(inst[i, cbk.I_BUSY_NS]),
                            "epoch": int(inst[i, cbk.I_EPOCH]),
                            "position": int(inst[i, cbk.I_GATE_SEQ]),
                            "max_stall_ns": int(inst[i, cbk.I_MAX_STALL_NS]),
                            "watermark": int(inst[i, cbk.I_WATERMARK]) or None,
                        }
                        for i in range(p)
                    ],
                }
            )
        return {
            "ok": True,
            "job_id": self.job_id,
            "name": self.job_name,
            "status": self.status.name,
            "operators": ops,
            "checkpoints": self._describe_checkpoints(),
        }

    def _describe_checkpoints(self) -> dict | None:
        c = self.checkpointer
        if c is None:
            return None
        return {
            "interval_ms": c.settings.interval_ms,
            "completed": c.completed,
            "latest": c.history[-1] if c.history else None,
            "failed": self.checkpoint_failures,
            "last_error": self.last_checkpoint_error,
            "restored_from": self.restored_from,
            "recoveries": len(self.recoveries),
            "last_recovery": self.recoveries[-1] if self.recoveries else None,
            "directory": str(c.store.dir),
        }

    # ---- shutdown ------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        self._stopping = True
        if self.controller is not None:
            self.controller.stop.set()
        if self.checkpointer is not None:
            self.checkpointer.stop.set()
        if self.status is not JobStatus.FINISHED:
            self._stop_everything()
        for w in self._workers.values():
            if w.conn is not None and not w.exited:
                with contextlib.suppress(OSError):
                    w.conn.send({"op": "exit"})
            elif w.pid and not w.exited:  # still starting: it was given nothing, and nobody answers it now
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
        self._await_workers()
        if self._zygote is not None:
            self._zygote.stop()
        if self._server is not None:
            self._server.close()
        if self._metrics is not None:
            self._metrics[0].shutdown()
            self._metrics[0].server_close()
        for r in self._sink_runners:
            r.join(self.config.shutdown_timeout)
        for logger in self._loggers:  # they read gates: done before the gates go
            logger.join(self.config.shutdown_timeout)
            if logger.is_alive():
                logger.gate.close()
                logger.join()
        if self.controller is not None:
            self.controller.join(self.config.shutdown_timeout)
        if self.checkpointer is not None:
            self.checkpointer.join(self.config.shutdown_timeout)
        deadline = time.monotonic() + self.config.shutdown_timeout
        while self._rescaling and time.monotonic() < deadline:  # rescale waiters read the control block
            time.sleep(0.01)
        with contextlib.suppress(Exception):
            self._final = self._describe_live()
        for out in self.output_channels.values():  # no reader waits on a run that is over
            if out.tail.state == LogTail.RUNNING:
                ended = self.status is JobStatus.FINISHED and out.log.ended
                out.tail.publish(out.log.end_offset, LogTail.ENDED if ended else LogTail.FAILED)
        for out in self.output_channels.values():
            out.log.close()
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
        if self.resources is not None:
            shm.unlink_prefix(self.resources.prefix)
        with contextlib.suppress(FileNotFoundError):
            self.info_path.unlink()
        self.publisher.remove()

    def _await_workers(self) -> None:
        deadline = time.monotonic() + self.config.shutdown_timeout
        pids = [w.pid for w in self._workers.values() if w.pid]
        while time.monotonic() < deadline:
            alive = [p for p in pids if _alive(p)]
            if not alive:
                return
            time.sleep(0.01)
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, 9)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
