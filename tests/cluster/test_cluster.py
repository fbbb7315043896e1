"""A job on a local cluster: rows go to the node owning their key group, nodes come and go while
rows stream in, and the result equals a plain-Python reference (nothing lost, nothing twice)."""

from __future__ import annotations

import os
import random
import threading

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from stretch import channels
from stretch.cluster import StretchCluster
from stretch.cluster.client import ClusterConnection
from stretch.cluster.protocol import NOT_OWNER
from stretch.common import Types
from stretch.common.records import to_batch
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.job_client import RescaleReport
from stretch.state.key_groups import key_group
from tests.cluster.jobs import PAIR, count_sum_job, reference

KEYS = [f"user-{i}" for i in range(300)]


def batches(seed: int, count: int, size: int) -> list[list[tuple[str, int]]]:
    rng = random.Random(seed)
    return [[(rng.choice(KEYS), rng.randint(-50, 50)) for _ in range(size)] for _ in range(count)]


def outputs(name: str, nodes: list[str]) -> list[tuple]:
    out = []
    for node in nodes:
        out += list(channels.open_reader(f"{name}@{node}", "out"))
    return out


def test_add_and_remove_nodes_under_a_steady_stream_lose_and_duplicate_nothing(tmp_path):
    """Each node has a private /dev/shm (its own mount namespace), as on hosts of its own."""
    data = batches(1, 120, 50)
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster", step=8, private_shm_mb=256) as cluster:
        client = count_sum_job().execute_async("counts-job", cluster=cluster)
        writer = client.writer("in")
        sent = threading.Event()
        errors = []

        def stream():
            try:
                for i, records in enumerate(data):
                    writer.write(to_batch(records, PAIR), query="q", batch=i)
                    if i % 10 == 9:  # Spark replays a micro-batch it had already sent
                        writer.write(to_batch(data[i - 5], PAIR), query="q", batch=i - 5)
                    if i == 40:
                        sent.set()
            except BaseException as e:
                errors.append(e)
                sent.set()

        feeder = threading.Thread(target=stream)
        feeder.start()
        sent.wait(300)
        added = cluster.add_node()
        assert cluster.nodes == ["node-0", "node-1", "node-2"]
        mine = os.readlink("/proc/self/ns/mnt")
        assert all(os.readlink(f"/proc/{pid}/ns/mnt") != mine for pid in cluster.launcher.pids().values())
        assert not [
            p
            for p in os.listdir("/dev/shm")
            if any(f"-{pid}-" in p for pid in cluster.launcher.pids().values())
        ]
        leaving = len(cluster.table.key_groups_of("node-0"))
        removed = cluster.remove_node("node-0")
        feeder.join(300)
        assert not errors, errors
        # the nodes cannot see the writer's shared memory: every part went over Flight
        assert {"node-0", "node-1"} <= writer.shared._refused and not writer.shared._segments
        writer.close()
        # replays after every move: each key group already took these batches, wherever it is now
        with client.writer("in") as again:
            for i in (0, 50, 119):
                again.write(to_batch(data[i], PAIR), query="q", batch=i)

        expected = reference([r for records in data for r in records])
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        got = outputs("counts-job", ["node-0", "node-1", "node-2"])

        # 2 -> 3 moves the new node's share only: about 1/3 of the key groups
        assert added.key_groups_moved == 42
        assert added.bytes_moved > 0
        assert removed.key_groups_moved == leaving
        owners = cluster.table.owners
        assert set(owners) == {"node-1", "node-2"} and abs(owners.count("node-1") - 64) <= 1

    # every key's running count went 1, 2, ..., n exactly once, and its last sum is the reference's
    by_key: dict[str, list[tuple[int, int]]] = {}
    for key, count, total in got:
        by_key.setdefault(key, []).append((count, total))
    assert {k: sorted(v)[-1] for k, v in by_key.items()} == expected
    for key, seen in by_key.items():
        assert sorted(c for c, _ in seen) == list(range(1, expected[key][0] + 1)), key


