"""Channels: Python code feeds a running job and reads its results while it runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import defaultdict

import pyarrow as pa
import pytest

from stretch import channels
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.runtime.channel_log import ChannelLog
from stretch.runtime.state_dir import channel_dir

PAIR = Types.TUPLE([Types.STRING(), Types.LONG()])


def start(name="channels job", parallelism=2):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    ds = env.from_source(ChannelSource("clicks", PAIR), None, "clicks")
    ds.key_by(lambda r: r[0]).sum(1).sink_to(ChannelSink("totals"))
    return env.execute_async(name)


def rolling(records):
    acc, out = {}, []
    for k, v in records:
        acc[k] = acc.get(k, 0) + v
        out.append((k, acc[k]))
    return out


def by_key(rows):
    d = defaultdict(list)
    for k, v in rows:
        d[k].append(v)
    return dict(d)


def test_write_while_running_then_read_everything_in_key_order():
    client = start()
    writer = channels.open_writer(client, "clicks")
    sent = []
    for i in range(20):
        batch = [(f"u{j % 5}", i * 100 + j) for j in range(50)]
        writer.write(batch)
        sent += batch
    writer.write(
        pa.RecordBatch.from_pylist(
            [{"f0": "u1", "f1": 7}], schema=pa.schema([("f0", pa.large_string()), ("f1", pa.int64())])
        )
    )
    sent.append(("u1", 7))
    writer.end()
    got = list(channels.open_reader(client, "totals"))
    assert client.wait().name == "FINISHED"
    assert by_key(got) == by_key(rolling(sent))


def test_batches_read_stay_valid_after_the_channel_reuses_its_memory():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.engine_config.gate_bytes = env.engine_config.sink_gate_bytes = 1 << 20
    ds = env.from_source(ChannelSource("clicks", PAIR), None, "clicks")
    ds.key_by(lambda r: r[0]).sum(1).sink_to(ChannelSink("totals"))
    client = env.execute_async("small gates")
    writer, reader = channels.open_writer(client, "clicks"), channels.open_reader(client, "totals")
    sent, kept = [], []
    for i in range(40):  # about 4 MB of results through a 1 MB gate
        batch = [(f"u{j % 97}", i * 5000 + j) for j in range(5000)]
        writer.write(batch)
        sent += batch
        kept.append(reader.read_batch())
    writer.end()
    while (b := reader.read_batch()) is not None:
        kept.append(b)
    assert client.wait().name == "FINISHED"
    got = [row for b in kept for row in zip(*(c.to_pylist() for c in b.columns[:2]))]
    assert by_key(got) == by_key(rolling(sent))


def test_a_second_process_writes_by_job_name():
    client = start("job fed from elsewhere")
    code = textwrap.dedent(
        """
        from stretch import channels
        w = channels.open_writer("job fed from elsewhere", "clicks")
        w.write([("x", 1), ("y", 2), ("x", 3)])
        w.end()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    got = list(channels.open_reader(client, "totals"))
    assert by_key(got) == {"x": [1, 4], "y": [2]}
    client.wait()


def test_channel_errors_are_clear():
    client = start()
    try:
        with pytest.raises(LookupError, match="no channel 'nope'"):
            channels.open_writer(client, "nope")
        writer = channels.open_writer(client, "clicks")
        with pytest.raises(TypeError, match="expected LONG"):
            writer.write([("a", "not a number")])
        bad = pa.record_batch({"f0": ["a"], "f1": [1.5]})
        with pytest.raises(ValueError, match="does not match channel 'clicks'"):
            writer.write(bad)
        with pytest.raises(LookupError, match="no running stretch job"):
            channels.open_writer("no-such-job", "clicks")
        writer.write([("a", 1)])
        writer.end()
        assert list(channels.open_reader(client, "totals")) == [("a", 1)]
    finally:
        client.wait()


@pytest.mark.parametrize("direct", [False, True])
def test_input_channels_keep_a_durable_log_in_gate_order_across_runs(direct):
    """What writers append is logged in the order the job reads it; a second run of the same job
    name continues the log's offsets."""
    name = f"logged input {'direct' if direct else 'via a source task'}"
    sent_by_run, starts = [], []
    for run in range(2):
        env = StreamExecutionEnvironment.get_execution_environment()
        env.set_parallelism(2)
        clicks = env.from_source(ChannelSource("clicks", PAIR), None, "clicks")
        (clicks.key_by(0) if direct else clicks.key_by(lambda r: r[0])).sum(1).sink_to(ChannelSink("totals"))
        client = env.execute_async(name)
        plan = client._coordinator.plan
        assert any(s.direct for s in plan.stages) == direct
        log = ChannelLog(channel_dir(name, "clicks", "in"), create=False)
        starts.append(log.end_offset)
        writer = channels.open_writer(client, "clicks")
        sent = [
            [(f"u{(run * 7 + i * 3 + j) % 5}", run * 1000 + i * 10 + j) for j in range(1 + i % 4)]
            for i in range(30)
        ]
        for batch in sent:
            writer.write(batch)
        writer.end()
        assert len(list(channels.open_reader(client, "totals"))) == sum(map(len, sent))
        assert client.wait().name == "FINISHED"
        sent_by_run.append([r for b in sent for r in b])
    log = ChannelLog(channel_dir(name, "clicks", "in"), create=False)
    assert log.ended and starts[1] == starts[0] + 30
    for run, start in enumerate(starts):
        end = start + 30
        logged = [(r["f0"], r["f1"]) for b in log.read(start, end) for r in b.to_pylist()]
        assert logged == sent_by_run[run]


def test_an_input_channel_that_is_not_durable_keeps_no_log():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.from_source(ChannelSource("clicks", PAIR, durable=False), None, "clicks").key_by(lambda r: r[0]).sum(
        1
    ).sink_to(ChannelSink("totals"))
    client = env.execute_async("input without a log")
    writer = channels.open_writer(client, "clicks")
    writer.write([("a", 1), ("a", 2)])
    writer.end()
    assert list(channels.open_reader(client, "totals")) == [("a", 1), ("a", 3)]
    assert client.wait().name == "FINISHED"
    assert not channel_dir("input without a log", "clicks", "in").exists()
    assert channel_dir("input without a log", "totals").exists()


def test_two_sinks_into_one_channel_are_refused():
    env = StreamExecutionEnvironment.get_execution_environment()
    ds = env.from_collection([("a", 1)], PAIR)
    ds.sink_to(ChannelSink("same"))
    ds.map(lambda r: r, PAIR).sink_to(ChannelSink("same"))
    with pytest.raises(Exception, match="two sinks write to channel 'same'"):
        env.execute("two sinks one channel")
