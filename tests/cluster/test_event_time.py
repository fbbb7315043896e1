"""Event time on a cluster: each writer is an input split with its own watermark, every node hears
every writer, a node's watermark is the minimum over its live writers; windows, late data, joins
and timers give what the plain-Python Flink model (tests.datastream.flink_windows) gives, at 1, 2
and 3 nodes."""

from __future__ import annotations

import threading
import time

import pytest

from stretch import channels
from stretch.cluster import StretchCluster
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.common.batch_decoding import from_batch
from stretch.datastream import OutputTag, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.window import (
    EventTimeSessionWindows,
    SlidingEventTimeWindows,
    TumblingEventTimeWindows,
)
from tests.cluster.test_recovery import kill, wait_for
from tests.datastream import flink_joins
from tests.datastream import test_joins as joins
from tests.datastream import test_timers as timers
from tests.datastream.flink_windows import by_key, run, sliding, tumbling
from tests.datastream.test_window_aggregates import batches_of
from tests.datastream.test_windows import Describe

RECORD = Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG()])  # key, event time (ms), value
DELAY = 20
# Each test runs at 1, 2 and 3 nodes. The default run keeps 2 nodes (rows and watermarks cross
# nodes there); 1 and 3 nodes are long runs (`pytest -m long`), to keep the suite within its time.
NODE_COUNTS = [pytest.param(1, marks=pytest.mark.long), 2, pytest.param(3, marks=pytest.mark.long)]


def strategy(delay=DELAY):
    return WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(delay)).with_timestamp_assigner(
        "f1"
    )


def tumbling_counts(parallelism=2, max_parallelism=128, watermarks=None):
    """W2's shape: per key, a count per 25 ms tumbling window; late rows to channel ``late``."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.set_max_parallelism(max_parallelism)
    tag = OutputTag("late", RECORD)
    clicks = env.from_source(ChannelSource("in", RECORD), watermarks or strategy(), "in")
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


@pytest.mark.parametrize("nodes", NODE_COUNTS)
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


def stream(writer, batches, hold_at, pause=0.01):
    """Write ``batches`` from a thread (a micro-batch each) while node changes go on: from batch
    ``hold_at`` on it waits for the returned ``done`` event, so the changes happen mid-stream. The
    thread, ``done``, and the errors met."""
    started, done, errors = threading.Event(), threading.Event(), []

    def run_():
        try:
            for i, batch in enumerate(batches):
                if i == hold_at:
                    done.wait(120)
                writer.write(batch, query="q", batch=i)
                started.set()
                time.sleep(pause)
        except BaseException as e:
            errors.append(e)
            started.set()

    feeder = threading.Thread(target=run_)
    feeder.start()
    started.wait(60)
    return feeder, done, errors


@pytest.mark.parametrize("nodes", NODE_COUNTS)
def test_tumbling_windows_fire_once_on_their_owner_through_nodes_added_and_removed(nodes, tmp_path):
    """Open windows and their timers move with their key groups while rows stream in: each fires
    once, on the node owning its key group then; late rows are judged as one machine judges them."""
    batches = batches_of(2, n_batches=60)
    want, late = model_counts(batches)
    with StretchCluster.local(
        nodes=nodes, directory=tmp_path / "cluster", max_parallelism=32, step=8
    ) as cluster:
        client = tumbling_counts(max_parallelism=32).execute_async("w2-moves", cluster=cluster)
        with client.writer("in") as writer:
            feeder, done, errors = stream(writer, batches, hold_at=45)
            assert cluster.add_node().key_groups_moved > 0
            cluster.remove_node("node-0")
            done.set()
            feeder.join(120)
            assert not errors, errors
        client.end("in")
        client.wait()
        assert results(client, "out") == want
        assert results(client, "late") == late


def two_writers(client, batches):
    """Side 0 of each batch through a writer of channel ``a``, side 1 through one of ``b``."""
    with client.writer("a") as a, client.writer("b") as b:
        for i, batch in enumerate(batches):
            for side, writer in ((0, a), (1, b)):
                rows = [r for r in batch if r[0] == side]
                if rows:
                    writer.write(rows, query="q", batch=i)
    client.end("a")
    client.end("b")
    client.wait()


def two_channels(build, max_parallelism=128):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.set_max_parallelism(max_parallelism)
    a = env.from_source(ChannelSource("a", joins.RECORD), joins.strategy(), "a")
    b = env.from_source(ChannelSource("b", joins.RECORD), joins.strategy(), "b")
    build(a, b).sink_to(ChannelSink("out"))
    return env


@pytest.mark.parametrize("nodes", NODE_COUNTS)
def test_a_window_join_of_two_writers_matches_one_machine(nodes, tmp_path):
    """Each input comes from a writer of its own: the join's watermark is the smaller of the two
    channels' (nothing is late, so the windows are those of the model, all complete)."""
    batches = joins.batches_of(n_batches=20, seed=12, late_share=0)
    assigner = TumblingEventTimeWindows.of(Time.milliseconds(25))
    env = two_channels(
        lambda a, b: (
            a.join(b).where(lambda r: r[1]).equal_to(lambda r: r[1]).window(assigner).apply(joins.pair)
        )
    )
    with StretchCluster.local(nodes=nodes, directory=tmp_path / "cluster") as cluster:
        client = env.execute_async("window-join", cluster=cluster)
        two_writers(client, batches)
        got = by_key(results(client, "out"))
    want = flink_joins.window_join(batches, joins.pair, 10**9, assign=tumbling(25))
    assert sum(len(outs) for *_, outs in want) > 100
    assert got == {k: sorted(v) for k, v in joins.join_outputs(want, True).items()}


