"""Checkpoints: barriers through the gates, key-group snapshots, and the record that completes them.

Aligned barriers, placed by the coordinator, so a gate never needs alignment buffering:

1. The coordinator raises the job's checkpoint request to n (a word of the control block).
2. Each source, between two items, records its position, says it reached n, and pauses.
3. For each gate, once every stage feeding it reached n (or ended), the coordinator appends barrier
   n; a stage is released (goes on) once every gate and sink it feeds holds the barrier. A gate
   thus holds, before barrier n, exactly the records its producers made before their checkpoint.
4. A keyed instance reading barrier n writes the key groups it owns (Arrow IPC, states and timers
   alike; see ``stretch.state.snapshot``), says it reached n, and pauses until its stage's release.
   A broadcast operator's instance that owns its emitting key group also writes the broadcast
   state (``broadcast_file``), before it says so.
5. A job-side sink reading barrier n notes where its output stands.
6. When every instance and sink reached n, the metadata file is written (atomically): checkpoint
   n is complete, and the sinks commit the output before barrier n.

A rescale may happen while a checkpoint is under way (it does not wait for the barrier, which under
a backlog takes as long as the backlog): the instances that take part in an operator's checkpoint
are those of the epoch in force at its barrier's position (runtime.frontier), whether that epoch
was placed before the barrier or after. Live updates and checkpoints take turns.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from stretch.runtime import control_block as cbk
from stretch.runtime.gate import Kind
from stretch.runtime.state_dir import make_private_dir, write_private
from stretch.state.checkpoint_layout import FINISHED, METADATA, RUN_START, snapshot_file
from stretch.state.snapshot import describe_arena, write_snapshot

RETAINED = 2  # completed checkpoints kept on disk


def broadcast_file(directory: Path, stage: int) -> Path:
    """Where a broadcast operator's broadcast state is saved at a checkpoint (by one instance:
    every instance holds the same copy at the barrier)."""
    return directory / f"{stage}-broadcast.pickle"


def write_snapshot_or_report(batches, path: Path) -> None:
    """An instance's snapshot thread: the file, or next to it why it could not be written (so the
    coordinator fails the checkpoint instead of waiting for it)."""
    try:
        make_private_dir(path.parent)
        write_snapshot(batches, path)
        os.chmod(path, 0o600)  # in an owner-only directory all along; owner-only itself, too
    except Exception as e:
        write_private(path.with_name(path.name + ".failed"), f"{type(e).__name__}: {e}")


class Barrier:
    """A producer's side of a checkpoint barrier, in its worker (steps 2 and 4 above)."""

    def __init__(self, control, stage: int):
        self.cb = control
        self.stage = stage
        self.passed = control.load(control.stage_word(stage, cbk.S_RELEASED))

    def source_reached(self, position: int, should_stop) -> bool:
        """Between two items: if a checkpoint was requested, record the position and pause.
        False if the task was told to stop meanwhile."""
        cb = self.cb
        requested = cb.load(cb.request_word)
        if requested <= self.passed:
            return True
        self.record_position(position)
        cb.signal(cb.stage_word(self.stage, cbk.S_REACHED), requested)
        return self.wait_release(requested, should_stop)

    def record_position(self, position: int) -> None:
        self.cb.signal(self.cb.stage_word(self.stage, cbk.S_POSITION), position)

    def wait_release(self, checkpoint: int, should_stop) -> bool:
        """Until the barrier is behind this stage's output in every gate it feeds (False: told to
        stop meanwhile)."""
        word = self.cb.stage_word(self.stage, cbk.S_RELEASED)
        while not self.cb.wait_checkpoint(lambda: self.cb.load(word) >= checkpoint, 0.1):
            if should_stop():
                return False
        self.passed = checkpoint
        return True


