"""Broadcast state on a cluster: the rules channel reaches every node, a node added later starts
from the rules the others hold, and the alerts and keyed state equal a plain-Python model."""

from __future__ import annotations

import random
import threading
import time

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from stretch import channels
from stretch.cluster import StretchCluster
from stretch.cluster.client import Members, job_nodes
from stretch.cluster.protocol import NOT_MEMBER
from stretch.common.records import to_batch
from stretch.datastream import BroadcastProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from tests.cluster.jobs import (
    ALERT,
    LIMITS,
    PAIR,
    RULE,
    Threshold,
    ThresholdModel,
    accumulate_job,
    group_of,
    limit_job,
    limit_model,
    threshold_job,
)

KEYS = [f"user-{i}" for i in range(120)]


def events(seed: int, count: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(rng.choice(KEYS), rng.randint(0, 60)) for _ in range(count)]


def output(job: str, node: str) -> list[tuple]:
    """What the job wrote on ``node`` so far (its output log stays readable after the node left)."""
    where = channels.locate_output(f"{job}@{node}", "out")
    with channels.OutputLog(where["log"]) as log:
        return [tuple(row.values()) for batch in log.read(log.start, log.end) for row in batch.to_pylist()]


def wait_for(what, predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def acks(job: str, node: str) -> list[tuple]:
    return [r for r in output(job, node) if r[0].startswith("rule:")]


def alerts(job: str, nodes: list[str]) -> list[tuple]:
    return [r for node in nodes for r in output(job, node) if not r[0].startswith("rule:")]


@pytest.mark.long  # 15 s or more; a node joining is also in test_rules_written_while_a_node_joins
def test_rules_reach_every_node_also_one_added_later_and_a_replay_changes_nothing():
    """Rules, then events, a node added (the keys it takes must see the rules), a rule change and
    a replayed rules batch, more events, a node removed, more events: the alerts and each key's
    count of events over the limit are the model's. Each step waits until the job processed the
    previous one, since a broadcast operator's two inputs have no order between them (as in Flink)."""
    model = ThresholdModel()
    job = "limits"
    with StretchCluster.local(nodes=2, step=16) as cluster:
        client = threshold_job().execute_async(job, cluster=cluster)
        written = []

        def send_events(writer, batch: int, rows) -> None:
            writer.write(to_batch(rows, PAIR), query="events", batch=batch)
            model.events(rows)
            written.extend(rows)
            nodes = job_nodes(cluster.address, job)  # removed ones too: their outputs stay
            wait_for("the events' alerts", lambda: len(alerts(job, nodes)) == len(written))

        with client.writer("rules") as rules, client.writer("events") as feed:
            first = [("g0", 10), ("g1", 20), ("g2", 30), ("g3", 40)]
            rules.write(to_batch(first, RULE), query="rules", batch=0)
            model.rules(first)
            wait_for("the rules on both nodes", lambda: all(len(acks(job, n)) == 4 for n in cluster.nodes))
            send_events(feed, 0, events(1, 300))

            added = cluster.add_node()
            assert added.key_groups_moved > 0 and cluster.nodes == ["node-0", "node-1", "node-2"]
            # a replay the added node must drop by the marks it copied with the rules
            rules.write(to_batch(first, RULE), query="rules", batch=0)
            send_events(feed, 1, events(2, 300))
            moved = {k for k, *_ in output(job, "node-2")}
            assert moved, "the added node took no event"

            change = [("g0", 45), ("g2", 5)]
            rules.write(to_batch(change, RULE), query="rules", batch=1)
            rules.write(to_batch(first, RULE), query="rules", batch=0)  # Spark replays a micro-batch
            model.rules(change)
            wait_for(
                "the rule change on every node",
                lambda: [len(acks(job, n)) for n in cluster.nodes] == [6, 6, 2],
            )
            send_events(feed, 2, events(3, 300))

            cluster.remove_node("node-0")
            send_events(feed, 3, events(4, 300))
            state = {r["key"]: r["over"] for r in client.query_state("threshold").to_pylist()}
        client.cancel()

    everywhere = ["node-0", "node-1", "node-2"]
    assert sorted(alerts(job, everywhere)) == sorted(model.alerts)
    assert state == {k: v for k, v in model.over.items()}
    assert sorted(acks(job, "node-2")) == [("rule:g0", 45, -1, -1), ("rule:g2", 5, -1, -1)]


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_rules_written_while_a_node_joins_reach_it_exactly_once():
    """A thread writes rules (each adds to a group's total) before, while and after a node joins:
    every node, the new one included, ends with the totals of all rules, each applied once (the
    new node's from the state it copied, or sent to it after the copy)."""
    job = "totals"
    rng = random.Random(7)
    deltas: list[list[tuple[str, int]]] = []
    with StretchCluster.local(nodes=2, step=16) as cluster:
        client = accumulate_job().execute_async(job, cluster=cluster)
        errors = []
        started, joined = threading.Event(), threading.Event()

        def stream():
            try:
                with client.writer("rules") as rules:
                    after = 0
                    while after < 20:
                        batch = [
                            (f"g{rng.randrange(4)}", rng.randint(1, 9)) for _ in range(rng.randint(1, 3))
                        ]
                        rules.write(to_batch(batch, RULE))  # no (query, batch): each write once
                        deltas.append(batch)
                        after += joined.is_set()
                        if len(deltas) == 10:
                            started.set()
                        time.sleep(0.01)
            except BaseException as e:
                errors.append(e)
                started.set()

        feeder = threading.Thread(target=stream)
        feeder.start()
        started.wait(120)
        cluster.add_node()
        joined.set()
        feeder.join(300)
        assert not errors, errors
        count = sum(len(b) for b in deltas)
        wait_for(
            "the rules on the old nodes",
            lambda: [len(acks(job, n)) for n in ("node-0", "node-1")] == [count] * 2,
        )
        direct = len(acks(job, "node-2"))
        assert 0 < direct < count  # the rules before the copy came with it, the others were sent
        expected: dict[str, int] = {}
        for group, delta in (r for b in deltas for r in b):
            expected[group] = expected.get(group, 0) + delta
        with client.writer("events") as feed:
            probe = [(key, 0) for key in KEYS]
            feed.write(to_batch(probe, PAIR))
        wait_for("the probes", lambda: len(alerts(job, cluster.nodes)) == len(probe))
        seen = {(r[0], r[2]) for r in alerts(job, cluster.nodes)}
        by_node = {n: {r[0] for r in alerts(job, [n])} for n in cluster.nodes}
        client.cancel()
    assert by_node["node-2"], "the new node took no key"
    assert seen == {(key, expected.get(group_of(key), 0)) for key in KEYS}


def test_a_broadcast_write_of_an_older_membership_is_refused_and_the_writer_sends_it_again():
    """A member fenced for a newer membership refuses a writer of the older one; the writer loads
    the membership and sends the rows to the nodes that had not taken them, once each."""
    job = "fenced"
    with StretchCluster.local(nodes=2, step=16) as cluster:
        client = threshold_job().execute_async(job, cluster=cluster)
        members = Members.load(cluster.address)
        assert members.nodes == ("node-0", "node-1")
        with client.writer("rules") as rules:
            rules.write(to_batch([("g1", 7)], RULE))
            wait_for("the rule", lambda: all(len(acks(job, n)) == 1 for n in cluster.nodes))
            cluster.connection.action("node-1", "broadcast_fence", {"members": members.version + 1})
            command = {"op": "write", "job": job, "channel": "rules", "query": None, "batch": None}
            with pytest.raises(flight.FlightServerError, match=NOT_MEMBER):
                late = pa.Table.from_batches([to_batch([("g1", 8)], RULE)])
                cluster.connection.put("node-1", {**command, "members": members.version}, late)
            cluster.membership.publish(["node-0", "node-1"], members.version + 1)
            rules.write(to_batch([("g2", 9)], RULE))  # node-0 takes it, node-1 refuses, then takes it
            assert rules.refusals == 1
            wait_for("the second rule", lambda: all(len(acks(job, n)) == 2 for n in cluster.nodes))
        client.cancel()
    for node in ("node-0", "node-1"):
        assert sorted(acks(job, node)) == [("rule:g1", 7, -1, -1), ("rule:g2", 9, -1, -1)]


def _rules_also_to_a_sink() -> StreamExecutionEnvironment:
    """Keyed events and broadcast rules, the rules written to a sink as well."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_max_parallelism(128)
    rules = env.from_source(ChannelSource("rules", RULE, durable=False), None, "rules")
    rules.sink_to(ChannelSink("echo"))
    events = env.from_source(ChannelSource("events", PAIR, durable=False), None, "events")
    events.key_by(0).connect(rules.broadcast(LIMITS)).process(Threshold(), ALERT).sink_to(ChannelSink("out"))
    return env


class Echo(BroadcastProcessFunction):
    def process_element(self, value, ctx):
        yield value[0], value[1], -1, -1

    def process_broadcast_element(self, value, ctx):
        ctx.get_broadcast_state(LIMITS).put(*value)


def test_events_without_a_key_reach_a_node_that_joins_and_meet_the_rules_each_once():
    """A non-keyed BroadcastProcessFunction on a cluster of one node, then two: the joining node
    starts from the rules the first holds and takes its share of the events (spread by a hash of
    the whole row); replayed micro-batches are dropped; the alerts are the model's, each once."""
    job, limits, expected = "unkeyed-joined", {}, []
    with StretchCluster.local(nodes=1, step=64) as cluster:
        client = limit_job().execute_async(job, cluster=cluster)
        with client.writer("rules") as rules, client.writer("events") as feed:
            rules.write(to_batch([("g0", 10), ("g1", 20), ("g2", 30), ("g3", 40)], RULE), query="r", batch=0)
            limits.update({"g0": 10, "g1": 20, "g2": 30, "g3": 40})
            wait_for("the rules", lambda: len(acks(job, "node-0")) == 4)
            for batch, seed in enumerate((1, 2)):
                rows = events(seed, 300)
                feed.write(to_batch(rows, PAIR), query="events", batch=batch)
                expected.extend(limit_model(limits, rows))
                if batch == 0:
                    cluster.add_node()  # it starts from the rules node-0 holds
                feed.write(to_batch(rows[:50], PAIR), query="events", batch=batch)  # a replay: dropped
            nodes = ["node-0", "node-1"]
            wait_for("the events' alerts", lambda: len(alerts(job, nodes)) == len(expected))
            took = {n: alerts(job, [n]) for n in nodes}
        client.cancel()
    assert sorted(took["node-0"] + took["node-1"]) == sorted(expected)
    assert took["node-1"], "the joining node took no event"


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_events_without_a_key_spread_over_the_nodes_and_meet_the_rules_each_once():
    """A non-keyed BroadcastProcessFunction on a cluster: every node holds the rules, each event
    goes to one node (by a hash of the whole row), through a node added and one removed, replayed
    micro-batches included; the alerts are the model's, each once, and every node took events."""
    job, limits, expected = "unkeyed", {}, []
    with StretchCluster.local(nodes=2, step=16) as cluster:
        client = limit_job().execute_async(job, cluster=cluster)
        with client.writer("rules") as rules, client.writer("events") as feed:

            def send_rules(batch: int, rows, acks_each: list[int]) -> None:
                rules.write(to_batch(rows, RULE), query="rules", batch=batch)
                limits.update(rows)
                wait_for("the rules", lambda: [len(acks(job, n)) for n in cluster.nodes] == acks_each)

            def send_events(batch: int, rows) -> None:
                feed.write(to_batch(rows, PAIR), query="events", batch=batch)
                feed.write(to_batch(rows[:50], PAIR), query="events", batch=batch)  # a replay: dropped
                expected.extend(limit_model(limits, rows))
                nodes = job_nodes(cluster.address, job)
                wait_for("the events' alerts", lambda: len(alerts(job, nodes)) == len(expected))

            send_rules(0, [("g0", 10), ("g1", 20), ("g2", 30), ("g3", 40)], [4, 4])
            send_events(0, events(1, 300))
            cluster.add_node()  # it starts from the rules a member holds
            send_events(1, events(2, 300))
            send_rules(1, [("g0", 45), ("g2", 5)], [6, 6, 2])
            cluster.remove_node("node-0")
            send_events(2, events(3, 300))
            took = {
                n: [r for r in output(job, n) if not r[0].startswith("rule:")]
                for n in job_nodes(cluster.address, job)
            }
        client.cancel()
    assert sorted(r for rows in took.values() for r in rows) == sorted(expected)
    assert all(took.values()), {n: len(rows) for n, rows in took.items()}  # every node took events


def _events_keyed_elsewhere() -> StreamExecutionEnvironment:
    """Events not keyed into a broadcast operator, and keyed into another operator too."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_max_parallelism(128)
    rules = env.from_source(ChannelSource("rules", RULE, durable=False), None, "rules")
    events = env.from_source(ChannelSource("events", PAIR, durable=False), None, "events")
    events.connect(rules.broadcast(LIMITS)).process(Echo(), ALERT).sink_to(ChannelSink("out"))
    events.key_by(0).sum(1).sink_to(ChannelSink("sums"))
    return env


@pytest.mark.parametrize(
    ("job", "reason"),
    [
        (_events_keyed_elsewhere, "besides the non-keyed broadcast operator"),
        (_rules_also_to_a_sink, "is broadcast and also written to a sink"),
    ],
)
def test_a_broadcast_job_a_cluster_cannot_route_is_refused_before_any_node_is_asked(tmp_path, job, reason):
    cluster = StretchCluster(tmp_path, 128, 8, owns_directory=False)  # no node: none may be asked
    with pytest.raises(ValueError, match=reason):
        job().execute_async("refused", cluster=cluster)


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_a_killed_node_is_restored_on_nodes_that_hold_the_rules_already(tmp_path):
    """A checkpointed job: the key groups of a node killed after a checkpoint are restored on the
    others (its journal's events replayed there, seeing the rules they hold; its broadcast rows
    are not replayed), and writers of rules leave the dead node out."""
    import os
    import signal

    model = ThresholdModel()
    job = "guarded"
    with StretchCluster.local(nodes=3, step=16, checkpoint_dir=tmp_path / "checkpoints") as cluster:
        env = threshold_job()
        env.enable_checkpointing()  # on demand: the test says when
        client = env.execute_async(job, cluster=cluster)
        written = []

        def visible(predicate):  # a checkpointed job's output shows what a checkpoint covers
            def check():
                cluster.checkpoint()
                return predicate()

            return check

        with client.writer("rules") as rules, client.writer("events") as feed:
            first = [("g0", 10), ("g1", 20), ("g2", 30), ("g3", 40)]
            rules.write(to_batch(first, RULE), query="rules", batch=0)
            model.rules(first)
            wait_for("the rules", visible(lambda: all(len(acks(job, n)) == 4 for n in cluster.nodes)))
            for batch in (0, 1):
                rows = events(10 + batch, 200)
                feed.write(to_batch(rows, PAIR), query="events", batch=batch)
                model.events(rows)
                written.extend(rows)
                if batch == 0:
                    nodes = list(cluster.nodes)
                    wait_for("the alerts", visible(lambda: len(alerts(job, nodes)) == len(written)))
            os.kill(cluster.launcher.pids()["node-1"], signal.SIGKILL)  # batch 1 only in its journal
            wait_for("the restore", lambda: cluster.recoveries, 120)
            assert Members.load(cluster.address).nodes == ("node-0", "node-2")
            feed.write(to_batch(rows, PAIR), query="events", batch=1)  # replayed: dropped
            change = [("g1", 3)]
            rules.write(to_batch(change, RULE), query="rules", batch=1)
            model.rules(change)
            live = ["node-0", "node-2"]
            wait_for("the rule change", visible(lambda: [len(acks(job, n)) for n in live] == [5, 5]))
            rows = events(12, 200)
            feed.write(to_batch(rows, PAIR), query="events", batch=2)
            model.events(rows)
            written.extend(rows)
            everywhere = ["node-0", "node-1", "node-2"]
            wait_for("the alerts", visible(lambda: len(alerts(job, everywhere)) == len(written)))
            state = {r["key"]: r["over"] for r in client.query_state("threshold").to_pylist()}
        client.cancel()
        assert cluster.recoveries[0]["rows_replayed"] > 0 and not cluster.supervisor_errors
    assert sorted(alerts(job, everywhere)) == sorted(model.alerts)
    assert state == dict(model.over)


DRIVER = """
import json, os, sys
from stretch.cluster import StretchCluster
from stretch.common.records import to_batch
from tests.cluster.jobs import PAIR, RULE, threshold_job
from tests.cluster.test_broadcast import FIRST, CHANGE, events

directory, checkpoints, name = sys.argv[1:4]
cluster = StretchCluster.local(nodes=2, directory=directory, checkpoint_dir=checkpoints, step=16)
print(json.dumps(list(cluster.launcher.pids().values())), flush=True)
env = threshold_job()
env.enable_checkpointing()
client = env.execute_async(name, cluster=cluster)
rules, feed = client.writer("rules"), client.writer("events")
rules.write(to_batch(FIRST, RULE), query="rules", batch=0)
cluster.checkpoint()  # its barrier: the rules are applied on both nodes
feed.write(to_batch(events(20, 200), PAIR), query="events", batch=0)
cluster.checkpoint()
feed.write(to_batch(events(21, 200), PAIR), query="events", batch=1)  # only in the journals
rules.write(to_batch(CHANGE, RULE), query="rules", batch=1)  # only in the broadcast journals
os.kill(os.getpid(), 9)
"""
FIRST = [("g0", 10), ("g1", 20), ("g2", 30), ("g3", 40)]
CHANGE = [("g0", 45), ("g2", 5)]


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_a_restarted_driver_starts_its_new_nodes_from_the_broadcast_state_the_old_ones_had(tmp_path):
    """The driver is killed (its nodes end with it) after a checkpoint, with events and a rule
    change taken since only into the journals; a driver started again on the same directories
    starts the job on its new nodes from an old node's checkpointed broadcast state and replays
    its broadcast journal (the rule change), then restores the key groups, whose replayed events
    see the rules as they were at the end. Replays of both channels are dropped."""
    import json
    import os
    import signal
    import subprocess
    import sys

    directory, checkpoints, name = tmp_path / "cluster", tmp_path / "ck", "restarted-rules"
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(directory), str(checkpoints), name], stdout=subprocess.PIPE
    )
    pids = json.loads(proc.stdout.readline())
    proc.wait(300)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    wait_for("the old nodes' end", lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids))
    model = ThresholdModel()
    model.rules(FIRST)
    model.events(events(20, 200))
    model.rules(CHANGE)  # replayed before the key groups' events
    model.events(events(21, 200))
    with StretchCluster.local(nodes=2, directory=directory, checkpoint_dir=checkpoints) as cluster:
        fresh = cluster.nodes
        client = cluster.job(name)

        def visible(predicate):
            def check():
                cluster.checkpoint()
                return predicate()

            return check

        wait_for("the replayed rule change", visible(lambda: all(len(acks(name, n)) == 2 for n in fresh)))
        with client.writer("rules") as rules, client.writer("events") as feed:
            rules.write(to_batch(CHANGE, RULE), query="rules", batch=1)  # Spark replays: dropped
            feed.write(to_batch(events(21, 200), PAIR), query="events", batch=1)  # dropped too
            rows = events(22, 200)
            feed.write(to_batch(rows, PAIR), query="events", batch=2)
            model.events(rows)
            nodes = job_nodes(cluster.address, name)
            wait_for("the alerts", visible(lambda: len(alerts(name, nodes)) == len(model.alerts)))
            state = {r["key"]: r["over"] for r in client.query_state("threshold").to_pylist()}
        assert [sorted(acks(name, n)) for n in fresh] == [sorted(acks(name, fresh[0]))] * 2
        assert sorted(acks(name, fresh[0])) == [("rule:g0", 45, -1, -1), ("rule:g2", 5, -1, -1)]
        client.cancel()
    assert sorted(alerts(name, nodes)) == sorted(model.alerts)
    assert state == dict(model.over)
