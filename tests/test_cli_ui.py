"""`stretch ui`: a page of this user's running jobs, served from another process, that rescales
them with its secret; and `stretch jobs --json` naming a job's own page."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.parse

from stretch import jobs
from tests.ui.jobs import clicks, expected_totals, final_totals, get, post, totals_job, wait_for


def test_stretch_ui_shows_and_rescales_the_jobs_of_this_machine_until_stopped():
    rows = clicks(20_000)
    with totals_job("cli-ui", ui=False) as (client, writer):
        writer.write(rows[:10_000])
        ui = subprocess.Popen(
            [sys.executable, "-m", "stretch.cli", "ui", "--port", "0", "--secret", "let-me-in"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = ui.stdout.readline()
            assert line.startswith("stretch UI at http://127.0.0.1:"), line + ui.stderr.read()
            url = line.split(" at ")[1].strip()
            assert url.endswith("/?secret=let-me-in")
            base = url.split("?")[0]

            def listed():
                found = [
                    j for j in get(base + "api/overview")[1]["jobs"] if j["job_id"] == client.get_job_id()
                ]
                return found if found and found[0]["status"] == "RUNNING" else None

            (job,) = wait_for(listed)
            assert job["where"] == "this machine"
            change = {"job": job["key"], "operator": "running-total", "parallelism": 2}
            assert post(base + "api/rescale", change)[0] == 403
            code, reply = post(base + "api/rescale", change, {"X-Stretch-Secret": "let-me-in"})
            assert code == 200, reply
            assert client.describe()["operators"][0]["parallelism"] == 2
            writer.write(rows[10_000:])
        finally:
            ui.send_signal(signal.SIGTERM)
            assert ui.wait(20) == 0
            ui.stdout.close()
            ui.stderr.close()
    assert final_totals(client) == expected_totals(rows)


def test_stretch_ui_refuses_a_busy_port_in_one_line():
    with totals_job("cli-ui-page") as (client, writer):
        writer.write(clicks(10))
        port = urllib.parse.urlsplit(client.ui_url).port
        (info,) = [j for j in jobs.list_jobs() if j.job_id == client.get_job_id()]
        assert info.ui == client.ui_url.split("?")[0]  # the page, without its secret
        done = subprocess.run(
            [sys.executable, "-m", "stretch.cli", "ui", "--port", str(port)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 1
        assert done.stderr.strip().splitlines() == [
            f"stretch: the stretch UI cannot listen on 127.0.0.1:{port}: [Errno 98] Address already in use"
        ]