def test_a_node_change_that_fails_before_any_move_takes_its_new_node_out_again(tmp_path):
    """add_node fails before the new node got a key group: the cluster is as before (no empty node
    left running, nothing of it in /dev/shm), and the next add_node and the job go on exactly."""
    data = batches(3, 30, 40)
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster", step=8) as cluster:
        client = count_sum_job().execute_async("failed-add", cluster=cluster)
        writer = client.writer("in")
        for i in range(15):
            writer.write(to_batch(data[i], PAIR), query="q", batch=i)

        added = []

        def fail(point, src, dst):
            if point == "step":
                added.append(cluster.launcher.pids()["node-2"])
                raise RuntimeError("the node change fails before its first move")

        cluster._step_hook = fail
        with pytest.raises(RuntimeError, match="before its first move"):
            cluster.add_node()
        cluster._step_hook = None
        assert cluster.nodes == ["node-0", "node-1"]
        assert set(cluster.launcher.pids()) == {"node-0", "node-1"}
        assert not os.path.exists(f"/proc/{added[0]}")
        assert not [p for p in os.listdir("/dev/shm") if f"-{added[0]}-" in p]
        assert cluster.add_node().key_groups_moved == 42
        for i in range(15, 30):
            writer.write(to_batch(data[i], PAIR), query="q", batch=i)
        writer.close()
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        got = outputs("failed-add", cluster.nodes)
    last: dict[str, tuple[int, int]] = {}
    for key, count, total in got:
        last[key] = max(last.get(key, (0, 0)), (count, total))
    assert last == reference([r for records in data for r in records])
    assert len(got) == sum(len(records) for records in data)


def test_nodes_refuse_rows_of_key_groups_they_do_not_own_and_callers_without_the_secret(tmp_path):
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster") as cluster:
        client = count_sum_job().execute_async("refusals", cluster=cluster)
        connection = ClusterConnection(cluster.address)
        key = next(k for k in KEYS if cluster.table.owners[key_group(k)] == "node-1")
        rows = pa.Table.from_batches([to_batch([(key, 1)], PAIR)])
        command = {"op": "write", "job": "refusals", "channel": "in", "query": None, "batch": None}
        with pytest.raises(flight.FlightServerError, match=NOT_OWNER):
            connection.put("node-0", command, rows)
        connection.put("node-1", command, rows)  # its owner takes it

        stranger = flight.FlightClient(connection.locations()["node-0"])
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(stranger.do_action(flight.Action("status", b"")))
        stranger.close()
        connection.close()

        # inside a node, the operator rescales live as on one machine; the other node is left be
        report = client.rescale("counts", 3, node="node-1")
        assert isinstance(report, RescaleReport)  # as on one machine
        assert (report.old_parallelism, report.new_parallelism, report.state_bytes_copied) == (2, 3, 0)
        described = client.describe()
        assert [o["parallelism"] for o in described["node-1"]["operators"]] == [3]
        assert [o["parallelism"] for o in described["node-0"]["operators"]] == [2]

        with client.writer("in") as w:
            w.write([(key, 2)])
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        assert outputs("refusals", cluster.nodes) == [(key, 1, 1), (key, 2, 3)]


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_a_restarted_driver_goes_on_from_the_stored_routing_version(tmp_path):
    directory = tmp_path / "cluster"
    with StretchCluster.local(nodes=1, directory=directory, max_parallelism=16, step=4) as cluster:
        report = cluster.add_node()
        assert (report.key_groups_moved, report.steps, report.version) == (8, 2, 2)
        table = cluster.table
    with StretchCluster.local(nodes=5, directory=directory, max_parallelism=16) as again:
        assert again.table == table  # the stored table, not 5 fresh nodes
        assert again.nodes == ["node-0", "node-1"]
        status = again.status()
        assert status["node-1"]["key_groups"] == table.key_groups_of("node-1")
        assert again.add_node().key_groups_moved == 16 // 3
        assert again.nodes == ["node-0", "node-1", "node-2"]


