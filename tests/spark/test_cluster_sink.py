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


@pytest.mark.long  # the suite keeps within its time: run with -m long
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


def test_spark_streams_an_event_time_job_on_a_cluster_judging_late_rows_as_one_machine(spark, tmp_path):
    """Each micro-batch (a file) is one write, its rows judged by the watermark the micro-batches
    before it left (as the plain-Python model judges a batch); late rows go to the side output."""
    import os

    from stretch.common import Duration, Time, Types, WatermarkStrategy
    from stretch.datastream import OutputTag, StreamExecutionEnvironment
    from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
    from stretch.datastream.window import TumblingEventTimeWindows
    from tests.datastream.flink_windows import run, tumbling

    clicks = Types.ROW_NAMED(["user", "ts"], [Types.STRING(), Types.LONG()])
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(20)).with_timestamp_assigner(
        "ts"
    )
    late = OutputTag("late", clicks)
    counts = (
        env.from_source(ChannelSource("in", clicks), strategy, "in")
        .key_by("user")
        .window(TumblingEventTimeWindows.of(Time.milliseconds(50)))
        .side_output_late_data(late)
        .count()
    )
    counts.sink_to(ChannelSink("out"))
    counts.get_side_output(late).sink_to(ChannelSink("late"))
    source = tmp_path / "in"
    source.mkdir()
    batches = []
    for f in range(4):  # file f: event times [200 f, 200 (f + 1)), and a few of 150 ms before
        rows = [(f"u{t * 7 % 5}", t) for t in range(200 * f, 200 * (f + 1), 3)]
        rows += [(f"u{t % 5}", t - 150) for t in range(200 * f, 200 * f + 30, 10) if t >= 150]
        path = source / f"part-{f:03d}.parquet"
        pq.write_table(pa.table({"user": [u for u, _ in rows], "ts": [t for _, t in rows]}), path)
        os.utime(path, (1_700_000_000 + f, 1_700_000_000 + f))  # Spark reads files oldest first
        batches.append(rows)
    fired, want_late = run(batches, lambda r: r[0], lambda r: r[1], assign=tumbling(50), result=len, delay=20)
    assert want_late
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster") as cluster:
        client = env.execute_async("spark-event-time", cluster=cluster)
        stream = spark.readStream.schema("user STRING, ts BIGINT").option("maxFilesPerTrigger", 1)
        writer = stream.parquet(str(source)).writeStream.format("stretch").option("cluster", cluster.address)
        query = writer.option("job", "spark-event-time").option("channel", "in")
        query = query.option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start()
        query.awaitTermination()
        assert query.exception() is None
        client.end("in")
        client.wait(120)
        assert sorted(tuple(r) for r in client.open_reader("out")) == sorted(fired)
        assert sorted(tuple(r) for r in client.open_reader("late")) == sorted(want_late)
