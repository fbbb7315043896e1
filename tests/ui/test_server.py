"""The UI served from a job's process (``execute_async(..., ui=True)``): what its API answers
against the job's own status, who may rescale, and that it ends with the job."""

from __future__ import annotations

import socket
import urllib.parse

import pytest

from stretch.ui import UIConfig
from tests.ui.jobs import clicks, expected_totals, final_totals, get, post, totals_job, wait_for


def test_the_api_shows_the_job_and_only_a_holder_of_the_secret_rescales_it():
    rows = clicks(30_000)
    with totals_job("ui-api") as (client, writer):
        url = client.ui_url
        base = url.split("?")[0]
        secret = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["secret"][0]
        assert urllib.parse.urlsplit(base).hostname == "127.0.0.1"  # loopback by default
        writer.write(rows[:10_000])
        status, overview = get(base + "api/overview")
        assert status == 200 and not overview["can_change"]

        def running():
            jobs = get(base + "api/overview")[1]["jobs"]
            return [j for j in jobs if j["job_id"] == client.get_job_id() and j["status"] == "RUNNING"]

        (job,) = wait_for(running)
        assert job["name"] == "ui-api"
        key = job["key"]

        def read_all():
            _, body = get(base + "api/job?key=" + urllib.parse.quote(key))
            op = body["status"]["operators"][0]
            return body if op["records_in"] == 10_000 and len(body["series"]["t"]) >= 2 else None

        body = wait_for(read_all)
        graph = body["status"]["graph"]
        assert [(n["name"], n["kind"]) for n in graph["nodes"]] == [
            ("clicks", "source"),
            ("running-total", "aggregate"),
            ("ChannelSink", "sink"),
        ]
        assert graph["edges"] == [["stage-0", "stage-1"], ["stage-1", "sink-0"]]
        # the throughput chart integrates to no more than the records the job counted
        s = body["series"]
        rates, times = s["operators"]["running-total"]["rate_in"], s["t"]
        assert sum(r * (t1 - t0) for r, t0, t1 in zip(rates[1:], times, times[1:])) <= 10_000 + 1e-6

        # no secret, a wrong one: refused, nothing changes
        change = {"job": key, "operator": "running-total", "parallelism": 2}
        assert post(base + "api/rescale", change)[0] == 403
        assert post(base + "api/rescale", change, {"X-Stretch-Secret": "nope"})[0] == 403
        assert get(base + "?secret=nope")[0] == 403
        assert client.describe()["operators"][0]["parallelism"] == 1

        # with it: the job rescales, and says so in its own status
        code, reply = post(base + "api/rescale", change, {"X-Stretch-Secret": secret})
        assert code == 200, reply
        assert (reply["report"]["old_parallelism"], reply["report"]["new_parallelism"]) == (1, 2)
        assert client.describe()["operators"][0]["parallelism"] == 2
        code, reply = post(
            base + "api/rescale", {**change, "operator": "nosuch"}, {"X-Stretch-Secret": secret}
        )
        assert code == 409 and "nosuch" in reply["error"]
        code, reply = post(base + "api/rescale", {"job": key}, {"X-Stretch-Secret": secret})
        assert code == 400

        writer.write(rows[10_000:])
        _, body = get(base + "api/job?key=" + urllib.parse.quote(key))
        kinds = [e["kind"] for e in body["events"]]
        assert kinds.count("rescale") == 1
    assert final_totals(client) == expected_totals(rows)
    # the page ends with the job
    port = urllib.parse.urlsplit(base).port
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    assert client.ui_url is not None


def test_a_given_port_and_secret_and_a_busy_port_refused_at_once():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            with totals_job("ui-busy-port", ui=port):
                pass
    finally:
        holder.close()
    with totals_job("ui-own-port", ui=UIConfig(port=port, secret="s3cret")) as (client, writer):
        assert client.ui_url == f"http://127.0.0.1:{port}/?secret=s3cret"
        writer.write(clicks(100))


def test_ui_options_are_checked():
    with pytest.raises(TypeError, match="ui must be True, a port number"):
        UIConfig.of("yes")
    with pytest.raises(ValueError, match="both certfile and keyfile"):
        UIConfig(certfile="x.pem")
