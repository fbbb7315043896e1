"""User-defined metrics on the job's metrics endpoint: each running instance's latest report,
against a plain-Python count of what the test fed."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from stretch import channels
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.metrics import MetricGroup
from stretch.runtime.metrics import render
from stretch.runtime.user_metrics import families, metric_name, snapshot

RECORD = Types.TUPLE([Types.LONG(), Types.LONG()])


def samples(text: str) -> dict:
    """(sample name, frozen labels without job and operator) -> value, of the user metrics."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("stretch_user_"):
                labels = {k: v for k, v in s.labels.items() if k not in ("job", "operator")}
                out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def by_name(found: dict, name: str, **labels) -> float:
    """The sum over instances of one sample with these labels."""
    return sum(
        v
        for (n, ls), v in found.items()
        if n == name and all(dict(ls).get(k) == want for k, want in labels.items())
    )


def test_a_snapshot_names_groups_as_flink_reporter_does():
    root = MetricGroup()
    root.add_group("records").counter("seen").inc(3)
    root.add_group("parity", "even").add_group("io").meter("hits").mark_event(2)
    root.gauge("broken", lambda: 1 / 0)
    root.gauge("text", lambda: "not a number")
    root.gauge("level", lambda: 2.5)
    d = root.distribution("sizes")
    for v in (4, 1, 7):
        d.update(v)
    rows = sorted(map(tuple, ([p, sorted(ls.items()), n, k, v] for p, ls, n, k, v in snapshot(root))))
    assert rows == [
        ("", [], "level", "gauge", 2.5),
        ("", [], "sizes", "summary", [3, 12]),
        ("parity_io", [("parity", "even")], "hits", "counter", 2),
        ("records", [], "seen", "gauge", 3),
    ]
    assert metric_name("records.x", "seen-count") == "stretch_user_records_x_seen_count"
    made = {f.name: f for f in families("j", {("op", 0): snapshot(root)})}
    assert set(made) == {
        "stretch_user_level",
        "stretch_user_sizes",
        "stretch_user_parity_io_hits",
        "stretch_user_records_seen",
    }
    (hits,) = made["stretch_user_parity_io_hits"].samples
    assert (
        hits.labels == {"job": "j", "operator": "op", "instance": "0", "parity": "even"} and hits.value == 2
    )


class Counted(KeyedProcessFunction):
    """Counts records, by parity of the key, and the values' distribution."""

    def open(self, runtime_context):
        group = runtime_context.get_metrics_group()
        self.seen = group.add_group("records").counter("seen")
        self.parity = {p: group.add_group("parity", p).counter("records") for p in ("even", "odd")}
        self.values = group.distribution("values")
        group.gauge("last_key", lambda: self.last)
        self.last = -1

    def process_element(self, value, ctx):
        self.seen.inc()
        self.parity["even" if value[0] % 2 == 0 else "odd"].inc()
        self.values.update(value[1])
        self.last = value[0]
        yield value


def test_the_endpoint_reports_each_running_instance_and_a_rescale_drops_the_retired_ones():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.from_source(ChannelSource("in", RECORD), None, "in").key_by(lambda r: r[0]).process(
        Counted(), RECORD
    ).name("counted").sink_to(ChannelSink("out"))
    client = env.execute_async("user metrics")
    writer = channels.open_writer(client, "in")
    try:
        results = iter(channels.open_reader(client, "out"))
        sent = [(i % 11, i) for i in range(600)]
        writer.write(sent)
        for _ in sent:
            next(results)

        def settled(expect: int) -> dict:
            deadline = time.monotonic() + 30  # reports come once a second
            while True:
                found = samples(render(client._coordinator))
                if by_name(found, "stretch_user_records_seen") == expect:
                    return found
                assert time.monotonic() < deadline, found
                time.sleep(0.1)

        found = settled(len(sent))
        assert {dict(ls)["instance"] for (n, ls) in found if n == "stretch_user_records_seen"} == {"0", "1"}
        even = sum(1 for k, _ in sent if k % 2 == 0)
        assert by_name(found, "stretch_user_parity_records", parity="even") == even
        assert by_name(found, "stretch_user_parity_records", parity="odd") == len(sent) - even
        assert by_name(found, "stretch_user_values_count") == len(sent)
        assert by_name(found, "stretch_user_values_sum") == sum(v for _, v in sent)
        keys = {v for (n, _), v in found.items() if n == "stretch_user_last_key"}
        assert keys <= {k for k, _ in sent} and len(keys) == 2

        client.rescale("counted", 1)  # the retired instance's series goes; the one left continues
        more = [(i % 11, i) for i in range(600, 900)]
        writer.write(more)
        for _ in more:
            next(results)
        kept = by_name(found, "stretch_user_records_seen", instance="0")
        found = settled(kept + len(more))
        assert {dict(ls)["instance"] for (n, ls) in found if n == "stretch_user_records_seen"} == {"0"}
    finally:
        writer.end()
        client.wait(60)