class CheckpointStore:
    """A job's checkpoint directory: ``<n>/`` per checkpoint, complete once it has its metadata.

    Besides the checkpoints, ``_run_start.json`` records where the run they continue began (its
    sources' and output channels' offsets, no state): checkpoint 0, which a restore goes back to
    when the run died before completing one. ``_finished.json`` says the job ended; nothing is left
    to restore then (Flink, too, drops a finished job's checkpoints).
    """

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        make_private_dir(self.dir)
        st = self.dir.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:  # state may hold pickled values
            raise PermissionError(f"{self.dir} must be owned by you and writable by nobody else")

    def path(self, checkpoint: int) -> Path:
        return snapshot_file(self.dir, checkpoint, 0, 0).parent

    def completed(self) -> list[int]:
        return sorted(int(p.parent.name) for p in self.dir.glob(f"*/{METADATA}"))

    def latest(self) -> dict | None:
        """The metadata of the newest complete checkpoint, else the run's start, else None."""
        done = self.completed()
        path = self.path(done[-1]) / METADATA if done else self.dir / RUN_START
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None

    def begin(self, start: dict) -> None:
        """A new run (not a restore): earlier runs' checkpoints are not its own."""
        self._clear()
        _write_json(self.dir / RUN_START, {"id": 0, "operators": {}, **start})

    def complete(self, checkpoint: int, metadata: dict) -> None:
        _write_json(self.path(checkpoint) / METADATA, metadata)
        self.retain()

    def retain(self) -> None:
        """Keep the newest RETAINED complete checkpoints; drop older and abandoned ones."""
        done = self.completed()
        keep = set(done[-RETAINED:])
        newest = done[-1] if done else 0
        for p in self.dir.iterdir():
            if p.is_dir() and p.name.isdigit() and int(p.name) not in keep and int(p.name) < newest:
                shutil.rmtree(p, ignore_errors=True)

    def discard_incomplete(self) -> None:
        """A run that ends leaves no checkpoint half written."""
        for p in self.dir.iterdir():
            if p.is_dir() and p.name.isdigit() and not (p / METADATA).exists():
                shutil.rmtree(p, ignore_errors=True)

    def finish(self) -> None:
        """The job ended: nothing is left to restore, but its latest complete checkpoint stays, so
        its state can still be read (``stretch.state.read_checkpoint``) until a new run starts."""
        done = self.completed()
        self._clear(keep=self.path(done[-1]) if done else None)
        _write_json(self.dir / FINISHED, {"at": time.time()})

    def finished_at(self) -> float | None:
        """When the job finished, if its latest run did."""
        try:
            return json.loads((self.dir / FINISHED).read_text())["at"]
        except FileNotFoundError:
            return None

    def _clear(self, keep: Path | None = None) -> None:
        for p in self.dir.iterdir():
            if p == keep:
                continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _write_json(path: Path, value: dict) -> None:
    """Atomically: a reader (or a crash) sees the old file or the new one, never a part."""
    write_private(path, json.dumps(value))


@dataclass
class CheckpointSettings:
    """How a job takes checkpoints (set through ``env.get_checkpoint_config()``, Flink's meanings)."""

    interval_ms: int | None = None  # from the start of one periodic checkpoint to the next; None: on demand
    timeout_ms: int = 600_000  # a checkpoint not complete by then fails
    min_pause_ms: int = 0  # from the end of one checkpoint to the start of the next
    tolerable_failures: int | None = None  # consecutive failed checkpoints before the job fails; None: any
    delete_on_cancel: bool = False  # a cancelled job removes its checkpoints (else they stay to restore)
    max_recoveries_in_a_row: int = 10  # dead workers recovered with no checkpoint completed between


class CheckpointAborted(RuntimeError):
    """The job failed, ended or recovered while a checkpoint was under way."""