@pytest.mark.parametrize("nodes", NODE_COUNTS)
def test_a_co_group_of_two_writers_in_session_windows_matches_one_machine(nodes, tmp_path):
    batches = joins.batches_of(seed=11, late_share=0)
    assigner = EventTimeSessionWindows.with_gap(Time.milliseconds(4))
    env = two_channels(
        lambda a, b: a.co_group(b).where(1).equal_to("f1").window(assigner).apply(joins.Sides())  # fields
    )
    with StretchCluster.local(nodes=nodes, directory=tmp_path / "cluster") as cluster:
        client = env.execute_async("co-group", cluster=cluster)
        two_writers(client, batches)
        got = results(client, "out")
    fired = flink_joins.co_group(batches, joins.Sides().co_group, 10**9, gap_of=lambda r: 4)
    assert any(not outs[0][1] for *_, outs in fired) and any(not outs[0][2] for *_, outs in fired)
    assert got == sorted(o for *_, outs in fired for o in outs)


@pytest.mark.parametrize("nodes", NODE_COUNTS)
def test_an_interval_join_of_two_writers_matches_one_machine(nodes, tmp_path):
    batches = joins.batches_of(seed=4, late_share=0)
    env = two_channels(joins.interval(-5, 10))
    with StretchCluster.local(nodes=nodes, directory=tmp_path / "cluster") as cluster:
        client = env.execute_async("interval-join", cluster=cluster)
        two_writers(client, batches)
        got = results(client, "out")
    pairs, late_left, late_right = flink_joins.interval_join(batches, -5, 10, joins.DELAY)
    assert not late_left and not late_right and len(pairs) > 100
    assert got == sorted((a, b, a[2], b[2], ts) for a, b, ts in pairs)


@pytest.mark.parametrize("nodes", NODE_COUNTS[1:])
def test_tumbling_windows_through_a_node_killed_mid_stream(nodes, tmp_path):
    """A node killed after a checkpoint: its key groups' open windows and timers restore on the
    others from the checkpoint, the rows it took since replay from its journal, judged late or not
    by the watermark they met there; each window fires once, late rows show once."""
    batches = batches_of(3, n_batches=50)
    want, late = model_counts(batches)
    with StretchCluster.local(
        nodes=nodes, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "checkpoints"
    ) as cluster:
        env = tumbling_counts()
        env.enable_checkpointing()  # on demand: the test says when
        client = env.execute_async("w2-kill", cluster=cluster)
        with client.writer("in") as writer:
            for i, batch in enumerate(batches):
                writer.write(batch, query="q", batch=i)
                if i == 15:
                    client.trigger_checkpoint()
                if i == 35:  # node-1 took batches 16..35 only into its journal
                    kill(cluster, "node-1")
                    wait_for(lambda: cluster.recoveries)
        client.end("in")
        client.wait(120)
        assert results(client, "out") == want
        assert results(client, "late") == late


