"""What a node accepts to run: jobs whose keyed operators are fed straight by channels keyed by a
field or a key selector function (each channel's KeyRoute), the channels every node takes whole
(a broadcast operator's broadcast input), and the channels any node may take a row of (a
non-keyed broadcast operator's other input, routed by the whole row)."""

from __future__ import annotations

import copy
import dataclasses

from stretch.cluster.key_routes import ROW, KeyRoute
from stretch.contracts.functions import KeySelector
from stretch.datastream.broadcast_stream import input_side, keyed_input_selector
from stretch.datastream.two_inputs import LEFT, RIGHT, UnionKey, key_of


def cluster_inputs(plan) -> dict[str, KeyRoute]:
    """Input channel -> key route of a job that can run on a cluster, else a ValueError saying why.

    Across nodes, rows are routed by the key group of their key, so every keyed operator must be
    fed straight by an input channel keyed right away, by a field or a key selector function
    (re-keying across nodes goes through Spark).
    """
    inputs, fed = {}, set()
    _refuse_band_joins(plan)
    feeds = broadcast_feeds(plan)
    for stage in plan.stages:
        name = getattr(stage.source, "channel_name", None)
        if stage.kind == "source" and name is None:
            raise ValueError(
                f"source {stage.name!r} is not an input channel: on a cluster a job reads its input "
                "from channels (ChannelSource) that the cluster's writers route by key group"
            )
        if name in feeds:  # an input of a broadcast operator
            route, gate = feeds[name]
            if route is not BROADCAST:
                inputs[name] = route
                fed.add(gate)
            continue
        if name is not None:
            chain, strategy = stage.chain, None
            if len(chain) == 1 and chain[0].kind == "assign":  # from_source(channel, strategy, ...)
                strategy, chain = chain[0].fn, chain[0].children
            head = chain[0] if len(chain) == 1 else None
            side = _two_input_side(head)
            if side is not None:  # one input of a join, co-group or connected stream
                head, key = head.children[0], SideKey(head.children[0].key.selector.selectors[side])
                inputs[name] = KeyRoute(selector=key, operator=head.name, watermarks=event_time(strategy))
                fed.add(head.gate)
                continue
            if head is None or head.kind != "to_gate":
                raise ValueError(
                    f"input channel {name!r} is not keyed right away: on a cluster, key the channel's "
                    "records first (key_by('field'), key_by(position) or key_by(a function))"
                    + (", right after its watermark strategy" if strategy is not None else "")
                )
            inputs[name] = KeyRoute(head.key.field, head.key.selector, head.name, event_time(strategy))
            fed.add(head.gate)
    for stage in plan.stages:
        if stage.kind == "keyed" and stage.input_gate not in fed:
            raise ValueError(
                f"operator {stage.name!r} is keyed by something its input is not routed by across "
                "nodes: key its input right where it enters from a channel, a source or another "
                "keyed operator"
            )
    return inputs


def event_time(strategy):
    """The strategy writers of a channel keep its watermarks by (cluster.writer_clock), or None:
    one that assigns no timestamps, or makes no watermarks, leaves the channel without event time."""
    if strategy is None or strategy.kind == "none" or strategy.timestamp_assigner is None:
        return None
    return strategy


def node_plan(plan):
    """The plan a node runs: the watermark strategy of each channel it reads still assigns the
    rows' timestamps, but their watermarks come from the channel's writers (cluster.node_watermarks)
    as mark batches, not from what this node alone sees."""
    for stage in plan.stages:
        chain = stage.chain
        if (
            getattr(stage.source, "channel_name", None) is not None
            and len(chain) == 1
            and chain[0].kind == "assign"
        ):
            strategy = copy.copy(chain[0].fn)
            strategy.kind = "none"  # timestamps only: the node's WatermarkGenerator makes none
            stage.chain = [dataclasses.replace(chain[0], fn=strategy)]
    return plan


def _refuse_band_joins(plan) -> None:
    for stage in plan.stages:
        if stage.kind == "keyed" and stage.operator is not None and stage.operator.kind == "band_join":
            raise ValueError(
                f"operator {stage.name!r} is a band join: it pairs elements across keys, each probed "
                "by every instance in one gate order, and nodes that take rows by key group share no "
                "such order; run it on one node engine (env.execute_async without cluster=)"
            )


