"""A channel's source reads the small entries queued in its gate as one batch only where how its
input is cut into batches is not seen downstream (``channel_source.cut_unseen``)."""

from __future__ import annotations

import pytest

from stretch.common import Duration, Types, WatermarkStrategy
from stretch.datastream import KeyedBroadcastProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.datastream.output_tag import OutputTag
from stretch.datastream.state import MapStateDescriptor
from stretch.plan.stages import compile_plan
from stretch.runtime.channel_source import cut_unseen

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])
STRATEGY = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(5)).with_timestamp_assigner("f1")


def keyed(env, source):
    source.key_by(lambda r: r[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).sink_to(DiscardingSink())


def mapped_then_keyed(env, source):
    keyed(env, source.map(lambda r: (r[0], 2 * r[1]), output_type=PAIR).filter(lambda r: r[1] > 0))


def timestamped(env, source):
    keyed(env, source.assign_timestamps_and_watermarks(STRATEGY))


def split_to_broadcast(env, source):
    rules = source.filter(lambda r: r[0] == 1).broadcast(
        MapStateDescriptor("rules", Types.LONG(), Types.LONG())
    )
    events = source.filter(lambda r: r[0] == 0)
    events.key_by(lambda r: r[0]).connect(rules).process(_Nothing(), PAIR).sink_to(DiscardingSink())


def with_side_output(env, source):
    from stretch.datastream.functions import ProcessFunction

    odd = OutputTag("odd", PAIR)

    class Split(ProcessFunction):
        def process_element(self, value, ctx):
            if value[1] % 2:
                yield odd, value
            else:
                yield value

    main = source.process(Split(), PAIR)
    keyed(env, main)
    main.get_side_output(odd).sink_to(DiscardingSink())


class _Nothing(KeyedBroadcastProcessFunction):
    def process_element(self, value, ctx):
        return ()

    def process_broadcast_element(self, value, ctx):
        return ()


@pytest.mark.parametrize(
    "program, joined",
    [
        (keyed, True),
        (mapped_then_keyed, True),
        (timestamped, False),  # a watermark after each batch
        (split_to_broadcast, False),  # a batch's rules and events go to two gates
        (with_side_output, False),
    ],
)
def test_queued_entries_are_joined_only_where_batches_are_not_seen(program, joined):
    env = StreamExecutionEnvironment.get_execution_environment()
    program(env, env.from_source(ChannelSource("in", PAIR, durable=False), None, "in"))
    plan = compile_plan(env._sinks, 1, 128)
    stage = next(s for s in plan.stages if getattr(s.source, "channel_name", None) == "in")
    assert cut_unseen(stage.chain) is joined


def test_a_source_with_a_watermark_strategy_reads_each_batch_alone():
    env = StreamExecutionEnvironment.get_execution_environment()
    keyed(env, env.from_source(ChannelSource("in", PAIR, durable=False), STRATEGY, "in"))
    stage = next(s for s in compile_plan(env._sinks, 1, 128).stages if s.source is not None)
    assert not cut_unseen(stage.chain)
