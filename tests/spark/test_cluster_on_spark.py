"""Stretch nodes inside Spark executors: on local-cluster[2,2,1024] (two executor JVMs of two task
slots each, as the pip wheel runs them), each node is a long-running task of an executor, listening
on every interface and advertising the executor's address; a writer by the cluster's URL while a
node is added and one removed, and a node killed while a checkpointed job runs, checked against
the plain-Python reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.cluster.test_hosts import network_address

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from pyspark.sql import SparkSession
    from stretch.cluster import ClusterWriter, StretchCluster
    from stretch.common.records import to_batch
    from tests.cluster.jobs import PAIR, count_sum_job, reference
    from tests.cluster.test_cluster import batches, outputs

    def ancestors(pid):
        out = []
        while pid > 1:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat[stat.rfind(")") + 2 :].split()[1])
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\\0", b" ").decode())
        return out

    spark = (
        SparkSession.builder.master("local-cluster[2,2,1024]")
        .config("spark.ui.enabled", "false")
        .config("spark.python.authenticate.socketTimeout", "120s")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    data = batches(5, 20, 40)
    try:
        with StretchCluster.on_spark(spark, nodes=2, directory=sys.argv[1], host="0.0.0.0") as cluster:
            client = count_sum_job().execute_async("on-spark", cluster=cluster)
            locations = [cluster.url, *cluster.connection.locations().values()]
            with ClusterWriter(cluster.url, "on-spark", "in", secret=cluster.secret) as w:
                for i, records in enumerate(data[:10]):
                    w.write(to_batch(records, PAIR), query="q", batch=i)
                added = cluster.add_node()
                from stretch.jobs import list_jobs
                nodes = [j for j in list_jobs() if j.name.startswith("on-spark@")]
                in_executors = len(nodes) == 3 and all(
                    any("CoarseGrainedExecutorBackend" in c for c in ancestors(j.pid)) for j in nodes
                )
                for i, records in enumerate(data[10:], start=10):
                    w.write(to_batch(records, PAIR), query="q", batch=i)
                removed = cluster.remove_node("node-0")
                w.write(to_batch(data[3], PAIR), query="q", batch=3)  # a replay: dropped
            client.end("in")
            statuses = client.wait(120)
            got = outputs("on-spark", ["node-0", "node-1", "node-2"])
    finally:
        spark.stop()
    rows = [r for records in data for r in records]
    final = {}
    for key, count, total in got:
        final[key] = max(final.get(key, (0, 0)), (count, total))
    print(json.dumps({
        "in_executors": in_executors,
        "added": added.key_groups_moved,
        "removed": removed.key_groups_moved,
        "statuses": statuses,
        "locations": locations,
        "exact": final == reference(rows) and len(got) == len(rows),
    }), flush=True)
    """
)


def test_nodes_run_as_tasks_of_executor_jvms_and_hand_key_groups_over(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "cluster")],
        capture_output=True,
        check=False,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["in_executors"]  # each node process runs under an executor JVM, not the driver
    assert result["added"] == 42 and result["removed"] > 0  # 2 -> 3: a third of 128 key groups
    assert result["statuses"] == {"node-1": "FINISHED", "node-2": "FINISHED"}
    here = os.environ.get("SPARK_LOCAL_IP") or network_address()
    assert all(loc.startswith(f"grpc://{here}:") for loc in result["locations"])  # not loopback
    assert result["exact"]
    deadline = time.monotonic() + 30  # the executors and their nodes end with the application
    while _leftovers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _leftovers(tmp_path)


def _leftovers(tmp_path) -> list[int]:
    """Processes still running from the script: executors and nodes name the run's directory or
    the node module in their command lines."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if (
                "stretch.cluster.node" in cmd and str(tmp_path) in cmd
            ) or "CoarseGrainedExecutorBackend" in cmd:
                out.append(int(entry.name))
    return out


CHECKPOINTED = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    from pyspark.sql import SparkSession
    from stretch.cluster import StretchCluster, job_nodes
    from stretch.common.records import to_batch
    from tests.cluster.jobs import PAIR, count_sum_job
    from tests.cluster.test_cluster import batches, outputs

    def node_pid(node, checkpoints):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    args = (entry / "cmdline").read_bytes().split(b"\\0")
                except OSError:
                    continue
                if b"--node-id" in args and node.encode() in args and checkpoints.encode() in args:
                    return int(entry.name)
        raise LookupError(node)

    spark = (
        SparkSession.builder.master("local-cluster[2,2,1024]")
        .config("spark.ui.enabled", "false")
        .config("spark.python.authenticate.socketTimeout", "120s")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    directory, checkpoints = sys.argv[1:3]
    data = batches(9, 30, 30)
    try:
        with StretchCluster.on_spark(
            spark, nodes=2, directory=directory, checkpoint_dir=checkpoints
        ) as cluster:
            env = count_sum_job()
            env.enable_checkpointing()
            client = env.execute_async("on-spark-checkpointed", cluster=cluster)
            with client.writer("in") as w:
                for i, records in enumerate(data):
                    w.write(to_batch(records, PAIR), query="q", batch=i)
                    if i == 10:
                        client.trigger_checkpoint()
                    if i == 20:  # node-1 took batches 11..20 only into its journal
                        os.kill(node_pid("node-1", checkpoints), signal.SIGKILL)
                        deadline = time.monotonic() + 120
                        while not cluster.recoveries:
                            assert time.monotonic() < deadline, "node-1 was not restored"
                            time.sleep(0.05)
                    if i == 25:  # a replay of a micro-batch node-1 had taken: dropped
                        w.write(to_batch(data[15], PAIR), query="q", batch=15)
            client.end("in")
            statuses = client.wait(120)
            got = outputs("on-spark-checkpointed", job_nodes(cluster.address, "on-spark-checkpointed"))
            result = {
                "recoveries": [r["nodes"] for r in cluster.recoveries],
                "replayed": sum(r["rows_replayed"] for r in cluster.recoveries),
                "errors": [repr(e) for e in cluster.supervisor_errors],
                "nodes": cluster.nodes,
                "statuses": statuses,
                "kept": sorted(p.name for p in (Path(checkpoints) / "nodes").iterdir()),
            }
    finally:
        spark.stop()
    print(json.dumps({**result, "got": got, "data": data}), flush=True)
    """
)


@pytest.mark.long
def test_a_checkpointed_job_on_spark_nodes_survives_a_killed_node(tmp_path):
    """checkpoint_dir given to on_spark: node-1's process (a Spark task's child) is killed after
    a checkpoint; the surviving node restores its key groups from the checkpoint directory."""
    from tests.cluster.test_recovery import assert_exactly_once

    checkpoints = tmp_path / "checkpoints"
    run = subprocess.run(
        [sys.executable, "-c", CHECKPOINTED, str(tmp_path / "cluster"), str(checkpoints)],
        capture_output=True,
        check=False,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["recoveries"] == [["node-1"]] and not result["errors"]
    assert result["replayed"] > 0  # what node-1 took after the checkpoint came from its journal
    assert result["nodes"] == ["node-0"] and result["statuses"] == {"node-0": "FINISHED"}
    assert result["kept"] == ["node-0", "node-1"]  # node-1's c1: node-0 restores from it until its own
    assert_exactly_once([tuple(r) for r in result["got"]], [[tuple(r) for r in b] for b in result["data"]])
    assert not (checkpoints / "nodes").exists() or not list((checkpoints / "nodes").iterdir())
    deadline = time.monotonic() + 30
    while _leftovers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _leftovers(tmp_path)
