"""The UI's view of a cluster (``StretchCluster.local(ui=True)``, ``stretch ui --cluster``): its
nodes, key-group map and node changes, against what the cluster itself says."""

from __future__ import annotations

import urllib.parse
from collections import Counter

import pyarrow as pa

from stretch.cluster import StretchCluster
from stretch.cluster.client import ClusterConnection
from stretch.cluster.ui_source import ClusterJobs
from stretch.datastream import StreamExecutionEnvironment
from tests.ui.jobs import counts_job, get, post, wait_for


def test_the_view_follows_the_cluster_through_a_node_change_and_rescales_inside_a_node():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    counts_job(env)
    with StretchCluster.local(nodes=2, ui=True) as cluster:
        client = env.execute_async("counts", cluster=cluster)
        with client.writer("in") as w:
            w.write(
                pa.table({"user": [f"u{i}" for i in range(300)], "amount": [1] * 300}), query="q", batch=0
            )
        base = cluster.ui_url.split("?")[0]
        secret = urllib.parse.parse_qs(urllib.parse.urlsplit(cluster.ui_url).query)["secret"][0]
        assert secret == cluster.secret  # changes need the control plane's own secret

        seen_mid_change = []

        def hook(point, src, dst):
            if point == "load" and not seen_mid_change:
                seen_mid_change.append(get(base + "api/cluster")[1])

        cluster._step_hook = hook
        report = cluster.add_node()
        cluster._step_hook = None
        (mid,) = seen_mid_change
        assert mid["progress"]["key_groups"] == report.key_groups_moved
        assert 0 <= mid["progress"]["moved"] < report.key_groups_moved
        assert mid["handoff"]["dst"] == "node-2" and mid["handoff"]["key_groups"]

        _, view = get(base + "api/cluster")
        owners = cluster.topology()["routing"]["owners"]
        assert view["owners"] == owners and view["version"] == report.version
        assert {n["node"]: n["key_groups"] for n in view["nodes"]} == dict(Counter(owners))
        assert view["progress"] is None and view["handoff"] is None
        (change,) = view["changes"]
        assert (change["key_groups_moved"], change["bytes_moved"], change["version"]) == (
            report.key_groups_moved,
            report.bytes_moved,
            report.version,
        )

        # every node's run of the job is a job of the page, rescaled on its node only
        names = {f"counts@{n}" for n in cluster.nodes}

        def all_nodes_jobs():
            keys = {j["name"]: j["key"] for j in get(base + "api/overview")[1]["jobs"]}
            return keys if set(keys) == names else None

        keys = wait_for(all_nodes_jobs)
        change = {"job": keys["counts@node-1"], "operator": "counts", "parallelism": 2}
        assert post(base + "api/rescale", change)[0] == 403
        code, reply = post(base + "api/rescale", change, {"X-Stretch-Secret": secret})
        assert code == 200 and reply["report"]["new_parallelism"] == 2
        described = client.describe()
        assert {n: d["operators"][0]["parallelism"] for n, d in described.items()} == {
            "node-0": 1,
            "node-1": 2,
            "node-2": 1,
        }
        code, reply = post(
            base + "api/rescale", {**change, "operator": "nosuch"}, {"X-Stretch-Secret": secret}
        )
        assert code == 409 and "nosuch" in reply["error"]
        client.end("in")
        client.wait()


def test_a_cluster_seen_from_another_process_by_its_directory():
    """What ``stretch ui --cluster DIR`` shows: the same map, read through the cluster's files."""
    env = StreamExecutionEnvironment.get_execution_environment()
    counts_job(env)
    with StretchCluster.local(nodes=2) as cluster:
        client = env.execute_async("counts", cluster=cluster)
        source = ClusterJobs(ClusterConnection(cluster.address))
        try:
            view = source.cluster()
            assert view["owners"] == list(cluster.table.owners)
            assert [n["node"] for n in view["nodes"]] == cluster.nodes
            assert view["changes"] == [] and view["progress"] is None
            assert set(source.statuses()) == {f"{n}/counts" for n in cluster.nodes}
        finally:
            source.close()
        client.end("in")
        client.wait()
