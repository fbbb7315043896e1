"""Re-keying across nodes: a job keyed by user, then by region, runs on a cluster with the results
of a plain-Python sequential model, per key in order, each row once, through node changes at 1,
2 and 3 nodes (cluster.rekey_plans, cluster.forward_sink, cluster.forward_ends)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from stretch.cluster import StretchCluster
from stretch.cluster.rekey_plans import split_rekeys
from stretch.common import Duration, Time, Types, WatermarkStrategy
from stretch.datastream import OutputTag, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.window import TumblingEventTimeWindows
from tests.cluster.jobs import RegionSequence, RegionWindow, UserTotal
from tests.cluster.test_event_time import fired_so_far, results
from tests.cluster.test_source_plans import plan_of

CLICK = Types.TUPLE([Types.STRING(), Types.STRING(), Types.LONG()])  # user, region, amount
PER_USER = Types.TUPLE([Types.STRING(), Types.STRING(), Types.LONG()])  # region, user, user's total
PER_REGION = Types.TUPLE(
    [Types.STRING(), Types.LONG(), Types.STRING(), Types.LONG()]
)  # region, n, user, total
# The default run keeps 2 nodes (rows cross nodes there); 1 and 3 nodes are long runs.
NODE_COUNTS = [pytest.param(1, marks=pytest.mark.long), 2, pytest.param(3, marks=pytest.mark.long)]


def rekeyed_job(parallelism=2, by_function=False):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    users = env.from_source(ChannelSource("in", CLICK), None, "in").key_by(
        (lambda r: r[0]) if by_function else 0
    )
    per_user = users.process(UserTotal(), PER_USER).name("users")
    regions = per_user.key_by((lambda r: r[0]) if by_function else 0)
    regions.process(RegionSequence(), PER_REGION).name("regions").sink_to(ChannelSink("out"))
    return env


def clicks(n, users=60, regions=7, seed=1):
    rng = random.Random(seed)
    return [
        (f"u{rng.randrange(users)}", f"r{rng.randrange(regions)}", rng.randrange(1, 10)) for _ in range(n)
    ]


def model(rows):
    """The plain-Python sequential job: per user its running total, per region its rows numbered."""
    totals, per_region = {}, {}
    for user, region, amount in rows:
        totals[user] = totals.get(user, 0) + amount
        per_region.setdefault(region, []).append((user, totals[user]))
    return per_region


def check(got, rows):
    """Each region's rows numbered 1..n exactly once, the (user, total) pairs the model's, and
    each user's totals in a region in the model's order (per-key order kept across nodes)."""
    want = model(rows)
    by_region = {}
    for region, n, user, total in got:
        by_region.setdefault(region, []).append((n, user, total))
    assert sorted(by_region) == sorted(want)
    for region, entries in by_region.items():
        entries.sort()
        assert [n for n, _u, _t in entries] == list(range(1, len(want[region]) + 1)), region
        assert sorted((u, t) for _n, u, t in entries) == sorted(want[region]), region
        for user in {u for _n, u, _t in entries}:
            assert [t for _n, u, t in entries if u == user] == [t for u, t in want[region] if u == user]


def run(cluster, rows, env, batches=10, during=None, before_end=lambda: None):
    client = env.execute_async("rekeyed", cluster=cluster)
    size = len(rows) // batches
    with client.writer("in") as writer:
        for i in range(batches):
            writer.write(rows[i * size : (i + 1) * size], query="q", batch=i)
            if during is not None and i == batches // 2:
                during(client, i)
    before_end()
    client.end("in")
    assert set(client.wait(120).values()) == {"FINISHED"}
    return [tuple(r) for r in client.open_reader("out")]


@pytest.mark.parametrize(
    "nodes, by_function",
    [
        pytest.param(1, False, marks=pytest.mark.long),
        (2, True),
        pytest.param(3, False, marks=pytest.mark.long),
    ],
)
def test_a_job_keyed_by_user_then_by_region_matches_the_model(nodes, by_function, tmp_path):
    """Keyed by fields, or by key selector functions (routed by them, node to node)."""
    rows = clicks(4000)
    with StretchCluster.local(nodes=nodes, directory=tmp_path / "cluster") as cluster:
        got = run(cluster, rows, rekeyed_job(by_function=by_function))
    check(got, rows)


@pytest.mark.parametrize("nodes", [pytest.param(n, marks=pytest.mark.long) for n in (1, 2, 3)])
def test_re_keying_through_node_changes_and_rescales_keeps_every_row_once(nodes, tmp_path):
    """Long at every node count: the event-time re-key test below makes the same node changes by
    default."""
    rows = clicks(12000, seed=3)
    with StretchCluster.local(nodes=nodes, directory=tmp_path / "cluster") as cluster:
        changes = []

        def change(client, i):  # while the rows written so far are forwarded between nodes
            changes.append(cluster.add_node())
            client.rescale("users", 3, node=cluster.nodes[-1])  # new writers of the forward
            client.rescale("regions", 1, node=cluster.nodes[-1])
            changes.append(cluster.remove_node(cluster.nodes[0]))

        got = run(cluster, rows, rekeyed_job(), batches=20, during=change)
    assert [r.key_groups_moved > 0 for r in changes] == [True, True]
    check(got, rows)


@pytest.mark.long
def test_re_keying_while_nodes_change_concurrently_with_the_writes(tmp_path):
    rows = clicks(20000, seed=4)
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster") as cluster:
        done = threading.Event()
        changes = []

        def churn():
            changes.append(cluster.add_node())
            changes.append(cluster.remove_node(cluster.nodes[0]))
            done.set()

        thread = threading.Thread(target=churn)
        got = run(
            cluster,
            rows,
            rekeyed_job(),
            batches=40,
            during=lambda client, i: thread.start(),
            before_end=lambda: thread.join(120),
        )
    assert done.is_set() and len(changes) == 2
    check(got, rows)


def test_the_cut_writes_each_edge_into_an_input_channel_of_its_own():
    env = rekeyed_job()
    plan, forwards = split_rekeys(plan_of(env), {"job": "j", "address": "/x"})
    assert [(f.source, f.target, f.channel) for f in forwards] == [("users", "regions", "users->regions")]
    sources = {s.source.channel_name: s for s in plan.stages if s.kind == "source"}
    assert set(sources) == {"in", "users->regions"}
    regions = plan.stage("regions")
    assert plan.gate_producers[regions.input_gate] == [sources["users->regions"].id]
    assert sources["users->regions"].direct  # keyed by a field: writers append straight into the gate


# ---- event time through a forward --------------------------------------------------------------
TIMED_CLICK = Types.TUPLE([Types.STRING(), Types.STRING(), Types.LONG(), Types.LONG()])  # ..., event time
PER_WINDOW = Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG(), Types.LONG()])  # region, start, n, sum
WINDOW_MS, DELAY_MS = 100, 20


def windowed_job(parallelism=2):
    """Per user its running total (the records keep their click's timestamp), then per region a
    100 ms tumbling event-time window of those totals; late ones to channel ``late``."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.set_max_parallelism(32)
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(
        Duration.of_millis(DELAY_MS)
    ).with_timestamp_assigner("f3")
    users = env.from_source(ChannelSource("in", TIMED_CLICK), strategy, "in").key_by(0)
    per_user = users.process(UserTotal(), PER_USER).name("users")
    tag = OutputTag("late", PER_USER)
    windows = per_user.key_by(0).window(TumblingEventTimeWindows.of(Time.milliseconds(WINDOW_MS)))
    out = windows.side_output_late_data(tag).process(RegionWindow(), PER_WINDOW).name("regions")
    out.sink_to(ChannelSink("out"))
    out.get_side_output(tag).sink_to(ChannelSink("late"))
    return env


def timed_clicks(n, start, seed):
    """Clicks whose event times grow 1 ms every 4 rows, each up to 14 ms out of order (within the
    strategy's 20: none is late where it enters)."""
    rng = random.Random(seed)
    return [
        (
            f"u{rng.randrange(60)}",
            f"r{rng.randrange(7)}",
            rng.randrange(1, 10),
            start + i // 4 + rng.randrange(15),
        )
        for i in range(n)
    ]


def windowed_model(rows, late):
    """The plain-Python sequential job: the windows' (region, start, rows, sum of totals), and the
    records of the rows at the indices in ``late`` (written after their windows fired)."""
    totals, windows, late_out = {}, {}, []
    for i, (user, region, amount, ts) in enumerate(rows):
        totals[user] = totals.get(user, 0) + amount
        if i in late:
            late_out.append((region, user, totals[user]))
            continue
        n, total = windows.get((region, ts - ts % WINDOW_MS), (0, 0))
        windows[(region, ts - ts % WINDOW_MS)] = (n + 1, total + totals[user])
    return sorted((r, start, n, t) for (r, start), (n, t) in windows.items()), sorted(late_out)


def run_windowed(cluster, env, seed, during, name: str = "timed") -> None:
    """The windowed job (named ``name``: unique on the machine, since test files run side by side)
    fed clicks in time, then rows written after their windows fired (late) between more clicks in
    time (``during(client, i)`` after each of the first part's 12 batches): every window and late
    record is the model's."""
    first = timed_clicks(6000, 1_000_000, seed=seed)
    end = 1_000_000 + 6000 // 4
    late_rows = [(u, r, a, ts - 900) for u, r, a, ts in timed_clicks(300, 1_000_000, seed=seed + 1)]
    second = timed_clicks(2000, end, seed=seed + 2)
    rows = first + [row for pair in zip(late_rows, second) for row in pair] + second[len(late_rows) :]
    late = {len(first) + 2 * i for i in range(len(late_rows))}
    want, want_late = windowed_model(rows, late)
    fired_first = [w for w in want if w[1] + WINDOW_MS <= end - 2 * WINDOW_MS]
    client = env.execute_async(name, cluster=cluster)
    with client.writer("in") as writer:
        for i in range(12):
            writer.write(first[i * 500 : (i + 1) * 500], query="q", batch=i)
            during(client, i)
        deadline = time.monotonic() + 60  # the first part's windows fire before the late rows come
        ran_on = cluster.files.jobs()[name]["nodes"]  # a removed or dead node's output too
        while not set(fired_first) <= set(fired_so_far(name, ran_on, wait=0.3)):
            assert time.monotonic() < deadline, "the first part's windows did not fire"
        rest = rows[len(first) :]
        for i in range(0, len(rest), 500):
            writer.write(rest[i : i + 500], query="q", batch=12 + i // 500)
    client.end("in")
    assert set(client.wait(120).values()) == {"FINISHED"}
    assert results(client, "out") == want
    assert results(client, "late") == want_late


@pytest.mark.parametrize("nodes", NODE_COUNTS)
def test_event_time_windows_after_a_re_key_match_the_model_through_node_changes(nodes, tmp_path):
    """Records keep their timestamps from node to node and each producing instance is an input
    split of the windows with its own watermark: every window fires once with the model's rows,
    while a node joins, an operator scales up there and a node leaves, and rows written after
    their windows fired are late."""

    def change(client, i):
        if i == 5:  # windows and watermarks on both sides of the forward move
            assert cluster.add_node().key_groups_moved > 0
            client.rescale("users", 3, node=cluster.nodes[-1])  # splits that join mid-stream
            assert cluster.remove_node(cluster.nodes[0]).key_groups_moved > 0

    with StretchCluster.local(
        nodes=nodes, directory=tmp_path / "cluster", max_parallelism=32, step=8
    ) as cluster:
        run_windowed(cluster, windowed_job(), 5, change)
