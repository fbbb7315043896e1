"""What a node accepts to run: jobs whose keyed operators are fed straight by channels keyed by a
field or a key selector function."""

from __future__ import annotations

import pytest

from stretch.cluster.key_routes import KeyRoute
from stretch.cluster.node_plans import cluster_inputs
from stretch.cluster.rekey_plans import split_rekeys
from stretch.cluster.source_plans import split_sources
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from tests.cluster.jobs import PAIR, count_sum_job


def plan_of(env: StreamExecutionEnvironment):
    plan, _config = env._compile(env._sinks)
    return plan


def test_a_job_keyed_by_a_field_of_its_channel_runs_on_a_cluster():
    assert cluster_inputs(plan_of(count_sum_job())) == {"in": KeyRoute(field=0, operator="counts")}


def test_a_job_keyed_by_a_function_runs_on_a_cluster_routed_by_that_function():
    env = StreamExecutionEnvironment.get_execution_environment()

    def first(r):
        return r[0]

    env.from_source(ChannelSource("in", PAIR), None, "in").key_by(first).reduce(
        lambda a, b: (a[0], a[1] + b[1])
    ).name("totals").sink_to(ChannelSink("out"))
    assert cluster_inputs(plan_of(env)) == {"in": KeyRoute(selector=first, operator="totals")}


def test_a_channel_that_is_not_keyed_right_away_is_refused_with_the_reason():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.from_source(ChannelSource("in", PAIR), None, "in").map(lambda r: r).key_by(0).reduce(
        lambda a, b: (a[0], a[1] + b[1])
    ).sink_to(ChannelSink("out"))
    with pytest.raises(ValueError, match="not keyed right away"):
        cluster_inputs(plan_of(env))


def test_a_job_that_rekeys_is_routed_once_split_and_one_reading_no_channel_is_refused():
    env = StreamExecutionEnvironment.get_execution_environment()
    (
        env.from_source(ChannelSource("in", PAIR), None, "in")
        .key_by(0)
        .reduce(lambda a, b: (a[0], a[1] + b[1]))
        .key_by(1)
        .reduce(lambda a, b: a)
        .sink_to(ChannelSink("out"))
    )
    with pytest.raises(ValueError, match="not routed by across nodes"):  # until split_rekeys cuts it
        cluster_inputs(plan_of(env))
    routes = cluster_inputs(split_rekeys(plan_of(env), {"job": "j", "address": "/x"})[0])
    assert {channel: route.field for channel, route in routes.items()} == {
        "in": 0,
        "Keyed Reduce->Keyed Reduce-2": 1,
    }
    env = StreamExecutionEnvironment.get_execution_environment()
    env.from_collection([("a", 1)], PAIR).key_by(0).reduce(lambda a, b: a).sink_to(ChannelSink("out"))
    with pytest.raises(ValueError, match="not an input channel"):  # until split_sources reads it into one
        cluster_inputs(plan_of(env))
    routes = cluster_inputs(split_sources(plan_of(env))[0])
    assert {channel: route.field for channel, route in routes.items()} == {"Collection Source": 0}


def test_an_event_time_channel_is_routed_with_its_watermark_strategy_for_the_writers():
    from stretch.common import Duration, WatermarkStrategy

    env = StreamExecutionEnvironment.get_execution_environment()
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(5)).with_timestamp_assigner(
        "f1"
    )
    env.from_source(ChannelSource("in", PAIR), strategy, "in").key_by(0).sum(1).sink_to(ChannelSink("out"))
    (route,) = cluster_inputs(plan_of(env)).values()
    assert route.field == 0 and route.watermarks == strategy


def test_a_strategy_without_timestamps_leaves_the_channel_without_event_time():
    from stretch.common import WatermarkStrategy

    env = StreamExecutionEnvironment.get_execution_environment()
    strategy = WatermarkStrategy.for_monotonous_timestamps()  # no assigner: no timestamps, no watermarks
    env.from_source(ChannelSource("in", PAIR), strategy, "in").key_by(0).sum(1).sink_to(ChannelSink("out"))
    assert [r.watermarks for r in cluster_inputs(plan_of(env)).values()] == [None]


def test_an_event_time_channel_not_keyed_right_after_its_strategy_is_refused():
    from stretch.common import WatermarkStrategy

    env = StreamExecutionEnvironment.get_execution_environment()
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("f1")
    (
        env.from_source(ChannelSource("in", PAIR), strategy, "in")
        .map(lambda r: r, PAIR)
        .key_by(0)
        .sum(1)
        .sink_to(ChannelSink("out"))
    )
    with pytest.raises(ValueError, match=r"not keyed right away.*right after its watermark strategy"):
        cluster_inputs(plan_of(env))


def test_a_band_join_is_refused_saying_why():
    from tests.datastream.test_joins import RECORD, band, strategy

    env = StreamExecutionEnvironment.get_execution_environment()
    a = env.from_source(ChannelSource("a", RECORD), strategy(), "a")
    b = env.from_source(ChannelSource("b", RECORD), strategy(), "b")
    band(15)(a, b).sink_to(ChannelSink("out"))
    with pytest.raises(ValueError, match="is a band join: it pairs elements across keys"):
        cluster_inputs(plan_of(env))
