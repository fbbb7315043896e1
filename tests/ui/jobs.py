"""A job the UI tests watch: running totals per user, fed through a channel the test holds open."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections import Counter

from stretch import channels
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource

CLICK = Types.TUPLE([Types.STRING(), Types.LONG()])
AMOUNT = Types.ROW_NAMED(["user", "amount"], [Types.STRING(), Types.LONG()])


def counts_job(env) -> None:
    """A sum of amounts per user, keyed by a field: a job that runs on a cluster."""
    (
        env.from_source(ChannelSource("in", AMOUNT), None, "in")
        .key_by("user")
        .sum("amount")
        .name("counts")
        .sink_to(ChannelSink("out"))
    )


@contextlib.contextmanager
def totals_job(name: str, ui=True, parallelism: int = 1):
    """(client, writer) of a running job with a keyed operator 'running-total'; on leaving, the
    input ends and the job finishes."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    (
        env.from_source(ChannelSource("clicks", CLICK), None, "clicks")
        .key_by(lambda r: r[0])
        .sum(1)
        .name("running-total")
        .sink_to(ChannelSink("totals"))
    )
    client = env.execute_async(name, ui=ui)
    try:
        with channels.open_writer(client, "clicks") as writer:
            yield client, writer
        client.wait(60)
    finally:
        client.cancel()


def clicks(n: int, users: int = 50) -> list[tuple[str, int]]:
    return [(f"user-{i % users}", 1) for i in range(n)]


def final_totals(client) -> dict:
    totals = {}
    for user, total in channels.open_reader(client, "totals"):
        totals[user] = total
    return totals


def expected_totals(rows) -> dict:
    return dict(Counter(user for user, _ in rows))


def get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    return call(urllib.request.Request(url, headers=headers or {}))


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    return call(urllib.request.Request(url, data=data, headers=headers or {}, method="POST"))


def call(request) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(predicate, timeout: float = 20.0):
    """The first true value ``predicate`` returns (the page's data is sampled once a second)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s")
