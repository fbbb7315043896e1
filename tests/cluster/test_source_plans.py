"""A job's sources on a cluster: each is cut where its records enter a keyed operator, the node plan
reads each cut from an input channel of its own, and the feed keeps the source and the steps
before the cut; what a node plan cannot route is refused, saying why."""

from __future__ import annotations

import pyarrow as pa
import pytest

from stretch.cluster.key_routes import ROW, column_of
from stretch.cluster.node_plans import broadcast_channels, cluster_inputs
from stretch.cluster.source_feeder import _Capture
from stretch.cluster.source_plans import DRIVER, NODES, split_sources
from stretch.common import WatermarkStrategy
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import NumberSequenceSource
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.connectors.file_system import FileSource, StreamFormat
from stretch.runtime.batch import Records
from stretch.runtime.chain import Chain
from stretch.runtime.outputs import Outputs
from stretch.state.key_groups import key_groups_of, stable_hash
from tests.cluster.jobs import ALERT, LIMITS, PAIR, RULE, Limit, Threshold


def plan_of(env: StreamExecutionEnvironment):
    plan, _config = env._compile(env._sinks)
    return plan


def routed_by(plan) -> dict:
    """Input channel -> the field a node plan's rows are routed by."""
    return {channel: route.field for channel, route in cluster_inputs(plan).items()}


def run_feed(feed, records) -> dict[str, list]:
    """The feed's steps on ``records``, as its reader runs them: channel -> records at the cut."""
    captures = {i: _Capture() for i in range(len(feed.channels))}
    Chain(feed.steps, feed.name, Outputs({}, captures, {}, 1, lambda n: None)).push(Records(items=records))
    return {feed.channels[i]: c.taken().to_pylist() if c.batches else [] for i, c in captures.items()}


def test_a_collection_with_steps_before_its_key_is_read_by_the_driver_into_a_channel_keyed_right_away():
    env = StreamExecutionEnvironment.get_execution_environment()
    pairs = env.from_collection([("a", 1), ("b", 2), ("a", 3)], PAIR)
    pairs.filter(lambda r: r[1] != 2).map(lambda r: (r[0], 10 * r[1]), PAIR).key_by(0).sum(1).name(
        "sums"
    ).sink_to(ChannelSink("out"))
    node_plan, (feed,) = split_sources(plan_of(env))
    assert routed_by(node_plan) == {"Collection Source": 0}  # a node takes it as any input channel
    (stage,) = [s for s in node_plan.stages if s.kind == "source"]
    assert stage.direct and stage.source.channel_name == "Collection Source"
    assert feed.where == DRIVER and [sid for sid, _ in feed.parts] == ["0"]
    assert run_feed(feed, [("a", 1), ("b", 2), ("a", 3)]) == {
        "Collection Source": [{"f0": "a", "f1": 10}, {"f0": "a", "f1": 30}]
    }


def test_a_source_feeding_two_operators_and_a_broadcast_stream_gets_a_channel_for_each(tmp_path):
    env = StreamExecutionEnvironment.get_execution_environment()
    numbers = env.from_source(NumberSequenceSource(1, 10), None, "numbers").map(
        lambda n: (f"k{n % 3}", n), PAIR
    )
    numbers.key_by(0).sum(1).sink_to(ChannelSink("sums"))
    numbers.key_by(1).sum(1).sink_to(ChannelSink("by-value"))
    rules = env.from_collection([("g0", 5)], RULE).broadcast(LIMITS)
    events = env.from_source(ChannelSource("events", PAIR), None, "events")
    events.key_by(0).connect(rules).process(Threshold(), ALERT).sink_to(ChannelSink("alerts"))
    plan = plan_of(env)
    node_plan, feeds = split_sources(plan)
    assert [f.channels for f in feeds] == [["numbers", "numbers-2"], ["Collection Source"]]
    assert routed_by(node_plan) == {"numbers": 0, "numbers-2": 1, "events": 0}
    assert broadcast_channels(node_plan) == ["Collection Source"]  # every node takes all its rows
    feeding = {
        g: sorted(node_plan.stages[i].name for i in ids) for g, ids in node_plan.gate_producers.items()
    }
    assert sorted(feeding.values()) == [["Collection Source", "events"], ["numbers"], ["numbers-2"]]
    assert [s.id for s in node_plan.stages] == list(range(len(node_plan.stages)))
    assert len(plan.stages) + 1 == len(node_plan.stages)  # the plan given is left as it was
    assert run_feed(feeds[0], [4]) == {
        "numbers": [{"f0": "k1", "f1": 4}],
        "numbers-2": [{"f0": "k1", "f1": 4}],
    }