def test_a_micro_batch_in_several_chunks_reaches_every_key_group_whole(tmp_path):
    """Rows of one key group in several chunks of a (query, batch) are all taken, and a replay of
    the whole micro-batch, in other chunks, none of them."""
    records = [(k, i) for i in range(6) for k in KEYS[:40]]
    chunked = pa.Table.from_batches([to_batch(records[i : i + 7], PAIR) for i in range(0, len(records), 7)])
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster") as cluster:
        client = count_sum_job().execute_async("chunks", cluster=cluster)
        with client.writer("in") as w:
            w.write(chunked, query="q", batch=0)
            w.write(pa.Table.from_batches([to_batch(records[::-1], PAIR)]), query="q", batch=0)
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        got = outputs("chunks", cluster.nodes)
    final = {}
    for key, count, total in got:
        final[key] = max(final.get(key, (0, 0)), (count, total))
    assert final == reference(records)
    assert len(got) == len(records)


def test_a_checkpointed_job_is_refused_by_a_cluster_without_a_checkpoint_directory(tmp_path):
    env = count_sum_job()
    env.enable_checkpointing(1000)
    cluster = StretchCluster(tmp_path, 128, 8, owns_directory=False)  # no node: none may be asked
    with pytest.raises(ValueError, match="enables checkpointing: give the cluster a checkpoint directory"):
        env.execute_async("checkpointed", cluster=cluster)


def write_all(writer, data: list[list[tuple[str, int]]]) -> None:
    for i, records in enumerate(data):
        writer.write(to_batch(records, PAIR), query="q", batch=i)


def spark_rows(cluster, job: str) -> list[tuple]:
    """What Spark's batch reader of a cluster reads of the job's output channel ``out``."""
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from stretch.spark.cluster_source import ClusterBatchReader

    fields = (("f0", StringType()), ("f1", LongType()), ("f2", LongType()))
    reader = ClusterBatchReader(
        {"cluster": cluster.address, "job": job, "channel": "out"},
        StructType([StructField(f, t) for f, t in fields]),
    )
    return [tuple(r.values()) for p in reader.partitions() for b in reader.read(p) for r in b.to_pylist()]


def assert_own_results(got: list[tuple], spark: list[tuple], data) -> None:
    """One result per record written in this run, each key's last the model's, Spark's the same."""
    expected = reference([r for records in data for r in records])
    assert len(got) == sum(len(records) for records in data)
    assert {k: (c, s) for k, c, s in got if (c, s) == expected[k]} == expected
    assert sorted(spark) == sorted(got)


@pytest.mark.long  # 15 s or more; names of earlier runs are also checked on one machine
def test_a_later_clusters_run_of_a_job_name_reads_back_only_its_own_results(tmp_path):
    """Output logs are named by job and node and outlive a cluster; the next cluster's run of the
    same name continues them, and its readers (the client's, Spark's batch reader) start at its
    own first result."""
    for n, data in enumerate([batches(7, 4, 20), batches(8, 3, 20)]):
        with StretchCluster.local(nodes=2, directory=tmp_path / f"cluster-{n}") as cluster:
            client = count_sum_job().execute_async("rerun", cluster=cluster)
            with client.writer("in") as writer:
                write_all(writer, data)
            client.end("in")
            assert set(client.wait(120).values()) == {"FINISHED"}
            got = list(client.open_reader("out"))
            spark = spark_rows(cluster, "rerun")
        assert_own_results(got, spark, data)


def keys_only_job() -> StreamExecutionEnvironment:
    """Another job's shape under the same name: its output the keys alone."""
    env = StreamExecutionEnvironment.get_execution_environment()
    source = env.from_source(ChannelSource("in", PAIR, durable=False), None, "in")
    source.key_by(0).map(lambda r: r[0], Types.STRING()).sink_to(ChannelSink("out"))
    return env