class Checkpointer:
    """Takes the checkpoints of one running job (on demand, and periodically if configured)."""

    def __init__(self, coordinator, store: CheckpointStore, settings: CheckpointSettings):
        self.co = coordinator
        self.store = store
        self.settings = settings
        self.timeout = settings.timeout_ms / 1000
        latest = store.completed()
        self.last_id = latest[-1] if latest else 0  # a restored run continues the ids
        self.history: deque[dict] = deque(maxlen=100)  # reports of the latest completed checkpoints
        self.completed = 0  # checkpoints completed in this run, and their total duration
        self.completed_ms = 0.0
        self.stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.settings.interval_ms:
            self._thread = threading.Thread(target=self._periodic, name="stretch-checkpoints", daemon=True)
            self._thread.start()

    def join(self, timeout: float) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _periodic(self) -> None:
        """Start a checkpoint every interval, but never sooner than the minimum pause after the
        previous one ended (so a slow checkpoint is followed by the next at once, as in Flink)."""
        interval, min_pause = self.settings.interval_ms / 1000, self.settings.min_pause_ms / 1000
        next_at = time.monotonic() + interval
        while not self.stop.wait(max(0.0, next_at - time.monotonic())):
            started = time.monotonic()
            with contextlib.suppress(Exception):  # trigger() reported it; the next one may work
                self.trigger()
            next_at = max(started + interval, time.monotonic() + min_pause)

    # ---- one checkpoint -------------------------------------------------------------------------
    def trigger(self) -> dict:
        """Take a checkpoint now; returns its report once it is complete."""
        with self.co.exclusive:
            if not self.co.accepting_checkpoints():
                raise CheckpointAborted(f"the job is {self.co.status.name}; no checkpoint taken")
            self.last_id += 1
            n, generation = self.last_id, self.co.generation
            try:
                return self._take(n, generation)
            except BaseException as e:
                if self.co.generation == generation and self.co.accepting_checkpoints():
                    self._release_all(n)  # a failed checkpoint must not leave producers paused
                    if not isinstance(e, CheckpointAborted):
                        self.co.checkpoint_failed(e)
                raise

    def _release_all(self, n: int) -> None:
        cb = self.co.control
        for stage in self.co.plan.stages:
            cb.signal(cb.stage_word(stage.id, cbk.S_RELEASED), n)

    def _take(self, n: int, generation: int) -> dict:
        co, cb, plan = self.co, self.co.control, self.co.plan
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        make_private_dir(self.store.path(n))
        keyed = {s.id: co.resources.keyed_index[s.id] for s in plan.stages if s.kind == "keyed"}
        barrier_at: dict[int, int] = {}  # keyed stage -> the position of the barrier in its gate

        def taking_part(sid: int) -> int:
            """The stage's instances that take part: those of the epoch in force at the barrier."""
            if sid not in barrier_at:
                return co.parallelism_of(sid)
            op = keyed[sid]
            return cb.parallelism(op, cb.epoch_at(op, barrier_at[sid]))

        inputs = {s.input_gate: s.id for s in plan.stages if s.kind == "keyed"}
        feeds: dict[int, list] = {s.id: [] for s in plan.stages}  # stage -> gates and sinks it feeds
        targets = []
        for gate_id, producers in plan.gate_producers.items():
            targets.append((co.gates[gate_id], producers, inputs.get(gate_id)))
            for p in producers:
                feeds[p].append(gate_id)
        runners = {r.spec.id: r for r in co.sink_runners}
        for sink in plan.sinks:
            if sink.id in co.sink_gates:
                targets.append((co.sink_gates[sink.id], sink.producers, None))
                for p in sink.producers:
                    feeds[p].append(-1 - sink.id)

        def stage_reached(sid: int) -> bool:
            if co.stage_finished(sid):
                return True
            if sid in keyed:
                if sid not in barrier_at:  # no instance can have reached a barrier not yet placed
                    return False
                inst = cb.instances(keyed[sid])
                return all(
                    inst[i, cbk.I_CHECKPOINT] >= n or inst[i, cbk.I_STATE] == cbk.DONE
                    for i in range(taking_part(sid))
                )
            return cb.load(cb.stage_word(sid, cbk.S_REACHED)) >= n

        placed: set[int] = set()
        released: set[int] = set()
        positions: dict[str, int] = {}
        pause_ms = 0.0  # the longest an operator's instances stood still (first pause to release)
        cb.signal(cb.request_word, n)
        co.channels.poke_sources()  # a source idle on its channel looks for the request now
        while True:
            seen = cb.signals()
            if co.generation != generation or not co.accepting_checkpoints():
                raise CheckpointAborted(f"checkpoint {n} abandoned: the job is {co.status.name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint {n} did not complete within {self.timeout:.0f} s")
            reached = {s.id for s in plan.stages if stage_reached(s.id)}
            for gate, producers, consumer in targets:
                if id(gate) not in placed and set(producers) <= reached:
                    seq = gate.append_control(Kind.CHECKPOINT, n)
                    if consumer is not None:
                        barrier_at[consumer] = gate.start_of(seq)
                    placed.add(id(gate))
            for sid in reached - released:
                outputs = [co.gates[g] if g >= 0 else co.sink_gates[-1 - g] for g in feeds[sid]]
                if all(id(g) in placed for g in outputs):
                    if sid not in keyed:
                        positions[str(sid)] = cb.load(cb.stage_word(sid, cbk.S_POSITION))
                    cb.signal(cb.stage_word(sid, cbk.S_RELEASED), n)
                    released.add(sid)
                    if sid in keyed:  # from its first instance at the barrier until now
                        inst = cb.instances(keyed[sid])[: taking_part(sid)]
                        at = inst[inst[:, cbk.I_CHECKPOINT] >= n, cbk.I_BARRIER_AT_NS]
                        if at.size:
                            pause_ms = max(pause_ms, (time.monotonic_ns() - int(at.min())) / 1e6)
            if len(released) == len(plan.stages) and all(
                r.reached >= n or r.finished for r in runners.values()
            ):
                break
            cb.wait_signal(seen, 0.01)  # instances and sources signal; sinks and ends are polled
        parallelism = {sid: taking_part(sid) for sid in keyed}
        files = self._await_files(n, generation, keyed, parallelism, deadline)
        outputs = {}
        for r in runners.values():
            name = getattr(r.spec.sink, "name", None)
            offset = r.output_offset(n)
            if name is not None and offset is not None:
                outputs[name] = offset
        directory = self.store.path(n)
        size = sum(f.stat().st_size for f in directory.glob("*.arrow"))
        duration_ms = (time.monotonic() - t0) * 1000
        metadata = {
            "id": n,
            "job": co.job_name,
            "completed_at": time.time(),
            "duration_ms": duration_ms,
            "bytes": size,
            "max_parallelism": plan.max_parallelism,
            "sources": positions,
            "operators": {
                plan.stages[sid].name: {
                    "stage": sid,
                    "parallelism": parallelism[sid],
                    "files": files[sid],
                    **describe_arena(co.arenas[sid]),
                }
                for sid in keyed
            },
            "outputs": outputs,
            "txns": co.channels.record_txns(n),
            "code": co.updater.history.versions(plan.stages),
        }
        self.store.complete(n, metadata)
        co.checkpoint_completed(metadata)
        for r in runners.values():
            r.commit(n)
        report = {
            "id": n,
            "duration_ms": duration_ms,
            "pause_ms": pause_ms,
            "bytes": size,
            "completed_at": metadata["completed_at"],
        }
        self.history.append(report)
        self.completed += 1
        self.completed_ms += duration_ms
        return report

    def _await_files(self, n: int, generation: int, keyed: dict, parallelism: dict, deadline: float) -> dict:
        """Each instance that passed barrier n writes its copy of its key groups in the background:
        wait for every file (instances that ended before the barrier wrote none)."""
        co, cb = self.co, self.co.control
        expected = {
            sid: [i for i in range(parallelism[sid]) if cb.instances(op)[i, cbk.I_CHECKPOINT] >= n]
            for sid, op in keyed.items()
        }
        for sid, instances in expected.items():
            for i in instances:
                path = snapshot_file(self.store.dir, n, sid, i)
                failed = path.with_name(path.name + ".failed")
                while not path.exists():
                    if failed.exists():
                        raise RuntimeError(f"checkpoint {n}: {failed.read_text()}")
                    if co.generation != generation or not co.accepting_checkpoints():
                        raise CheckpointAborted(f"checkpoint {n} abandoned: the job is {co.status.name}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"checkpoint {n}: {path.name} was not written in time")
                    time.sleep(0.002)
        return {
            sid: [snapshot_file(self.store.dir, n, sid, i).name for i in ids] for sid, ids in expected.items()
        }
