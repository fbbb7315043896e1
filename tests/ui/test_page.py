"""The UI's page in a real browser: a running job's graph and operators, a rescale pressed on the
page and seen in the job, and a cluster's nodes and key-group map."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from stretch.cluster import StretchCluster
from stretch.datastream import StreamExecutionEnvironment
from tests.ui.browser import browser_page
from tests.ui.jobs import clicks, counts_job, expected_totals, final_totals, totals_job

SCREENSHOTS = os.environ.get("STRETCH_UI_SCREENSHOTS")  # a directory: keep the pages' pictures


def shoot(page, tmp_path: Path, name: str) -> None:
    target = Path(SCREENSHOTS) if SCREENSHOTS else tmp_path
    page.screenshot(path=str(target / name), full_page=True)
    assert (target / name).stat().st_size > 10_000  # a drawn page, not a blank one


def test_see_a_running_job_press_rescale_and_see_the_new_parallelism(tmp_path):
    rows = clicks(60_000)
    with totals_job("ui-page") as (client, writer), browser_page() as page:
        writer.write(rows[:20_000])
        page.goto(client.ui_url)  # sets the secret's cookie, then shows the page without it
        assert "secret" not in page.url
        page.wait_for_selector("[data-operator='running-total']")
        for name in ("clicks", "running-total", "ChannelSink"):
            assert page.locator(f"[data-node='{name}']").count() == 1
        assert page.text_content("[data-parallelism='running-total']") == "1"
        page.wait_for_selector("[data-chart='rate_in'] canvas")
        page.fill("[data-rescale-input='running-total']", "3")
        page.click("[data-rescale='running-total']")
        page.wait_for_selector("[data-parallelism='running-total']:text-is('3')", timeout=20_000)
        assert client.describe()["operators"][0]["parallelism"] == 3  # the job itself says so
        page.wait_for_selector("[data-event='rescale']")
        assert "1 -> 3" in page.text_content("[data-event='rescale']")
        page.click("[data-event='rescale'] summary")  # the whole report, as the job gave it
        (report,) = client.describe()["rescales"]
        page.wait_for_selector("[data-event='rescale'] details[open] pre")
        shown = json.loads(page.text_content("[data-event='rescale'] pre"))
        assert shown == json.loads(json.dumps(report))
        time.sleep(1.5)  # a refresh of the page keeps it open
        assert page.is_visible("[data-event='rescale'] pre")
        writer.write(rows[20_000:])
        page.wait_for_function(
            "() => document.querySelectorAll(\"[data-operator='running-total'] .bar\").length === 3"
        )
        shoot(page, tmp_path, "ui-job.png")
        assert page.errors == []
    assert final_totals(client) == expected_totals(rows)


def test_without_the_secret_the_page_only_looks(tmp_path):
    with totals_job("ui-read-only") as (client, writer), browser_page() as page:
        writer.write(clicks(1000))
        page.goto(client.ui_url.split("?")[0])
        page.wait_for_selector("[data-operator='running-total']")
        assert "read-only" in page.text_content("#access")
        assert page.is_disabled("[data-rescale='running-total']")
        assert page.errors == []


@pytest.mark.long  # 18 s (the API's cluster view is tested by tests/cluster/test_ui_source.py)
def test_a_clusters_nodes_and_key_group_map(tmp_path):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    counts_job(env)
    batch = pa.table({"user": [f"u{i}" for i in range(500)], "amount": [1] * 500})
    with StretchCluster.local(nodes=2, ui=True) as cluster, browser_page() as page:
        client = env.execute_async("counts", cluster=cluster)
        with client.writer("in") as w:
            w.write(batch, query="q", batch=0)
        report = cluster.add_node()
        page.goto(cluster.ui_url)
        page.click("#cluster-link a")
        page.wait_for_selector("[data-cluster-node='node-2']")
        owners = Counter(cluster.topology()["routing"]["owners"])
        cells = page.eval_on_selector_all("[data-kgmap] .kg", "cells => cells.map(c => c.dataset.owner)")
        assert Counter(cells) == owners and len(cells) == cluster.max_parallelism
        for node in cluster.nodes:
            row_text = page.text_content(f"[data-cluster-node='{node}']")
            assert str(owners[node]) in row_text and "counts (RUNNING)" in row_text
        change = page.text_content(f"[data-change='{report.version}']")
        assert f"{report.key_groups_moved}" in change and f"({report.steps} steps)" in change
        shoot(page, tmp_path, "ui-cluster.png")
        page.click("[data-job='counts@node-2']")
        page.wait_for_selector("[data-operator='counts']")
        page.fill("[data-rescale-input='counts']", "2")
        page.click("[data-rescale='counts']")
        page.wait_for_selector("[data-parallelism='counts']:text-is('2')", timeout=20_000)
        described = client.describe()
        assert [op["parallelism"] for op in described["node-2"]["operators"]] == [2]
        assert [op["parallelism"] for op in described["node-0"]["operators"]] == [1]
        assert page.errors == []
        client.end("in")
        client.wait()
