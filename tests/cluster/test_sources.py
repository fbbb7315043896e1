"""Sources other than channels on a cluster: a collection, a number sequence and a generator read
by the driver, files read by the nodes (a file per split), through nodes added, removed and
killed, and a driver restarted; each key's running count and sum equal a plain-Python model of the
same records: nothing lost, nothing twice."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stretch.cluster import StretchCluster, source_plans
from stretch.cluster.client import job_nodes
from stretch.common import Types, WatermarkStrategy
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DataGeneratorSource, NumberSequenceSource
from stretch.datastream.connectors.channel import ChannelSink
from stretch.datastream.connectors.file_system import FileSource, StreamFormat
from stretch.errors import JobExecutionError
from tests.cluster.jobs import PAIR, CountSum, HeldByEvents, HeldByFiles, Paced, parse
from tests.cluster.test_cluster import outputs
from tests.cluster.test_recovery import assert_exactly_once, kill

TRIPLE = Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG()])


def wait_for(what: str, predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def counting(env: StreamExecutionEnvironment, stream, key=0) -> StreamExecutionEnvironment:
    stream.key_by(key).process(CountSum(), TRIPLE).name("counts").sink_to(ChannelSink("out"))
    return env


def environment() -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.set_max_parallelism(128)
    return env


def write_files(directory: Path, files: int, lines: int) -> list[tuple[str, int]]:
    """``files`` files of ``lines`` lines ``key,value``; returns the records in file order."""
    directory.mkdir()
    records = []
    for f in range(files):
        rows = [(f"k{(i * 7 + f) % 97}", f * lines + i) for i in range(lines)]
        (directory / f"part-{f:02d}.csv").write_text("".join(f"{k},{v}\n" for k, v in rows))
        records += rows
    return records


def file_job(directory: Path, pace) -> StreamExecutionEnvironment:
    env = environment()
    files = FileSource.for_record_stream_format(StreamFormat.text_line_format(), str(directory)).build()
    lines = env.from_source(files, WatermarkStrategy.no_watermarks(), "files")
    return counting(env, lines.map(parse, PAIR).map(pace, PAIR))


def test_a_collection_and_files_reach_their_key_groups_once_while_a_node_joins(tmp_path, monkeypatch):
    """One job reads a collection (the driver's reader) and files (the nodes' readers) while a
    second node joins: the readers wait, the collection's at 1,200 rows and each node's at 300 lines,
    until the node change begins moving key groups, so it comes mid-source; the new node reads
    files too. Each key's count and sum are the model's."""
    monkeypatch.setattr(source_plans, "COLLECTION_CHUNK_ROWS", 400)
    collection = [(f"c{i % 61}", i) for i in range(4_000)]
    records = write_files(tmp_path / "in", files=6, lines=500)
    held = HeldByEvents(400, 0.02, holds=[1_200])
    env = environment()
    pairs = env.from_collection(collection, PAIR).map(held, PAIR)
    files = FileSource.for_record_stream_format(StreamFormat.text_line_format(), str(tmp_path / "in")).build()
    lines = env.from_source(files, WatermarkStrategy.no_watermarks(), "files").map(parse, PAIR)
    counting(env, pairs.union(lines.map(HeldByFiles(100, 0.05, [300], tmp_path), PAIR)))
    with StretchCluster.local(nodes=1, directory=tmp_path / "cluster") as cluster:
        client = env.execute_async("mixed", cluster=cluster)
        splits = cluster.sources.jobs["mixed"].splits
        wait_for(
            "the readers at their holds",
            lambda: held.waiting == 0 and {s.reader for s in splits.values()} >= {"driver", "node-0"},
        )

        def begun(point, src, dst):
            if point == "release":
                held.events[0].set()
                (tmp_path / "go-0").touch()

        cluster._step_hook = begun
        assert cluster.add_node().key_groups_moved
        assert set(client.wait(120).values()) == {"FINISHED"}  # both sources ended by themselves
        got = outputs("mixed", job_nodes(cluster.address, "mixed"))
        readers = {r for s in splits.values() for r in s.read_by}
    assert readers == {"driver", "node-0", "node-1"}  # the new node read files too
    assert_exactly_once(got, [collection, records])


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_a_collection_a_sequence_and_a_generator_reach_their_key_groups_once_through_node_changes(
    tmp_path, monkeypatch
):
    """The driver reads the three sources (its writers send each row to its key group's node) while a
    node joins and another leaves (the collection's reader waits at two points until each change
    begins moving key groups); both sources end by themselves, and so does the job."""
    monkeypatch.setattr(source_plans, "COLLECTION_CHUNK_ROWS", 400)  # more micro-batches to move between
    collection = [(f"c{i % 61}", i) for i in range(12_000)]
    sequence = [(f"s{n % 13}", n) for n in range(1, 3_001)]
    held = HeldByEvents(400, 0.05, holds=[2_000, 6_000])
    env = environment()
    pairs = env.from_collection(collection, PAIR).map(held, PAIR)
    numbers = env.from_source(NumberSequenceSource(1, 3_000), None, "numbers").map(
        lambda n: (f"s{n % 13}", n), PAIR
    )
    generated = env.from_source(
        DataGeneratorSource(lambda i: (f"d{i % 7}", i), 2_000, type_info=PAIR), None, "gen"
    )
    counting(env, pairs.union(numbers, generated), key=lambda r: r[0])  # routed by the function
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster") as cluster:
        client = env.execute_async("collected", cluster=cluster)
        split = cluster.sources.jobs["collected"].splits["0/0"]
        for hold, change in enumerate([cluster.add_node, lambda: cluster.remove_node("node-0")]):
            wait_for(f"the reader at hold {hold}", lambda hold=hold: held.waiting == hold)
            cluster._step_hook = lambda point, src, dst, hold=hold: (
                point == "release" and held.events[hold].set()
            )
            assert change().key_groups_moved
            assert hold == 1 or not split.done  # the reader waits at the next hold
        assert set(client.wait(120).values()) == {"FINISHED"}  # every source ended by itself
        got = outputs("collected", job_nodes(cluster.address, "collected"))

        # a step of a source that fails fails its job on every node, naming the record
        env = environment()
        failing = env.from_collection([("a", 1), ("b", 0), ("c", 2)], PAIR).map(
            lambda r: (r[0], 6 // r[1]), PAIR
        )
        failed = counting(env, failing).execute_async("fails", cluster=cluster)
        with pytest.raises(
            JobExecutionError, match=r"source 'Collection Source' failed.*\('b', 0\).*ZeroDivision"
        ):
            failed.wait(60)
        assert set(cluster.failures) == {"fails"}
    assert_exactly_once(got, [collection, sequence, [(f"d{i % 7}", i) for i in range(2_000)]])


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_files_are_split_among_the_nodes_and_read_once_through_a_node_added_and_one_removed(tmp_path):
    """Each node reads files (a split each) and sends every line to its key group's node; a node
    that joins reads files too, a node that leaves gives its file back where it got to. The
    readers wait at 800 lines until the node joining moves key groups, and at 2,500 until the
    node leaving is asked to."""
    records = write_files(tmp_path / "in", files=10, lines=1_000)
    env = file_job(tmp_path / "in", HeldByFiles(200, 0.05, [800, 2_500], tmp_path))
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster") as cluster:
        client = env.execute_async("files", cluster=cluster)
        splits = cluster.sources.jobs["files"].splits
        wait_for("both nodes reading", lambda: {s.reader for s in splits.values()} >= {"node-0", "node-1"})
        cluster._step_hook = lambda point, src, dst: point == "release" and (tmp_path / "go-0").touch()
        cluster.add_node()
        (tmp_path / "go-1").touch()
        cluster.remove_node("node-0")
        assert set(client.wait(120).values()) == {"FINISHED"}
        got = outputs("files", job_nodes(cluster.address, "files"))
        readers = {r for s in splits.values() for r in s.read_by}
    assert readers == {"node-0", "node-1", "node-2"}  # every node read files, the new one too
    assert all(s.done for s in splits.values())
    assert_exactly_once(got, [records])


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_a_node_killed_while_it_reads_a_file_is_restored_and_its_file_read_on_by_another(tmp_path):
    """The killed node's key groups restore from its checkpoint and journal; the file it was
    reading goes to another node from the progress it last reported, the lines sent again dropped
    by the key groups that took them."""
    records = write_files(tmp_path / "in", files=6, lines=3 * 4096)  # 3 batches of lines each
    env = file_job(tmp_path / "in", Paced(500, 0.1))
    env.enable_checkpointing()  # on demand: the test says when
    with StretchCluster.local(
        nodes=3, directory=tmp_path / "cluster", checkpoint_dir=tmp_path / "checkpoints"
    ) as cluster:
        client = env.execute_async("killed-reader", cluster=cluster)
        splits = cluster.sources.jobs["killed-reader"].splits
        wait_for(
            "node-1 half through a file",
            lambda: any(s.reader == "node-1" and s.next >= 1 for s in splits.values()),
        )
        client.trigger_checkpoint()
        wait_for("node-1 further", lambda: any(s.reader == "node-1" and s.next >= 2 for s in splits.values()))
        (victim,) = [s for s in splits.values() if s.reader == "node-1"]
        at = victim.next
        kill(cluster, "node-1")
        wait_for("the restore", lambda: cluster.recoveries, 120)
        assert set(client.wait(120).values()) == {"FINISHED"}
        assert victim.done and victim.read_by[0] == "node-1" and len(victim.read_by) == 2
        assert victim.next == 0 or victim.next >= at  # read on from where node-1 got
        assert not cluster.supervisor_errors
        got = outputs("killed-reader", job_nodes(cluster.address, "killed-reader"))
    assert_exactly_once(got, [records])


RESTARTED = """
import json, os, sys, time
from pathlib import Path
from tests.cluster.jobs import Paced
from tests.cluster.test_sources import file_job
from stretch.cluster import StretchCluster

directory, checkpoints, files, name = sys.argv[1:5]
cluster = StretchCluster.local(nodes=2, directory=directory, checkpoint_dir=checkpoints)
print(json.dumps(list(cluster.launcher.pids().values())), flush=True)
env = file_job(Path(files), Paced(500, 0.1))
env.enable_checkpointing()
client = env.execute_async(name, cluster=cluster)
splits = cluster.sources.jobs[name].splits
while sum(s.next for s in splits.values()) < 3:
    time.sleep(0.02)
client.trigger_checkpoint()
while sum(s.next for s in splits.values()) < 5:
    time.sleep(0.02)
os.kill(os.getpid(), 9)
"""


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_a_restarted_driver_reads_the_files_on_from_where_its_killed_predecessor_got(tmp_path):
    """The driver dies (its nodes with it) halfway through the files; a new driver on the same
    directories restores every key group and reads each file on from the progress the first one
    kept: each line counted once."""
    import json
    import os
    import signal
    import subprocess
    import sys

    records = write_files(tmp_path / "in", files=4, lines=3 * 4096)
    directory, checkpoints, name = tmp_path / "cluster", tmp_path / "ck", "files-restarted"
    proc = subprocess.Popen(
        [sys.executable, "-c", RESTARTED, str(directory), str(checkpoints), str(tmp_path / "in"), name],
        stdout=subprocess.PIPE,
        cwd=os.getcwd(),
    )
    pids = json.loads(proc.stdout.readline())
    proc.wait(300)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    wait_for("the old nodes' end", lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids))
    (progress,) = (checkpoints / "sources").glob("*.json")  # the job's, named after it
    kept = json.loads(progress.read_text())
    assert sum(next_ for next_, _position, _done in kept.values()) >= 3  # progress the first driver kept
    with StretchCluster.local(nodes=2, directory=directory, checkpoint_dir=checkpoints) as cluster:
        client = cluster.job(name)
        splits = cluster.sources.jobs[name].splits
        assert sum(s.next for s in splits.values()) >= 3  # on from there, not from the start
        assert set(client.wait(180).values()) == {"FINISHED"}
        got = outputs(name, job_nodes(cluster.address, name))
    assert not progress.exists()  # closed, not died: nothing resumes it
    assert_exactly_once(got, [records])