def test_two_clusters_on_one_host_running_one_job_name_each_read_back_their_own(tmp_path):
    """Both run ``same@node-0``: the finished one's readers (the client's, Spark's batch reader
    and the schema Spark infers) read its own logs, not the other cluster's running job of the
    name (found by the run's job id and log directory, not by the name)."""
    from stretch.spark.data_source import StretchDataSource

    mine = batches(11, 4, 20)
    with (
        StretchCluster.local(nodes=1, directory=tmp_path / "other") as other,
        StretchCluster.local(nodes=2, directory=tmp_path / "mine") as cluster,
    ):
        running = keys_only_job().execute_async("same", cluster=other)  # holds the name's directories
        with running.writer("in") as writer:
            write_all(writer, batches(12, 2, 20))
            client = count_sum_job().execute_async("same", cluster=cluster)
            with client.writer("in") as mine_writer:
                write_all(mine_writer, mine)
            client.end("in")
            assert set(client.wait(120).values()) == {"FINISHED"}
            options = {"cluster": str(cluster.address), "job": "same", "channel": "out"}
            assert StretchDataSource(options).schema() == "`f0` STRING, `f1` BIGINT, `f2` BIGINT"
            got = []
            reading = threading.Thread(target=lambda: got.extend(client.open_reader("out")), daemon=True)
            reading.start()
            reading.join(30)
            finished_reading = not reading.is_alive()
            spark = spark_rows(cluster, "same")
        running.cancel()  # a reader of the other cluster's job (the old code) fails now
    assert finished_reading
    assert_own_results(got, spark, mine)


def test_a_node_added_after_the_input_ended_ends_its_copy_of_the_job_too(tmp_path):
    """``client.end`` is remembered: a node that joins afterwards starts the job with the channel
    ended, so the job finishes there instead of waiting for input that never comes."""
    data = batches(9, 5, 10)
    with StretchCluster.local(nodes=1, directory=tmp_path / "cluster") as cluster:
        client = count_sum_job().execute_async("ended early", cluster=cluster)
        with client.writer("in") as writer:
            for i, records in enumerate(data):
                writer.write(to_batch(records, PAIR), query="q", batch=i)
        client.end("in")
        assert client.wait(60) == {"node-0": "FINISHED"}
        cluster.add_node()
        assert client.wait(60) == {"node-0": "FINISHED", "node-1": "FINISHED"}
        got = list(client.open_reader("out"))
    expected = reference([r for records in data for r in records])
    assert {k: (c, s) for k, c, s in got if (c, s) == expected[k]} == expected


def test_state_by_key_or_key_groups_and_a_dead_node_named(tmp_path):
    from stretch.cluster import NodeUnreachable

    data = batches(9, 10, 40)
    with StretchCluster.local(nodes=2, directory=tmp_path / "c") as cluster:
        client = count_sum_job().execute_async("by-key", cluster=cluster)
        with client.writer("in") as writer:
            for i, records in enumerate(data):
                writer.write(to_batch(records, PAIR), query="q", batch=i)
        expected = reference([r for records in data for r in records])
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        for key in ("user-7", "user-123", "nobody"):  # one key, from the node owning it
            rows = client.query_state("counts", key=key).to_pylist()
            assert [(r["key"], r["count"], r["sum"]) for r in rows] == (
                [(key, *expected[key])] if key in expected else []
            )
        assert client.query_state("counts", key_groups=[]).num_rows == 0
        some = [0, 5, 64, 127]  # key groups on both nodes
        rows = client.query_state("counts", key_groups=some).to_pylist()
        assert {r["key"]: (r["count"], r["sum"]) for r in rows} == {
            k: v for k, v in expected.items() if key_group(k, 128) in some
        }
        os.kill(cluster.launcher.pids()["node-1"], 9)
        with pytest.raises(NodeUnreachable, match=r"node node-1 of the cluster at .* does not answer"):
            client.query_state("counts")
