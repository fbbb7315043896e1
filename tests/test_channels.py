"""Channels: Python code feeds a running job and reads its results while it runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections import defaultdict

import pyarrow as pa
import pytest

from stretch import channels
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
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
        for job in (client, "channels job"):  # the wrong end of a channel: which end it is, and the others
            with pytest.raises(LookupError) as reading:
                channels.open_reader(job, "clicks")
            assert str(reading.value) == (
                "channel 'clicks' is an input channel of the job: write into it with open_writer; "
                "read one of its output channels (totals)"
            )
            with pytest.raises(LookupError) as writing:
                channels.open_writer(job, "totals")
            assert str(writing.value) == (
                "channel 'totals' is an output channel of the job: read it with open_reader; "
                "write into one of its input channels (clicks)"
            )
        writer.write([("a", 1)])
        writer.end()
        assert list(channels.open_reader(client, "totals")) == [("a", 1)]
    finally:
        client.wait()


def test_a_table_built_the_ordinary_way_fits_a_string_channel():
    """pyarrow builds text with 32-bit offsets, a STRING field is stored with 64-bit ones: the
    writer widens them (and still refuses a column of another type)."""
    client = start("channels of plain arrow")
    try:
        writer = channels.open_writer(client, "clicks")
        records = [("a", 1), ("b", 2), ("a", 3)]
        writer.write(pa.table({"f0": [k for k, _ in records], "f1": [v for _, v in records]}))
        with pytest.raises(ValueError, match="does not match channel 'clicks'"):
            writer.write(pa.table({"f0": ["a"], "f1": [1.5]}))
        writer.end()
        assert by_key(list(channels.open_reader(client, "totals"))) == by_key(rolling(records))
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


def test_a_read_by_job_name_after_its_runs_gives_the_last_runs_results_only():
    """A script run twice under one name: a reader by name after the runs reads the second run's
    results, not the first run's again; ``from_offset`` still reaches every run's."""
    name = "run twice"
    runs = []
    for run in range(2):
        client = start(name)
        writer = channels.open_writer(client, "clicks")
        sent = [(f"u{(run + i) % 3}", run * 100 + i) for i in range(12)]
        for i in range(0, len(sent), 4):
            writer.write(sent[i : i + 4])
        writer.end()
        assert client.wait(60).name == "FINISHED"
        runs.append(sent)
    got = list(channels.open_reader(name, "totals"))
    assert by_key(got) == by_key(rolling(runs[1]))  # each run's job starts from empty state
    every = list(channels.open_reader(name, "totals", from_offset=0))
    assert sorted(every) == sorted(rolling(runs[0]) + rolling(runs[1]))


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


class _FailOnNegative(KeyedProcessFunction):
    def process_element(self, value, ctx):
        if value[1] < 0:
            raise ValueError(f"negative value {value[1]}")
        yield value


def _ending_job(name: str, keyed: str):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    if keyed == "checkpointed":
        env.enable_checkpointing(100)
    src = env.from_source(ChannelSource("clicks", Types.TUPLE([Types.LONG(), Types.LONG()])), None, "clicks")
    keyed_stream = src.key_by("f0") if keyed == "field" else src.key_by(lambda r: r[0])
    keyed_stream.process(_FailOnNegative()).sink_to(ChannelSink("out"))
    return env.execute_async(name)


@pytest.mark.parametrize("keyed", ["selector", "field", "checkpointed"])
@pytest.mark.parametrize("ending", ["cancelled", "failed", "finished"])
def test_a_write_to_a_job_that_ended_raises_saying_how_it_ended(ending, keyed):
    name = f"ended {ending} {keyed}"
    client = _ending_job(name, keyed)
    writer, other = channels.open_writer(client, "clicks"), channels.open_writer(name, "clicks")
    writer.write([(1, 1), (2, 2)])
    if ending == "cancelled":
        client.cancel()
    elif ending == "failed":
        writer.write([(3, -1)])
        with pytest.raises(Exception, match="negative value"):
            client.wait(60)
    else:
        writer.end()
        assert client.wait(60).name == "FINISHED"
    for w in (writer, other):
        with pytest.raises(
            RuntimeError, match=f"takes no more records: job '{name}' (was |has )?{ending.removesuffix('ed')}"
        ):
            w.write([(4, 4)])
    if ending == "failed":
        with pytest.raises(RuntimeError, match="negative value -1"):
            other.end()


def test_end_right_after_the_job_failed_says_so_at_once():
    client = _ending_job("end after failure", "selector")
    writer = channels.open_writer("end after failure", "clicks")  # as from another process
    writer.write([(3, -1)])
    while client.get_job_status().result().name == "RUNNING":
        time.sleep(0.01)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed.*negative value -1"):
        writer.end()
    assert time.monotonic() - t0 < 5
    with pytest.raises(Exception, match="negative value"):
        client.wait(60)


def test_null_keys_are_refused_as_in_flink_naming_the_record_whatever_the_batching():
    # a key field: the writer refuses the record before the job sees it
    client = start_keyed_by_field("null key field")
    writer = channels.open_writer(client, "clicks")
    writer.write([("a", 1)])
    with pytest.raises(ValueError, match=r"record 1 .* null key .*\{'f0': None, 'f1': 2\}"):
        writer.write([("b", 5), (None, 2)])
    writer.write([("a", 3)])
    writer.end()
    assert sorted(channels.open_reader(client, "totals")) == [("a", 1), ("a", 4)]
    assert client.wait(60).name == "FINISHED"
    # a key selector: the same records in one write or in two fail the job naming the record
    for batches in ([[(1, 1), (None, 2)]], [[(1, 1)], [(None, 2)]]):
        env = StreamExecutionEnvironment.get_execution_environment()
        env.from_source(ChannelSource("in", None), None, "in").key_by(lambda r: r[0]).map(
            lambda r: r
        ).sink_to(ChannelSink("out"))
        client = env.execute_async("null key selector")
        writer = channels.open_writer(client, "in")
        for b in batches:
            writer.write(b)
        with pytest.raises(Exception, match=r"key selector .* record \(None, 2\).*keys must not be None"):
            client.wait(60)


def start_keyed_by_field(name):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.from_source(ChannelSource("clicks", PAIR), None, "clicks").key_by("f0").sum(1).sink_to(
        ChannelSink("totals")
    )
    return env.execute_async(name)


def test_an_untyped_channel_takes_the_shape_of_its_first_batch():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.from_source(ChannelSource("in"), None, "in").key_by(0).sum(1).sink_to(ChannelSink("out"))
    client = env.execute_async("untyped channel")
    writer = channels.open_writer(client, "in")
    writer.write([(1, 2), (2, 3)])
    with pytest.raises(ValueError, match="does not match channel 'in'"):
        writer.write(pa.record_batch({"a": [1.5]}))
    other = channels.open_writer("untyped channel", "in")  # a second writer: the same shape holds
    with pytest.raises(TypeError):
        other.write([(1, "x")])
    other.write([(1, 5)])
    other.end()
    assert sorted(channels.open_reader(client, "out")) == [(1, 2), (1, 7), (2, 3)]
    assert client.wait(60).name == "FINISHED"