def fired_so_far(job, nodes, wait=1.0):
    """The windows every node has fired by now (a running job's output logs, read to their tail
    once nothing more came for ``wait`` seconds, or to their end: a removed node's)."""
    got = []
    for node in nodes:
        reader = channels.open_reader(f"{job}@{node}", "out")
        try:
            while (batch := reader.read_batch(timeout=wait)) is not None:  # None: a log that ended
                got.extend(tuple(r) for r in from_batch(batch))
        except TimeoutError:
            pass
        finally:
            reader.close()
    return sorted(got)


@pytest.mark.parametrize("nodes", NODE_COUNTS)
@pytest.mark.parametrize("idleness", [pytest.param(None, marks=pytest.mark.long), 0.3])
def test_an_idle_writer_holds_time_back_unless_idleness_lets_it_go(idleness, nodes, tmp_path):
    """Two writers of one channel: one writes on, the other wrote a little early on and then
    nothing. Without idleness the silent one holds every node's watermark back until it closes;
    with ``with_idleness`` it stops holding it back after the timeout, while still open."""
    batches = batches_of(5, n_batches=20, late_share=0)  # nothing late, however the writers interleave
    early = [[("k0", 1, 7)]]  # the silent writer's: its watermark stays at 1 - 20 - 1
    watermarks = strategy()
    if idleness is not None:
        watermarks = watermarks.with_idleness(Duration.of_millis(int(idleness * 1000)))
    name = f"idle-{nodes}-{idleness}"
    with StretchCluster.local(nodes=nodes, directory=tmp_path / "cluster") as cluster:
        client = tumbling_counts(watermarks=watermarks).execute_async(name, cluster=cluster)
        silent = client.writer("in")
        silent.write(early[0], query="silent", batch=0)
        with client.writer("in") as busy:
            for i, batch in enumerate(batches):
                busy.write(batch, query="busy", batch=i)
        wm = max(r[1] for b in batches for r in b) - DELAY - 1  # the busy writer's watermark
        due = [w for w in model_counts(early + batches)[0] if w[2] - 1 <= wm]
        time.sleep(idleness or 0)
        if idleness is None:
            assert fired_so_far(name, cluster.nodes) == []
            silent.close()  # gone for good: dropped from every node's minimum
        else:
            assert fired_so_far(name, cluster.nodes) == due  # idle, though still open
            silent.close()
        assert fired_so_far(name, cluster.nodes) == due
        client.end("in")
        client.wait()
        assert results(client, "out") == model_counts(early + batches)[0]


LATE = OutputTag("late", RECORD)
WINDOW_KINDS = {  # channel -> (what its keyed operator does, the model's windows and late rows)
    "sliding": (
        lambda ks: ks.window(
            SlidingEventTimeWindows.of(Time.milliseconds(30), Time.milliseconds(10))
        ).process(Describe()),
        dict(assign=sliding(30, 10)),
    ),
    "session": (
        lambda ks: ks.window(EventTimeSessionWindows.with_gap(Time.milliseconds(6))).process(Describe()),
        dict(gap_of=lambda r: 6),
    ),
    "lateness": (  # kept 10 ms more, re-fired per late row; later rows to the side output
        lambda ks: (
            ks.window(TumblingEventTimeWindows.of(Time.milliseconds(25)))
            .allowed_lateness(10)
            .side_output_late_data(LATE)
            .process(Describe())
        ),
        dict(assign=tumbling(25), lateness=10),
    ),
}


