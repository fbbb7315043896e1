"""Compile the job graph into stages: sources and keyed operators with their chained steps.

A stage is what one worker process runs: a source, or one instance of a keyed operator. Stateless
map/filter/flat_map steps never become stages of their own; they are chained into the stage that
produces their input. A key_by becomes a gate: the producing stage computes each record's key group
and appends the batch to the gate that the keyed operator's instances read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stretch.common.typeinfo import TypeInformation
from stretch.errors import UnknownOperator
from stretch.plan.graph import Transformation, reachable

STATELESS = ("map", "flat_map", "filter", "assign", "stateless_process")
KEYED = ("process", "aggregate", "vector_window", "band_join", "broadcast_process")


@dataclass
class KeySpec:
    """How a producer derives the key of each record for the gate it feeds."""

    selector: Any = None  # callable(record) -> key, or None when keyed by a field
    field: str | int | None = None  # field name or position (vectorized path)
    key_type: TypeInformation | None = None
    max_parallelism: int = 128
    runs: bool = True  # batches may be laid out in runs of key groups (runtime.key_group_runs)


@dataclass
class Step:
    """One chained step: map/flat_map/filter, or a terminal that hands records on."""

    kind: str  # map | flat_map | filter | assign | stateless_process | side | to_gate | to_sink | to_chained_sink
    fn: Any = None
    output_type: TypeInformation | None = None
    children: list[Step] = field(default_factory=list)
    gate: int = -1
    key: KeySpec | None = None
    sink: int = -1
    name: str = ""


@dataclass
class OperatorSpec:
    """The keyed operator at the head of a keyed stage."""

    kind: str  # process | aggregate | vector_window | band_join | broadcast_process
    fn: Any = None
    output_type: TypeInformation | None = None
    key: KeySpec | None = None
    op: str = ""  # aggregate: sum | min | max
    fields: list = field(default_factory=list)


@dataclass
class StageSpec:
    id: int
    name: str
    kind: str  # source | keyed
    parallelism: int
    max_parallelism: int
    chain: list[Step]
    source: Any = None
    operator: OperatorSpec | None = None
    input_gate: int = -1
    direct: bool = False  # a channel whose writers append straight into the keyed operator's gate
    batch: bool = False  # BATCH execution mode: processing time stands still, its timers fire at the end
    code_version: int = 0  # which version of the operator's code this is (live updates add versions)
    drop_states: tuple = ()  # states this version clears when it takes over (update's drop_orphaned)
    updated_step: str = ""  # the chained step whose function this version changed ("": the operator)


@dataclass
class SinkSpec:
    id: int
    name: str
    sink: Any
    producers: list[int] = field(default_factory=list)  # stage ids
    upstream_parallelism: int = 1
    type_info: TypeInformation | None = None  # of the records it receives, where declared

    @property
    def runs_in(self) -> str:
        """job (a thread of the job's process) | instance (chained) | reader (read from outside)."""
        return getattr(self.sink, "runs_in", "job")


@dataclass
class JobPlan:
    stages: list[StageSpec]
    sinks: list[SinkSpec]
    gate_producers: dict[int, list[int]]  # gate id -> producing stage ids
    max_parallelism: int
    dead_letter_sink: int | None = None  # under the dead-letter policy: the sink every stage may feed
    job_parameters: dict[str, str] = field(default_factory=dict)  # RuntimeContext.get_job_parameter

    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        known = ", ".join(s.name for s in self.stages if s.kind == "keyed") or "none"
        raise UnknownOperator(f"no operator named {name!r} in this job (keyed operators: {known})")


def compile_plan(
    sinks: list[Transformation], default_parallelism: int, max_parallelism: int, dead_letters: Any = None
) -> JobPlan:
    """Turn the transformations the sinks depend on into stages, gates and sinks; ``dead_letters``,
    the sink of the dead-letter policy, takes the records any stage rejects."""
    if not sinks:
        raise RuntimeError("the job has no sinks: add print(), sink_to(...) or execute_and_collect()")
    nodes = reachable(sinks)
    consumers: dict[int, list[Transformation]] = {t.id: [] for t in nodes}
    for t in nodes:
        for i in t.inputs:
            consumers[i.id].append(t)

    names: dict[str, int] = {}

    def unique(name: str) -> str:
        n = names.get(name, 0)
        names[name] = n + 1
        return name if n == 0 else f"{name}-{n + 1}"

    stage_of: dict[int, int] = {}
    gate_of: dict[int, int] = {}
    sink_of: dict[int, int] = {}
    stages: list[StageSpec] = []
    sink_specs: list[SinkSpec] = []
    for t in nodes:
        if t.kind == "source":
            stage_of[t.id] = len(stages)
            stages.append(
                StageSpec(
                    len(stages), unique(t.name), "source", 1, max_parallelism, [], source=t.spec["source"]
                )
            )
        elif t.kind in KEYED:
            key_by = t.inputs[0]
            mp = t.max_parallelism or max_parallelism
            p = t.parallelism or default_parallelism
            if p > mp:
                raise ValueError(f"operator {t.name!r}: parallelism {p} exceeds max parallelism {mp}")
            gate_of[t.id] = len(gate_of)
            key = _key_spec(key_by, mp, t.kind)
            op = OperatorSpec(
                t.kind,
                t.spec.get("fn"),
                t.output_type,
                key,
                t.spec.get("op", ""),
                list(t.spec.get("fields", [])),
            )
            stage_of[t.id] = len(stages)
            stages.append(
                StageSpec(
                    len(stages), unique(t.name), "keyed", p, mp, [], operator=op, input_gate=gate_of[t.id]
                )
            )
        elif t.kind == "sink":
            sink_of[t.id] = len(sink_specs)
            sink_specs.append(
                SinkSpec(len(sink_specs), t.name, t.spec["sink"], type_info=t.inputs[0].output_type)
            )

    def steps_after(t: Transformation) -> list[Step]:
        out: list[Step] = []
        for c in consumers[t.id]:
            if c.kind in STATELESS:
                out.append(Step(c.kind, c.spec["fn"], c.output_type, steps_after(c), name=c.name))
            elif c.kind == "union":
                out.extend(steps_after(c))
            elif c.kind == "side_output":
                out.append(Step("side", c.spec["tag"], c.output_type, steps_after(c), name=c.name))
            elif c.kind == "key_by":
                for k in consumers[c.id]:
                    out.append(
                        Step(
                            "to_gate",
                            gate=gate_of[k.id],
                            key=_key_spec(c, stages[stage_of[k.id]].max_parallelism, k.kind),
                            name=stages[stage_of[k.id]].name,  # the key selector feeds that operator
                        )
                    )
            elif c.kind == "sink":
                sink_id = sink_of[c.id]
                kind = "to_chained_sink" if sink_specs[sink_id].runs_in == "instance" else "to_sink"
                out.append(Step(kind, sink=sink_id, name=c.name))
            else:
                raise TypeError(f"{c.kind} cannot follow {t.kind}")
        return out

    gate_producers: dict[int, list[int]] = {g: [] for g in gate_of.values()}
    for t in nodes:
        if t.id in stage_of:
            stage = stages[stage_of[t.id]]
            stage.chain = steps_after(t)
            strategy = t.spec.get("watermark_strategy")
            if t.kind == "source" and strategy is not None:  # from_source(source, strategy, ...)
                stage.chain = [
                    Step("assign", strategy, t.output_type, stage.chain, name="Timestamps/Watermarks")
                ]
            for step in walk_steps(stage.chain):
                if step.kind == "to_gate":
                    gate_producers[step.gate].append(stage.id)
                elif step.kind in ("to_sink", "to_chained_sink"):
                    sink_specs[step.sink].producers.append(stage.id)
    for s in sink_specs:
        s.upstream_parallelism = max((stages[i].parallelism for i in s.producers), default=1)
    for stage in stages:
        chain = stage.chain
        stage.direct = (
            getattr(stage.source, "channel_name", None) is not None
            and len(chain) == 1
            and chain[0].kind == "to_gate"
            and chain[0].key.field is not None
        )
    plan = JobPlan(stages, sink_specs, gate_producers, max_parallelism)
    if dead_letters is not None:
        plan.dead_letter_sink = len(sink_specs)
        sink_specs.append(SinkSpec(len(sink_specs), "dead letters", dead_letters, [s.id for s in stages]))
    return plan


# Operators whose records of one batch are read in their order across keys: every instance
# probes every record of a band join, and a broadcast element applies before the records after it.
IN_ORDER = ("band_join", "broadcast_process")


def _key_spec(key_by: Transformation, max_parallelism: int, operator_kind: str) -> KeySpec:
    return KeySpec(
        key_by.spec.get("selector"),
        key_by.spec.get("field"),
        key_by.spec.get("key_type"),
        max_parallelism,
        runs=operator_kind not in IN_ORDER,
    )


def walk_steps(steps: list[Step]):
    """Every step of a chain, depth first (a step's children follow it)."""
    for s in steps:
        yield s
        yield from walk_steps(s.children)
