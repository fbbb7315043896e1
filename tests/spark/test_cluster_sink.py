"""Spark writes into a job on a stretch cluster with .option("cluster", address): every row reaches
the node owning its key group, also after a node joined between two runs of the query."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stretch.cluster import StretchCluster
from tests.cluster.jobs import count_sum_job, reference
from tests.cluster.test_cluster import outputs


def files(directory, parts: int, rows: int, seed: int) -> list[tuple[str, int]]:
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for p in range(parts):
        users = [f"u{(seed * 7919 + p * rows + i) * 31 % 97}" for i in range(rows)]
        amounts = [(p * rows + i) % 101 for i in range(rows)]
        pq.write_table(
            pa.table({"user": users, "amount": pa.array(amounts, pa.int64())}),
            directory / f"part-{seed}-{p:03d}.parquet",
        )
        out += list(zip(users, amounts))
    return out


def stream_into(spark, cluster, job: str, source, checkpoint):
    stream = (
        spark.readStream.schema("user STRING, amount BIGINT")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(source))
    )
    writer = stream.writeStream.format("stretch").option("cluster", cluster.address).option("job", job)
    query = writer.option("channel", "in").option("checkpointLocation", str(checkpoint))
    query = query.trigger(availableNow=True).start()
    query.awaitTermination()
    return query


def test_spark_streams_into_a_cluster_job_across_a_node_change(spark, tmp_path):
    source = tmp_path / "in"
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster") as cluster:
        client = count_sum_job().execute_async("spark-cluster", cluster=cluster)
        rows = files(source, parts=2, rows=300, seed=1)
        query = stream_into(spark, cluster, "spark-cluster", source, tmp_path / "ckpt")
        assert len(query.recentProgress) >= 2
        cluster.add_node()
        rows += files(source, parts=2, rows=300, seed=2)  # more data while the query is down
        stream_into(spark, cluster, "spark-cluster", source, tmp_path / "ckpt")
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        got = outputs("spark-cluster", cluster.nodes)
        assert not list((tmp_path / "cluster" / "staging").iterdir())  # committed files are gone
    final = {}
    for key, count, total in got:
        final[key] = max(final.get(key, (0, 0)), (count, total))
    assert final == reference(rows)
    assert len(got) == len(rows)  # one result per row: nothing twice, nothing lost


@pytest.mark.long
def test_a_checkpointed_cluster_job_fed_by_spark_survives_a_killed_node(spark, tmp_path):
    """Micro-batches Spark committed after the nodes' latest checkpoint live only in the journal
    of the node that took them: killed, its key groups are restored from checkpoint and journal."""
    import os
    import signal
    import time

    source = tmp_path / "in"
    with StretchCluster.local(
        nodes=2, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "ckpt" / "stretch-cluster"
    ) as cluster:
        env = count_sum_job()
        env.enable_checkpointing()
        client = env.execute_async("spark-checkpointed", cluster=cluster)
        rows = files(source, parts=2, rows=300, seed=3)
        stream_into(spark, cluster, "spark-checkpointed", source, tmp_path / "ckpt")
        client.trigger_checkpoint()
        rows += files(source, parts=1, rows=300, seed=4)
        stream_into(spark, cluster, "spark-checkpointed", source, tmp_path / "ckpt")
        os.kill(cluster.launcher.pids()["node-1"], signal.SIGKILL)
        rows += files(source, parts=2, rows=300, seed=5)  # the writer waits for the restore
        stream_into(spark, cluster, "spark-checkpointed", source, tmp_path / "ckpt")
        deadline = time.monotonic() + 120
        while not cluster.recoveries:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        got = outputs("spark-checkpointed", ["node-0", "node-1"])
    final = {}
    for key, count, total in got:
        final[key] = max(final.get(key, (0, 0)), (count, total))
    assert final == reference(rows)
    assert len(got) == len(rows)  # one result per row: nothing twice, nothing lost
