"""A job's sources on a cluster: each becomes input channels of the node plan, and a feed that
reads the source and writes those channels through the cluster's writers.

A node takes rows only of the key groups it owns, so a source cannot run inside each node's
engine as it does on one machine: its records must first reach the owners of their key groups.
``split_sources`` cuts every source stage that is not an input channel where its records enter a
keyed operator's gate (a ``to_gate`` step, or the tagging of one input of a two-input operator):
the node plan reads each cut from an input channel of its own, named after the source, with the
steps from the cut on; the feed keeps the source and the chained stateless steps before the cut,
whose outputs it writes into those channels (see cluster.source_feeder). Everything a node plan
accepts for an input channel it then accepts for a source.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from stretch.cluster.node_plans import event_time
from stretch.datastream.broadcast_stream import input_side
from stretch.datastream.connectors.channel import ChannelSource
from stretch.datastream.connectors.file_system import FileSource
from stretch.plan.stages import JobPlan, StageSpec, Step, walk_steps

DRIVER, NODES = "driver", "nodes"  # where a feed's splits are read
COLLECTION_CHUNK_ROWS = 8192
"""Rows of a collection a writer sends as one micro-batch: a split read again after its reader
stopped starts at a chunk, so smaller chunks repeat less (each is dropped where it was taken)."""


@dataclass
class SourceFeed:
    """One source of a job on a cluster: ``steps`` are its chained steps up to the cuts, each cut
    now a ``to_sink`` step whose ``sink`` indexes ``channels`` (the input channels it feeds)."""

    name: str
    source: object
    steps: list[Step]
    channels: list[str]
    max_parallelism: int
    job_parameters: dict = field(default_factory=dict)
    parts: list[tuple[str, object]] = field(default_factory=list)  # its splits, as the driver found them
    event_time: bool = False  # its watermark moves after each item, as on one machine: items kept whole

    @property
    def where(self) -> str:
        """Files are read by the nodes, each split by a node that asks for one (they must see
        the files at the same paths); any other source by the driver, which holds it."""
        return NODES if isinstance(self.source, FileSource) else DRIVER

    def splits(self) -> list[tuple[str, object]]:
        """(split id, source) of each part that one reader reads alone: a file source's files,
        one by one; any other source whole."""
        if isinstance(self.source, FileSource):
            return [(str(i), self.source.of_file(path)) for i, path in enumerate(self.source.files())]
        if hasattr(self.source, "chunk_rows") and not self.event_time:  # from_collection's, in chunks
            source = copy.copy(self.source)
            source.chunk_rows = COLLECTION_CHUNK_ROWS
            return [("0", source)]
        return [("0", self.source)]


def split_sources(plan: JobPlan) -> tuple[JobPlan, list[SourceFeed]]:
    """The node plan (every source that is not an input channel replaced by the input channels
    of its cuts) and the feeds of those sources; a ValueError says why a source cannot run on a
    cluster. A plan without such sources comes back as it is."""
    if all(getattr(s.source, "channel_name", None) is not None for s in plan.stages if s.kind == "source"):
        return plan, []
    plan = copy.copy(plan)
    stages = plan.stages = list(plan.stages)
    plan.sinks = [copy.copy(s) for s in plan.sinks]
    plan.gate_producers = dict(plan.gate_producers)
    taken = {getattr(s.source, "channel_name", None) for s in stages}
    feeds = []
    for index, stage in enumerate(list(stages)):
        if stage.kind != "source" or getattr(stage.source, "channel_name", None) is not None:
            continue
        cuts: list[tuple[Step, object]] = []
        chain, strategy = _strategy(stage)
        steps = _cut(chain, stage.name, cuts, getattr(stage.source, "type_info", None))
        if strategy is not None and any(step.kind != "to_sink" for step in steps):
            raise ValueError(
                f"source {stage.name!r} has a watermark strategy and steps before its key_by: on a "
                "cluster its writers assign the timestamps to the records they send the nodes, so key "
                "the source's records right after from_source (or run the job on one node engine)"
            )
        channels = []
        for i, (cut, type_info) in enumerate(cuts):
            head = cut
            if strategy is not None:  # the node assigns timestamps; its writers give the watermarks
                head = Step("assign", strategy, type_info, [cut], name="Timestamps/Watermarks")
            channel = unique_name(stage.name if i == 0 else f"{stage.name}-{i + 1}", taken)
            channels.append(channel)
            fed = channel_stage(
                stage.id if i == 0 else len(stages),
                channel if i else stage.name,
                channel,
                head,
                type_info,
                stage,
            )
            if i == 0:
                stages[index] = fed
            else:
                stages.append(fed)
        feed = SourceFeed(
            stage.name,
            stage.source,
            steps,
            channels,
            plan.max_parallelism,
            plan.job_parameters,
            event_time=strategy is not None,
        )
        feed.parts = feed.splits()
        feeds.append(feed)
    recount_producers(plan)
    return plan, feeds


def channel_stage(
    stage_id: int, name: str, channel: str, head: Step, type_info, like: StageSpec
) -> StageSpec:
    """The source stage of a node plan that reads input channel ``channel`` (records of
    ``type_info``) into the steps from a cut on (``head``), as ``like`` read them before the cut:
    fed straight into the keyed gate when keyed by a field."""
    return StageSpec(
        stage_id,
        name,
        "source",
        1,
        like.max_parallelism,
        [head],
        source=ChannelSource(channel, type_info, durable=False),
        direct=head.kind == "to_gate" and head.key is not None and head.key.field is not None,
        batch=like.batch,
    )


def _strategy(stage: StageSpec) -> tuple[list[Step], object]:
    """The stage's chain without its watermark strategy, and the strategy if it assigns
    timestamps: each split of the source is then an input split with a watermark of its own,
    its writer's (cluster.writer_clock). One that assigns nothing (PyFlink's
    ``WatermarkStrategy.no_watermarks()``, which ``from_source`` asks for) is dropped."""
    chain = stage.chain
    if len(chain) == 1 and chain[0].kind == "assign":
        strategy = chain[0].fn
        return chain[0].children, event_time(strategy)
    return chain, None


def _cut(steps: list[Step], source: str, cuts: list, type_info) -> list[Step]:
    """``steps`` with every subtree that starts at a cut replaced by a capture (``to_sink`` into
    capture ``len(cuts)``, appended to ``cuts`` with the type of the records reaching it)."""
    out = []
    for step in steps:
        if step.kind == "to_gate" or input_side(step.fn) is not None:
            out.append(Step("to_sink", sink=len(cuts), name=f"{source} -> {step.name or 'gate'}"))
            cuts.append((step, type_info))
        elif step.kind in ("to_sink", "to_chained_sink"):
            raise ValueError(
                f"source {source!r} feeds sink {step.name!r} without a keyed operator between them: "
                "on a cluster a source's records reach the nodes by key group, so key them first "
                "(or write them to the sink from a job on one node engine)"
            )
        elif step.kind == "assign":
            raise ValueError(
                f"source {source!r} assigns timestamps and watermarks after other steps "
                "(assign_timestamps_and_watermarks): on a cluster give the strategy to from_source, "
                "and key the source's records right after it"
            )
        else:
            kept = copy.copy(step)
            typed = type_info if step.kind == "filter" else step.output_type
            kept.children = _cut(step.children, source, cuts, typed)
            out.append(kept)
    return out


def unique_name(name: str, taken: set) -> str:
    """``name``, or ``name-2``, ``name-3``...: the first not in ``taken`` (which it joins)."""
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name}-{n}"
    taken.add(candidate)
    return candidate


def recount_producers(plan: JobPlan) -> None:
    """Which stages feed each gate and sink, as compile_plan counts them, for the new stages."""
    plan.gate_producers = {g: [] for g in plan.gate_producers}
    for sink in plan.sinks:
        if sink.id != plan.dead_letter_sink:
            sink.producers = []
    for stage in plan.stages:
        for step in walk_steps(stage.chain):
            if step.kind == "to_gate":
                plan.gate_producers[step.gate].append(stage.id)
            elif step.kind in ("to_sink", "to_chained_sink"):
                plan.sinks[step.sink].producers.append(stage.id)
    if plan.dead_letter_sink is not None:
        plan.sinks[plan.dead_letter_sink].producers = [s.id for s in plan.stages]
