"""A job's data plane on this machine: the shared-memory segments its workers use (control block,
gates, sink gates, state arenas, broadcast boards) and the tasks to start, built from the plan,
and from a checkpoint's state and positions when a run restores or recovers. A recovery builds
it anew and drops the old one: nothing of a failed attempt is reused."""

from __future__ import annotations

from dataclasses import dataclass, field

from stretch.runtime import control_block as cbk
from stretch.runtime.broadcast_board import BroadcastBoard
from stretch.runtime.checkpointing import broadcast_file
from stretch.runtime.control_block import ControlBlock
from stretch.runtime.event_time import producer_id
from stretch.runtime.gate import Gate
from stretch.runtime.rescaler import spread
from stretch.runtime.resources import JobResources
from stretch.state.arena import Arena
from stretch.state.key_groups import assignment as range_assignment
from stretch.state.snapshot import prepare_arena, restore_key_groups


@dataclass
class Dataplane:
    control: ControlBlock
    resources: JobResources  # what workers are told: the segments' names and the job's settings
    gates: dict[int, Gate] = field(default_factory=dict)  # keyed operators' input gates, by gate id
    sink_gates: dict[int, Gate] = field(default_factory=dict)  # by sink id
    arenas: dict[int, Arena] = field(default_factory=dict)  # keyed state, by stage id
    segments: list = field(default_factory=list)  # everything above, to close when it is dropped
    pending: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # tasks to start
    positions: dict[int, int] = field(default_factory=dict)  # source stage id -> position to start at
    parallelism: dict[int, int] = field(default_factory=dict)  # stage id -> instances


def build_dataplane(job, restore: dict | None, parallelism: dict[int, int]) -> Dataplane:
    """``job``: the Coordinator; ``parallelism``: each stage's instances so far (a recovery keeps
    a rescaled operator's), else the plan's."""
    cfg, plan, prefix = job.config, job.plan, job.prefix
    keyed = [s for s in plan.stages if s.kind == "keyed"]
    # an operator may have key groups of its own (set_max_parallelism): tables hold the most
    tables = max([plan.max_parallelism, *(s.max_parallelism for s in keyed)])
    control = ControlBlock.create(prefix, len(keyed), tables)
    res = JobResources(prefix, control.segment.name, len(keyed), tables)
    plane = Dataplane(control, res, segments=[control], parallelism=dict(parallelism))
    for op, stage in enumerate(keyed):
        control.header(op)[cbk.O_KEY_GROUPS] = stage.max_parallelism
    res.dead_letter_sink = plan.dead_letter_sink
    res.job_parameters = dict(plan.job_parameters)
    res.code = str(job.updater.history.dir)
    if job.checkpointer is not None:
        res.checkpoints = str(job.checkpointer.store.dir)
    for gate_id in plan.gate_producers:
        consumer = next(s for s in plan.stages if s.input_gate == gate_id)
        g = Gate.create(  # a reader slot per instance, a pin (Rescaler.release), an input channel's log
            prefix, "gate", cfg.gate_slots, cfg.gate_bytes, max_readers=consumer.max_parallelism + 2
        )
        plane.gates[gate_id] = g
        res.gates[gate_id] = g.name
        plane.segments.append(g.segment)
    for sink in plan.sinks:
        if sink.runs_in == "instance":
            res.sinks[sink.id] = sink
            continue
        g = Gate.create(prefix, "sink", cfg.gate_slots, cfg.sink_gate_bytes)
        g.open_reader(0, 0)
        plane.sink_gates[sink.id] = g
        res.sink_gates[sink.id] = g.name
        plane.segments.append(g.segment)
    res.channels = {name: g.name for name, g in job.channels.inputs.items()}
    for op_index, stage in enumerate(keyed):
        _build_operator(job, plane, stage, op_index, restore)
    res.channel_logs = dict(job.channels.log_locations)
    res.aborted_txns = set(job.channels.aborted_txns)
    plane.positions = dict(job.channels.log_starts)  # channel sources start at the log's end
    if restore is not None:
        plane.positions.update({int(k): v for k, v in restore["sources"].items()})
    for stage in plan.stages:
        if stage.kind == "source":
            plane.parallelism[stage.id] = 1
            if not stage.direct:
                plane.pending.append((stage.id, 0, 0, stage.code_version, 0))
    for gate_id, stage_ids in plan.gate_producers.items():
        res.producers[gate_id] = [
            producer_id(s, i) for s in stage_ids for i in range(plane.parallelism.get(s, 1))
        ]
    return plane


def _build_operator(job, plane: Dataplane, stage, op_index: int, restore: dict | None) -> None:
    """A keyed operator's arena (restored from the checkpoint if any), broadcast board, first
    ownership table and instances."""
    res, prefix = plane.resources, job.prefix
    arena = Arena.create(prefix, stage.max_parallelism)
    plane.arenas[stage.id] = arena
    res.arenas[stage.id] = arena.name
    res.keyed_index[stage.id] = op_index
    plane.segments.append(arena)
    saved = restore["operators"].get(stage.name) if restore is not None else None
    if saved is not None:
        prepare_arena(arena, saved)
        directory = job.checkpointer.store.path(restore["id"])
        for f in saved["files"]:  # every one is there in a complete checkpoint
            if not (directory / f).exists():
                raise FileNotFoundError(f"checkpoint {restore['id']} lacks {directory / f}: it is damaged")
            restore_key_groups(arena, directory / f)
    if stage.operator.kind == "broadcast_process":
        board = BroadcastBoard.create(prefix)
        plane.segments.append(board.segment)
        res.boards[stage.id] = board.name
        if saved is not None:
            saved_state = broadcast_file(job.checkpointer.store.path(restore["id"]), stage.id)
            if saved_state.exists():  # absent: no instance owned its key groups at the barrier
                board.put_start(saved_state.read_bytes())
        elif stage.id in job.broadcast_start:
            board.put_start(job.broadcast_start[stage.id])
    p = plane.parallelism.get(stage.id, stage.parallelism)
    released = job.rescaler.away.get(stage.id, {})  # a recovery keeps them away
    owners = spread(p, stage.max_parallelism, list(released))
    if owners is None:  # fewer left than instances: as before, some instance owns none
        owners = range_assignment(p, stage.max_parallelism)
        owners[list(released)] = -1
    released.update(dict.fromkeys(released, 0))  # nothing of theirs is queued in the new gate
    plane.control.publish(op_index, 0, owners, stage.code_version, parallelism=p)
    gate = plane.gates[stage.input_gate]
    for i in range(p):
        gate.open_reader(i, 0)
    plane.pending.extend((stage.id, i, 0, stage.code_version, 0) for i in range(p))
    plane.parallelism[stage.id] = p