def _two_input_side(step) -> int | None:
    """The side of a two-input keyed operator (a join, a co-group, a connected stream) a
    channel's records enter right away (tagged, then keyed by the side's key: datastream
    .two_inputs), else None."""
    if step is None or step.kind != "map" or input_side(step.fn) is None or len(step.children) != 1:
        return None
    child = step.children[0]
    if child.kind != "to_gate" or not isinstance(child.key.selector, UnionKey):
        return None
    return input_side(step.fn)


class SideKey(KeySelector):
    """The key of one input of a two-input operator, on the input's own records: what the
    operator's UnionKey gives for them once tagged, so a writer routes them where it keys them."""

    def __init__(self, selector):
        self.selector = selector

    def get_key(self, value):
        return key_of(self.selector, value)


BROADCAST = object()  # broadcast_feeds' mark of a channel whose rows every node takes


def broadcast_channels(plan) -> list[str]:
    """The input channels a job reads as broadcast streams: their rows go to every node."""
    return [name for name, (field, _gate) in broadcast_feeds(plan).items() if field is BROADCAST]


def broadcast_feeds(plan) -> dict[str, tuple[object, int]]:
    """Input channel -> (key route, or ``BROADCAST``; the gate it feeds) of each channel that
    feeds a broadcast operator, else a ValueError saying why the job cannot run on a cluster.

    The keyed input must be keyed right away, as any keyed input on a cluster; the broadcast input
    may pass stateless steps first (every node runs them on every row), but no sink: each node
    would write every one of its records."""
    gates = {
        s.input_gate: s
        for s in plan.stages
        if s.kind == "keyed" and s.operator is not None and s.operator.kind == "broadcast_process"
    }
    feeds: dict[str, tuple[object, int]] = {}
    if not gates:
        return feeds
    for stage in plan.stages:
        name = getattr(stage.source, "channel_name", None)
        if name is None:
            continue
        steps = list(_walk_steps(stage.chain))
        targets = {step.gate for step, _parent in steps if step.kind == "to_gate" and step.gate in gates}
        if not targets:
            continue
        gate = min(targets)
        operator = gates[gate]
        sides = {input_side(step.fn) for step, _parent in steps if step.kind == "map"} - {None}
        if sides == {LEFT} and not operator.operator.fn.keyed:
            feeds[name] = (_unkeyed_input(name, operator, steps), gate)
            continue
        if sides == {LEFT}:
            chain = stage.chain
            head = chain[0] if len(chain) == 1 else None
            if head is None or input_side(head.fn) != LEFT or len(head.children) != 1:
                raise ValueError(
                    f"input channel {name!r} is not keyed right away: on a cluster, key the channel's "
                    "records first (key_by('field'), key_by(position) or key_by(a function)), then "
                    "connect the broadcast stream"
                )
            key = keyed_input_selector(operator.operator.key.selector)
            if isinstance(key, (str, int)) and not isinstance(key, bool):
                feeds[name] = (KeyRoute(field=key, operator=operator.name), gate)
            else:
                feeds[name] = (KeyRoute(selector=key, operator=operator.name), gate)
            continue
        for step, parent in steps:
            side = input_side(parent.fn) if parent is not None else None
            if step.kind == "to_gate" and (step.gate not in gates or side != RIGHT):
                raise ValueError(
                    f"input channel {name!r} feeds operator {step.name!r} besides being broadcast: on a "
                    "cluster every node takes every row of a broadcast channel, so it may feed nothing else"
                )
            if step.kind in ("to_sink", "to_chained_sink", "side"):
                raise ValueError(
                    f"input channel {name!r} is broadcast and also written to a sink: on a cluster every "
                    "node takes every row of a broadcast channel, so each node would write each record"
                )
        feeds[name] = (BROADCAST, gate)
    return feeds


def _unkeyed_input(name: str, operator, steps) -> KeyRoute:
    """The route of a channel feeding a non-keyed broadcast operator: any node may take any of its
    rows (the operator keeps no keyed state; every node holds the broadcast state), so they spread
    over the nodes by a hash of the whole row (``ROW``), and may pass stateless steps and feed
    sinks on the way; but no other keyed operator, which would need them by its key."""
    for step, _parent in steps:
        if step.kind == "to_gate" and step.gate != operator.input_gate:
            raise ValueError(
                f"input channel {name!r} feeds operator {step.name!r} besides the non-keyed broadcast "
                f"operator {operator.name!r}: on a cluster its rows go to any node, so it may feed no "
                "keyed operator; read it in a job of its own"
            )
    return KeyRoute(field=ROW, operator=operator.name)


def _walk_steps(steps, parent=None):
    for step in steps:
        yield step, parent
        yield from _walk_steps(step.children, step)
