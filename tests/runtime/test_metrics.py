"""Prometheus metrics of a running job: values against what the test fed it, through the HTTP
endpoint (loopback) and through `stretch metrics` from a second process."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stretch import channels
from stretch.common import Duration, Types, WatermarkStrategy
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.runtime.control_socket import running_jobs
from stretch.runtime.metrics import render

RECORD = Types.TUPLE([Types.LONG(), Types.LONG()])  # key, event time (ms)


def samples(text: str) -> dict:
    """(metric sample name, frozen labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(found: dict, name: str) -> float:
    return sum(v for (n, _), v in found.items() if n == name)


def test_metrics_count_what_the_job_did():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_metrics()
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(10)).with_timestamp_assigner(
        "f1"
    )
    env.from_source(ChannelSource("in", RECORD), strategy, "in").key_by(lambda r: r[0]).sum(1).name(
        "sums"
    ).sink_to(ChannelSink("out"))
    client = env.execute_async("metrics job")
    try:
        writer = channels.open_writer(client, "in")
        stamp = int(time.time() * 1000) - 60_000  # event time a minute behind the wall clock
        sent = [(i % 7, stamp + i) for i in range(500)]
        writer.write(sent)
        results = iter(channels.open_reader(client, "out"))
        for _ in sent:
            next(results)
        client.rescale("sums", 3)
        client.update("sums", "max", dry_run=True)  # a check only: not counted
        client.update("sums", "max")

        info = next(j for j in running_jobs() if j["job_id"] == client.get_job_id())
        assert info["metrics"].startswith("http://127.0.0.1:")
        assert client._coordinator._metrics[0].server_address[0] == "127.0.0.1"
        over_http = samples(urllib.request.urlopen(info["metrics"], timeout=10).read().decode())
        cli = subprocess.run(
            [sys.executable, "-m", "stretch.cli", "metrics", "metrics job"],
            capture_output=True,
            text=True,
            check=True,
        )
        for found in (over_http, samples(cli.stdout)):
            assert total(found, "stretch_records_in_total") == len(sent)
            assert total(found, "stretch_records_out_total") == len(sent)
            assert found[("stretch_parallelism", (("job", "metrics job"), ("operator", "sums")))] == 3
            assert (
                found[("stretch_rescale_seconds_count", (("job", "metrics job"), ("operator", "sums")))] == 1
            )
            assert (
                found[("stretch_update_seconds_count", (("job", "metrics job"), ("operator", "sums")))] == 1
            )
            assert (
                0 < found[("stretch_update_seconds_sum", (("job", "metrics job"), ("operator", "sums")))] < 60
            )
            assert 0 < total(found, "stretch_busy_seconds_total") < 60
            watermark = stamp + len(sent) - 1 - 10 - 1
            lags = [v for (n, _), v in found.items() if n == "stretch_watermark_lag_seconds"]
            assert lags and all(abs(lag - (time.time() * 1000 - watermark) / 1000) < 30 for lag in lags)
        assert (
            json.loads(json.dumps(client.describe()))["operators"][0]["instances"][0]["watermark"]
            == watermark
        )
        writer.end()
    finally:
        client.wait()


def test_checkpoint_and_recovery_metrics():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing()
    env.from_source(ChannelSource("in", RECORD), None, "in").key_by(lambda r: r[0]).sum(1).name(
        "sums"
    ).sink_to(ChannelSink("out"))
    client = env.execute_async("checkpoint metrics")
    try:
        with channels.open_writer(client, "in") as writer:
            writer.write([(i % 7, i) for i in range(100)])
            reports = [client.trigger_checkpoint() for _ in range(3)]
            co = client._coordinator
            os.kill(next(w.pid for w in co.workers.all() if w.task is not None), signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not co.recoveries:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            found = samples(render(co))
        job = (("job", "checkpoint metrics"),)
        assert found[("stretch_checkpoint_seconds_count", job)] == 3
        assert found[("stretch_checkpoint_seconds_sum", job)] == pytest.approx(
            sum(r["duration_ms"] for r in reports) / 1000
        )
        assert found[("stretch_checkpoint_bytes", job)] == reports[-1]["bytes"] > 0
        assert found[("stretch_checkpoint_failures_total", job)] == 0
        assert found[("stretch_recovery_seconds_count", job)] == 1
    finally:
        client.wait(60)


def test_counters_never_go_down_when_the_operator_scales_down_and_up_again():
    """Retired instances keep their series, and a slot used again continues its counts, so the
    sums over instances equal what was fed after every rescale (as Prometheus counters must)."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.from_source(ChannelSource("in", RECORD), None, "in").key_by(lambda r: r[0]).sum(1).name(
        "sums"
    ).sink_to(ChannelSink("out"))
    client = env.execute_async("rescaled metrics")
    writer = channels.open_writer(client, "in")
    try:
        results = iter(channels.open_reader(client, "out"))
        fed, scrapes = 0, []
        for parallelism in (1, 3, 1, None):
            sent = [(i % 13, i) for i in range(1000)]
            writer.write(sent)
            fed += len(sent)
            for _ in sent:
                next(results)
            deadline = time.monotonic() + 30  # an instance counts a batch just after putting it out
            while client.describe()["operators"][0]["records_out"] < fed:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            found = samples(render(client._coordinator))
            assert total(found, "stretch_records_in_total") == fed
            assert total(found, "stretch_records_out_total") == fed
            scrapes.append(found)
            if parallelism is not None:
                client.rescale("sums", parallelism)
        instances = {
            dict(labels)["instance"] for (n, labels) in scrapes[-1] if n == "stretch_records_in_total"
        }
        assert instances == {"0", "1", "2"}  # at parallelism 1: every slot ever used
        for before, after in itertools.pairwise(scrapes):  # and no series ever went down
            for key, value in before.items():
                if key[0].endswith("_total"):
                    assert after[key] >= value, key
        assert client.describe()["operators"][0]["records_out"] == fed
    finally:
        writer.end()
        client.wait(60)
