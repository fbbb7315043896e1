"""A job that re-keys, on a cluster: each edge from one keyed operator into another becomes a
forward, so the rows go to the node owning their key group of the next operator.

On one machine a keyed operator's output reaches the next keyed operator's gate through a
``to_gate`` step that keys it again. Across nodes the next key group may be anywhere, so
``split_rekeys`` cuts the plan there, as ``source_plans`` cuts a source: the producing operator's
step becomes a chained sink (``ForwardSink``) that writes its records through the cluster's
writers into an input channel of the job named after the edge (``"totals->regions"``), and the
node plan reads that channel with the steps from the cut on, as it reads any input channel.
Everything a node plan accepts for an input channel it then accepts for a forward: fields or key
selector functions, the inputs of a join.

A checkpointed job forwards through a log instead (``logged``: cluster.forward_log): the producing
operator's records go into an output channel of the node's job, which the node sends on as its
checkpoints cover it, so a node restored after a failure forwards nothing twice.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from stretch.cluster.forward_log import ForwardLog
from stretch.cluster.forward_sink import ForwardSink
from stretch.cluster.node_plans import event_time
from stretch.cluster.source_plans import channel_stage, recount_producers, unique_name
from stretch.common.watermark_strategy import WatermarkStrategy
from stretch.datastream.broadcast_stream import input_side
from stretch.plan.stages import JobPlan, SinkSpec, Step, walk_steps
from stretch.runtime.chain import HELD
from stretch.runtime.event_time import CARRIED


@dataclass
class Forward:
    """One re-keying edge: ``source`` operator's records into input channel ``channel``, whose
    source stage feeds ``target`` (a keyed operator, or one input of a two-input one)."""

    source: str
    target: str
    channel: str
    timed: bool = False  # with event time: the source's instances are the channel's splits
    parallelism: int = 1  # the source's instances on a node the job starts on
    logged: bool = False  # through a log its node's checkpoints commit (cluster.forward_log)


def split_rekeys(plan: JobPlan, reach: dict, logged: bool = False) -> tuple[JobPlan, list[Forward]]:
    """The node plan (each keyed operator's output into another keyed operator now written to an
    input channel of its own by a ForwardSink, given ``reach``: how a node's writers reach the
    cluster, see ForwardSink; ``logged``: through a ForwardLog, for a checkpointed job) and its
    forwards. A plan that does not re-key comes back as it is."""
    if not any(_cuts_in(s.chain) for s in plan.stages if s.kind == "keyed"):
        return plan, []
    plan = copy.copy(plan)
    stages = plan.stages = list(plan.stages)
    plan.sinks = list(plan.sinks)
    plan.gate_producers = dict(plan.gate_producers)
    taken = {getattr(s.source, "channel_name", None) for s in stages} | {
        getattr(s.sink, "channel_name", None) for s in plan.sinks
    }
    forwards: list[Forward] = []
    timed = any(
        step.kind == "assign" and event_time(step.fn) is not None
        for stage in stages
        for step in walk_steps(stage.chain)
    )
    for index, original in enumerate(list(stages)):
        if original.kind != "keyed" or not _cuts_in(original.chain):
            continue
        stage = stages[index] = copy.copy(original)
        cuts: list[tuple[Step, object]] = []
        stage.chain = _cut(stage.chain, cuts, stage.operator.output_type)
        for head, type_info in cuts:
            target = _target(head)
            channel = unique_name(f"{stage.name}->{target}", taken)
            sink_id = len(plan.sinks)
            sink = ForwardLog(channel, reach, timed) if logged else ForwardSink(channel, reach, timed)
            spec = SinkSpec(sink_id, channel, sink, [stage.id], stage.parallelism, type_info)
            plan.sinks.append(spec)
            _point(stage.chain, head, spec)
            fed = head
            if timed:  # the records keep their timestamps; the producing instances give the watermarks
                fed = Step("assign", carried_time(), type_info, [head], name="Timestamps/Watermarks")
            stages.append(channel_stage(len(stages), channel, channel, fed, type_info, stage))
            forwards.append(Forward(stage.name, target, channel, timed, stage.parallelism, logged))
    recount_producers(plan)
    return plan, forwards


def carried_time() -> WatermarkStrategy:
    """The strategy of a forward's channel in a job with event time: the records' own timestamps;
    the watermarks are the producing instances' (cluster.writer_clock.CarriedClock)."""
    return WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner(CARRIED)


def _is_cut(step: Step) -> bool:
    """A step where records enter a keyed operator: a ``to_gate``, or the tagging of one input of
    a two-input operator (a join, a co-group, a connected stream), whose child is the ``to_gate``."""
    return step.kind == "to_gate" or input_side(step.fn) is not None


def _cuts_in(steps: list[Step]) -> bool:
    return any(_is_cut(s) or _cuts_in(s.children) for s in steps)


def _cut(steps: list[Step], cuts: list, type_info) -> list[Step]:
    """``steps`` with every subtree that starts at a cut replaced by a chained sink (its sink id
    set by ``_point`` once the cut has a channel), the cut appended to ``cuts`` with the type of
    the records reaching it."""
    out = []
    for step in steps:
        if _is_cut(step):
            out.append(Step("to_chained_sink", fn=step, name=f"-> {_target(step)}"))
            cuts.append((step, type_info))
        else:
            kept = copy.copy(step)
            kept.children = _cut(
                step.children, cuts, type_info if step.kind == "filter" else step.output_type
            )
            out.append(kept)
    return out


def _point(steps: list[Step], head: Step, spec: SinkSpec) -> None:
    """Point the sink step that replaced ``head`` at sink ``spec`` (chained, or through a sink
    gate: a ForwardLog is written by the job, as its other output channels)."""
    for step in steps:
        if step.kind == "to_chained_sink" and step.fn is head:
            step.fn, step.sink = None, spec.id
            if spec.runs_in != "instance":
                step.kind = "to_sink"
                # a gate entry's records go into the log together (a write each), with their
                # timestamps in a job with event time
                step.fn = CARRIED if spec.sink.timed else HELD
            return
        _point(step.children, head, spec)


def _target(step: Step) -> str:
    """The keyed operator a cut's records enter."""
    while step.kind != "to_gate":
        step = step.children[0]
    return step.name or f"gate {step.gate}"