def windows_and_timers():
    """One job, a channel per kind of keyed event-time operator, each keyed by a function."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    for channel, (build, _model) in WINDOW_KINDS.items():
        keyed = env.from_source(ChannelSource(channel, RECORD), strategy(), channel).key_by(lambda r: r[0])
        out = build(keyed)
        out.sink_to(ChannelSink(f"{channel}-out"))
        if channel == "lateness":
            out.get_side_output(LATE).sink_to(ChannelSink("lateness-late"))
    keyed = env.from_source(ChannelSource("timers", RECORD), timers.strategy(), "timers").key_by(
        lambda r: r[0]
    )
    keyed.process(timers.Timers()).sink_to(ChannelSink("timers-out"))
    keyed = env.from_source(ChannelSource("count", RECORD), None, "count").key_by(lambda r: r[0])
    keyed.count_window(4).reduce(lambda a, b: (a[0], a[1], a[2] + b[2])).sink_to(ChannelSink("count-out"))
    return env


@pytest.mark.long  # the suite keeps within its time: the tumbling and join tests cover 2 nodes
@pytest.mark.parametrize("nodes", NODE_COUNTS)
def test_sliding_session_late_count_windows_and_timers_match_one_machine(nodes, tmp_path):
    batches = batches_of(6, n_batches=10, per_batch=80, keys=7)
    timed = timers.batches_of(3, n_batches=10)
    with StretchCluster.local(nodes=nodes, directory=tmp_path / "cluster") as cluster:
        client = windows_and_timers().execute_async("kinds", cluster=cluster)
        for channel in [*WINDOW_KINDS, "count", "timers"]:
            with client.writer(channel) as writer:
                for i, batch in enumerate(timed if channel == "timers" else batches):
                    writer.write(batch, query="q", batch=i)
            client.end(channel)
        client.wait()
        got = {
            channel: list(client.open_reader(f"{channel}-out"))
            for channel in [*WINDOW_KINDS, "count", "timers"]
        }
        late = results(client, "lateness-late")
    for channel, (_build, model) in WINDOW_KINDS.items():
        want, want_late = run(
            batches,
            lambda r: r[0],
            lambda r: r[1],
            result=lambda rs: sorted(r[2] for r in rs),
            delay=DELAY,
            **model,
        )
        assert by_key(tuple(r) for r in got[channel]) == by_key(want), channel
        if channel == "lateness":
            assert late == sorted(want_late)
    assert by_key(tuple(r) for r in got["timers"]) == by_key(timers.model(timed))
    counts = []
    for key in {r[0] for b in batches for r in b}:
        rows = [r for b in batches for r in b if r[0] == key]
        counts += [(key, rows[i][1], sum(r[2] for r in rows[i : i + 4])) for i in range(0, len(rows) - 3, 4)]
    assert sorted(tuple(r) for r in got["count"]) == sorted(counts)


@pytest.mark.long  # the suite keeps within its time: run with -m long
@pytest.mark.parametrize("nodes", NODE_COUNTS)
def test_a_collection_with_a_watermark_strategy_is_one_split_with_one_machines_watermarks(nodes, tmp_path):
    """The driver reads the collection as one split, in the chunks one engine reads it in (its
    watermark moves after each), and sends them through a writer of its own."""
    rows = [r for batch in batches_of(7, n_batches=15, per_batch=10_000) for r in batch]
    chunks = [rows[i : i + 65536] for i in range(0, len(rows), 65536)]
    assert len(chunks) == 3
    want, late = model_counts(chunks)
    assert late
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    stamped = env.from_collection(rows, RECORD).assign_timestamps_and_watermarks(strategy())
    counts = (
        stamped.key_by("f0")
        .window(TumblingEventTimeWindows.of(Time.milliseconds(25)))
        .side_output_late_data(LATE)
    ).count()
    counts.sink_to(ChannelSink("out"))
    counts.get_side_output(LATE).sink_to(ChannelSink("late"))
    with StretchCluster.local(nodes=nodes, directory=tmp_path / "cluster") as cluster:
        client = env.execute_async("collection-windows", cluster=cluster)
        client.wait(120)
        assert results(client, "out") == want
        assert results(client, "late") == late


@pytest.mark.long  # 15 s: the suite keeps within its time
def test_a_node_that_joins_hears_of_a_silent_writer_before_any_rows_come(tmp_path):
    """A writer wrote once, early, and stays open: a node added afterwards starts from a member's
    view of the writers, so it holds its windows back too, though that writer never sent it
    anything; when the writer closes, every node fires them."""
    batches = batches_of(8, n_batches=12, late_share=0)
    early = [[("k0", 1, 7)]]
    with StretchCluster.local(nodes=1, directory=tmp_path / "cluster", max_parallelism=32) as cluster:
        client = tumbling_counts(max_parallelism=32).execute_async("joined", cluster=cluster)
        silent = client.writer("in")
        silent.write(early[0], query="silent", batch=0)
        assert cluster.add_node().key_groups_moved > 0
        with client.writer("in") as busy:
            for i, batch in enumerate(batches):
                busy.write(batch, query="busy", batch=i)
        assert fired_so_far("joined", cluster.nodes) == []
        silent.close()
        wm = max(r[1] for b in batches for r in b) - DELAY - 1
        due = [w for w in model_counts(early + batches)[0] if w[2] - 1 <= wm]
        assert fired_so_far("joined", cluster.nodes) == due
        client.end("in")
        client.wait()
        assert results(client, "out") == model_counts(early + batches)[0]
