"""Event time on a cluster: each writer is an input split with its own watermark, every node hears
every writer, a node's watermark is the minimum over its live writers; windows, late data, joins
and timers give what the plain-Python Flink model (tests.datastream.flink_windows) gives, at 1, 2
and 3 nodes."""

from __future__ import annotations

import pytest

from stretch.cluster import StretchCluster
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import OutputTag, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.window import TumblingEventTimeWindows
from tests.datastream.flink_windows import run, tumbling
from tests.datastream.test_window_aggregates import batches_of

RECORD = Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG()])  # key, event time (ms), value
DELAY = 20


def strategy(delay=DELAY):
    return WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(delay)).with_timestamp_assigner(
        "f1"
    )


def tumbling_counts(parallelism=2):
    """W2's shape: per key, a count per 25 ms tumbling window; late rows to channel ``late``."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    tag = OutputTag("late", RECORD)
    clicks = env.from_source(ChannelSource("in", RECORD), strategy(), "in")
    windows = clicks.key_by("f0").window(TumblingEventTimeWindows.of(Time.milliseconds(25)))
    counts = windows.side_output_late_data(tag).count()
    counts.sink_to(ChannelSink("out"))
    counts.get_side_output(tag).sink_to(ChannelSink("late"))
    return env


def model_counts(batches):
    """The windows one writer's batches fire and the rows that are late (the watermark before a
    batch judges its rows; it moves after each batch)."""
    fired, late = run(batches, lambda r: r[0], lambda r: r[1], assign=tumbling(25), result=len, delay=DELAY)
    return sorted(fired), sorted(late)


def results(client, channel):
    return sorted(tuple(r) for r in client.open_reader(channel))


@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_tumbling_windows_with_late_data_match_one_machine(nodes, tmp_path):
    batches = batches_of(1)
    want, late = model_counts(batches)
    assert late
    with StretchCluster.local(nodes=nodes, directory=tmp_path / "cluster") as cluster:
        client = tumbling_counts().execute_async("w2", cluster=cluster)
        with client.writer("in") as writer:
            for i, batch in enumerate(batches):
                writer.write(batch, query="q", batch=i)
        client.end("in")
        client.wait()
        assert results(client, "out") == want
        assert results(client, "late") == late
