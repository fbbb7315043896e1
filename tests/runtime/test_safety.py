"""What a job exposes: owner-only segments, socket and state; no network listener by default;
nothing pickled accepted from a process that has not proved it is one of the job's."""

from __future__ import annotations

import os
import socket
import stat
import sys
from pathlib import Path

import pytest

from stretch import channels
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.runtime import control_socket as cs
from stretch.runtime.checkpointing import CheckpointStore

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])


@pytest.fixture
def job():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing()
    env.from_source(ChannelSource("in", PAIR), None, "in").key_by(lambda r: r[0]).reduce(
        lambda a, b: (a[0], a[1] + b[1])
    ).sink_to(ChannelSink("out"))
    client = env.execute_async(f"safety-{os.getpid()}")
    writer = channels.open_writer(client, "in")
    writer.write([(1, 2), (3, 4)])
    client.trigger_checkpoint()
    try:
        yield client
    finally:
        writer.end()
        client.wait(60)


def _family(pid: int, besides: set[int] = frozenset()) -> list[int]:
    """``pid`` and its descendants, except ``besides`` and theirs."""
    out, todo = [pid], [pid]
    while todo:
        parent = todo.pop()
        for p in Path("/proc").iterdir():
            if p.name.isdigit() and int(p.name) not in besides:
                try:
                    if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                        out.append(int(p.name))
                        todo.append(int(p.name))
                except (OSError, IndexError):
                    continue
    return out


def test_segments_socket_and_state_are_owner_only(job):
    co = job._coordinator
    segments = [p for p in Path("/dev/shm").iterdir() if p.name.startswith(co.prefix)]
    assert len(segments) >= 4
    for p in segments:
        st = p.stat()
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o600, p
    sock = co.socket_path.stat()
    assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o600
    assert stat.S_IMODE(co.socket_path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(co.job_dir.path.stat().st_mode) == 0o700
    assert stat.S_IMODE(co.checkpointer.store.dir.stat().st_mode) == 0o700


def _spark_ports() -> set[int]:
    """Ports the suite's Spark session, not the engine, listens on in this process (its
    accumulator server; a callback server once a query ran foreachBatch)."""
    if "pyspark" not in sys.modules:
        return set()
    from pyspark import SparkContext

    context, gateway = SparkContext._active_spark_context, SparkContext._gateway
    servers = [getattr(context, "_accumulatorServer", None), getattr(gateway, "_callback_server", None)]
    return {s.server_address[1] if hasattr(s, "server_address") else s.port for s in servers if s is not None}


def test_nothing_listens_on_the_network_by_default(job, expected_children):
    inodes = set()
    for pid in _family(os.getpid(), besides=expected_children):  # not the suite's Spark JVM
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    listening, spark = [], _spark_ports()
    for table in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            listens = table.startswith("udp") or fields[3] == "0A"  # 0A: LISTEN
            if fields[9] in inodes and listens and int(fields[1].rsplit(":", 1)[1], 16) not in spark:
                listening.append((table, fields[1]))
    assert listening == []


def test_pickled_frames_from_an_unproven_peer_are_refused(job):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(job._coordinator.socket_path))
        cs.send(s, {"op": "status"}, cs.PICKLE)
        with pytest.raises(ConnectionError):
            cs.recv(s, trusted=False)
    assert job._coordinator.describe()["status"] == "RUNNING"  # the job did not mind


def test_a_checkpoint_directory_others_may_write_is_refused(tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by nobody else"):
        CheckpointStore(d)