def test_a_file_source_is_split_by_file_and_read_by_the_nodes_with_no_watermarks(tmp_path):
    for name in ("b.txt", "a.txt", "_hidden.txt"):
        (tmp_path / name).write_text("x\n")
    env = StreamExecutionEnvironment.get_execution_environment()
    files = FileSource.for_record_stream_format(StreamFormat.text_line_format(), str(tmp_path)).build()
    lines = env.from_source(files, WatermarkStrategy.no_watermarks(), "files")
    lines.map(lambda line: (line, 1), PAIR).key_by(0).sum(1).sink_to(ChannelSink("out"))
    node_plan, (feed,) = split_sources(plan_of(env))
    assert feed.where == NODES
    assert [(sid, [p.name for p in part.paths]) for sid, part in feed.parts] == [
        ("0", ["a.txt"]),
        ("1", ["b.txt"]),
    ]
    assert routed_by(node_plan) == {"files": 0}


def test_what_a_cluster_cannot_route_from_a_source_is_refused_saying_why():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.from_collection([("a", 1)], PAIR).map(lambda r: r, PAIR).sink_to(ChannelSink("out"))
    with pytest.raises(ValueError, match="feeds sink 'ChannelSink' without a keyed operator between"):
        split_sources(plan_of(env))
    env = StreamExecutionEnvironment.get_execution_environment()
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("f1")
    env.from_source(NumberSequenceSource(1, 3), strategy, "n").map(lambda n: ("a", n), PAIR).key_by(0).sum(
        1
    ).sink_to(ChannelSink("out"))
    with pytest.raises(ValueError, match="source 'n' has a watermark strategy and steps before its key_by"):
        split_sources(plan_of(env))
    env = StreamExecutionEnvironment.get_execution_environment()
    stamped = (
        env.from_collection([("a", 1)], PAIR)
        .map(lambda r: r, PAIR)
        .assign_timestamps_and_watermarks(strategy)
    )
    stamped.key_by(0).sum(1).sink_to(ChannelSink("out"))
    with pytest.raises(ValueError, match="assigns timestamps and watermarks after other steps"):
        split_sources(plan_of(env))


def test_a_source_with_a_watermark_strategy_keyed_right_away_reads_into_an_event_time_channel():
    env = StreamExecutionEnvironment.get_execution_environment()
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("f1")
    env.from_source(NumberSequenceSource(1, 3), strategy, "n").key_by(0).sum(0).sink_to(ChannelSink("out"))
    plan, (feed,) = split_sources(plan_of(env))
    assert feed.channels == ["n"] and [s.kind for s in feed.steps] == ["to_sink"]
    assert cluster_inputs(plan)["n"].watermarks == strategy


def test_a_row_without_a_key_is_routed_by_the_hash_of_all_its_fields():
    batch = pa.record_batch(
        {"user": ["a", "b", "a"], "n": [1, 2, 1], "__kg": pa.array([0, 0, 0], pa.uint16())}
    )
    kgs = key_groups_of(column_of(batch, ROW), 128)
    assert kgs.tolist() == [
        stable_hash(("a", 1)) % 128,
        stable_hash(("b", 2)) % 128,
        stable_hash(("a", 1)) % 128,
    ]


def test_a_collection_of_events_without_a_key_for_a_broadcast_function_is_routed_by_the_whole_row():
    env = StreamExecutionEnvironment.get_execution_environment()
    rules = env.from_source(ChannelSource("rules", RULE), None, "rules").broadcast(LIMITS)
    env.from_collection([("user-1", 5)], PAIR).connect(rules).process(Limit(), ALERT).sink_to(
        ChannelSink("out")
    )
    node_plan, (feed,) = split_sources(plan_of(env))
    assert routed_by(node_plan) == {"Collection Source": ROW}
    assert broadcast_channels(node_plan) == ["rules"]
    assert run_feed(feed, [("user-1", 5)]) == {"Collection Source": [{"f0": "user-1", "f1": 5}]}
