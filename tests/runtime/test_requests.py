"""Requests from outside a job: whatever is said on its control socket, the job survives it and
finishes exactly; every refusal is an answer; slow, vanished and concurrent clients cost it nothing."""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from stretch import channels, jobs
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.runtime import control_socket as cs

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])
N = 2_000


def _start(name: str):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.from_source(ChannelSource("in", PAIR), None, "in").key_by(lambda r: r[0]).sum(1).name(
        "totals"
    ).sink_to(ChannelSink("out"))
    return env.execute_async(name)


def _finish_exactly(client, before: tuple = ()) -> None:
    """Feed the job (after ``before``, already fed), end its input and check every result against
    a plain-Python running sum."""
    records = [*before, *((i % 7, i) for i in range(N))]
    writer = channels.open_writer(client, "in")
    for i in range(len(before), len(records), 250):
        writer.write(records[i : i + 250])
    writer.end()
    got = sorted(tuple(r) for r in channels.open_reader(client, "out"))
    assert client.wait(60).name == "FINISHED"
    sums, want = {}, []
    for k, v in records:
        sums[k] = sums.get(k, 0) + v
        want.append((k, sums[k]))
    assert got == sorted(want)


def _raw(path, payload: bytes, fmt: int = cs.JSON, read: bool = True):
    """Send one frame as is; the reply frame's JSON, or None if the job closed the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        try:
            s.sendall(struct.pack(">IB", len(payload), fmt) + payload)
            return cs.recv(s, trusted=False, limit=cs.MAX_REPLY) if read else None
        except ConnectionError:  # the job closed the connection (a frame it refuses unread)
            return None


@pytest.mark.parametrize(
    "message",
    [[1, 2], 42, None, "x", {}, {"op": 7}, {"op": ["scale"]}, {"op": "nope"},
     {"op": "channel", "name": ["in"], "role": "writer"}, {"op": "channel_end", "name": {"a": 1}},
     {"op": "scale", "operator": ["totals"], "parallelism": 2}, {"op": "scale", "operator": "totals", "parallelism": "2"},
     {"op": "state", "operator": None}, {"op": "channel_publish", "name": "in"}, {"op": "channel_shape", "name": "in", "schema": "%%"}],
)  # fmt: skip
def test_a_malformed_request_gets_an_error_reply_and_the_job_goes_on(message):
    client = _start(f"malformed-{abs(hash(json.dumps(message))) % 10**8}")
    reply = _raw(client._coordinator.socket_path, json.dumps(message).encode())
    assert reply is not None and reply["ok"] is False and reply["error"], reply
    _finish_exactly(client)


def test_frames_that_are_not_json_too_large_or_pickled_are_refused_and_the_job_goes_on():
    client = _start("bad frames")
    path = client._coordinator.socket_path
    assert _raw(path, b"\xff\xfe not json")["ok"] is False
    assert _raw(path, b"x" * (cs.MAX_REQUEST + 1)) is None  # refused unread: the connection closes
    assert _raw(path, b"\x80\x04K\x01.", fmt=cs.PICKLE) is None  # nothing pickled from outside
    _finish_exactly(client)


@pytest.mark.parametrize("token", ["\u00e9t\u00e9", "", 12, None, ["x"]])
def test_a_hello_with_a_bad_token_is_answered_and_changes_nothing(token, capfd):
    client = _start(f"hello-{token!r}"[:40])
    hello = {"op": "hello", "token": token, "worker": 0, "pid": 1}
    assert _raw(client._coordinator.socket_path, json.dumps(hello).encode()) == {
        "ok": False,
        "error": "bad token",
    }
    _finish_exactly(client)
    assert "Traceback" not in capfd.readouterr().err


def test_clients_that_leave_before_their_answer_or_never_read_it_cost_the_job_nothing():
    client = _start("rude clients")
    path = client._coordinator.socket_path
    for _ in range(20):  # ask and leave at once
        _raw(path, json.dumps({"op": "status"}).encode(), read=False)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # asks a lot, reads nothing
    silent.connect(str(path))
    try:
        frame = json.dumps({"op": "status"}).encode()
        silent.setblocking(False)
        for _ in range(2000):
            try:
                silent.sendall(struct.pack(">IB", len(frame), cs.JSON) + frame)
            except BlockingIOError:
                break
        t0 = time.monotonic()
        writer = channels.open_writer("rude clients", "in")  # from elsewhere, by name: answered now
        assert time.monotonic() - t0 < 5
        writer.write([(1, 1)])
    finally:
        silent.close()
    status = jobs.find("rude clients").status()
    assert status["status"] == "RUNNING"
    _finish_exactly(client, before=((1, 1),))


def test_two_hundred_concurrent_requests_from_another_process_are_all_answered():
    client = _start("crowded socket")
    code = textwrap.dedent(
        f"""
        import threading
        from stretch.runtime.control_socket import request
        replies, errors = [], []
        def ask():
            try:
                replies.append(request({str(client._coordinator.socket_path)!r}, {{"op": "status"}}))
            except Exception as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=ask) for _ in range(200)]
        for t in threads: t.start()
        for t in threads: t.join()
        assert not errors, errors[:3]
        assert len(replies) == 200 and all(r["status"] == "RUNNING" for r in replies)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    _finish_exactly(client)


class Blocked(KeyedProcessFunction):
    """Holds every record while a file exists: a backlog for as long as the test wants."""

    def __init__(self, block: str):
        self.block = block

    def process_element(self, value, ctx):
        if os.path.exists(self.block):
            open(self.block + ".held", "w").close()  # the backlog is in the operator's gate
            while os.path.exists(self.block):
                time.sleep(0.01)
        yield value


def test_a_rescale_under_a_long_backlog_reports_progress_and_completes(tmp_path):
    block = tmp_path / "block"
    block.touch()
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    env.from_source(ChannelSource("in", PAIR), None, "in").key_by(lambda r: r[0]).process(
        Blocked(str(block))
    ).name("held").sink_to(ChannelSink("out"))
    client = env.execute_async("held backlog")
    try:
        writer = channels.open_writer(client, "in")
        records = [(i % 50, i) for i in range(500)]
        writer.write(records)
        deadline = time.monotonic() + 60
        while not (tmp_path / "block.held").exists():  # the instance holds the first record
            assert time.monotonic() < deadline
            time.sleep(0.01)
        progress, replies = [], []
        job = jobs.find("held backlog")

        def ask() -> None:
            try:  # the request's timeout bounds the silence between frames, not the operation
                message = {"op": "scale", "operator": "held", "parallelism": 2}
                replies.append(job.request(message, timeout=10, on_progress=progress.append))
            except Exception as e:
                replies.append(e)

        asking = threading.Thread(target=ask)
        asking.start()
        deadline = time.monotonic() + 60
        while len(progress) < 3:  # three seconds and more of backlog, reported as progress
            assert time.monotonic() < deadline and asking.is_alive(), replies
            time.sleep(0.05)
        block.unlink()
        asking.join(60)
        (report,) = replies
        assert report["ok"] and report["new_parallelism"] == 2, report
        assert all(p["progress"] and p["elapsed_ms"] >= 0 for p in progress)
        writer.end()
        assert sorted(tuple(r) for r in channels.open_reader(client, "out")) == sorted(records)
        assert client.wait(60).name == "FINISHED"
    finally:
        block.unlink(missing_ok=True)
        if not client._coordinator.done:
            client.cancel()


def test_an_unknown_operator_is_refused_the_same_way_however_it_is_asked():
    """A rescale, an update or a state query of an operator the job lacks: an UnknownOperator (a
    LookupError, not a KeyError, which Python prints in quotes) listing the job's operators, from
    the job's own client and from another process's handle alike; the job goes on."""
    from stretch.errors import UnknownOperator

    client = _start("unknown operator")
    remote = jobs.find(client.get_job_id())  # over the control socket, as another process asks
    asks = {
        "rescale": lambda: client.rescale("nope", 2),
        "update": lambda: client.update("nope", lambda r: r),
        "query_state": lambda: client.query_state("nope"),
        "remote rescale": lambda: remote.rescale("nope", 2),
        "remote update": lambda: remote.update("nope", "builtins:print"),
        "remote state": lambda: remote.state_location("nope"),
    }
    for what, ask in asks.items():
        with pytest.raises(UnknownOperator) as refused:
            ask()
        assert not isinstance(refused.value, KeyError), what
        message = str(refused.value)
        assert "'nope'" in message and "totals" in message and not message.startswith(('"', "'")), what
        assert "\n" not in message, what
    _finish_exactly(client)


def test_fuzzing_the_control_socket_never_fails_the_job():
    """Random frames, random JSON shapes, clients that vanish mid-frame or never read, for a few
    seconds while the job works; then the job finishes with exactly the reference results."""
    client = _start("fuzzed")
    path = str(client._coordinator.socket_path)
    rng = random.Random(19)
    ops = ["status", "metrics", "state", "channel", "channel_end", "scale", "checkpoint", "channel_publish",
           "channel_discard", "channel_shape", "hello", "nope", None, 3]  # fmt: skip
    values = [None, 0, -1, 2**70, 1.5, "", "in", "out", "totals", "\u2603", [], [1], {}, {"a": [None]}, True]

    def shape(depth: int = 0):
        if depth > 2 or rng.random() < 0.3:
            return rng.choice(values)
        if rng.random() < 0.5:
            return [shape(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["op", "name", "role", "operator", "parallelism", "files", "x"]): shape(depth + 1)
                for _ in range(rng.randrange(4))}  # fmt: skip

    def fuzz(deadline: float) -> None:
        while time.monotonic() < deadline:
            msg = shape()
            if isinstance(msg, dict) and rng.random() < 0.7:
                msg["op"] = rng.choice(ops)
                if msg["op"] in ("scale",) and rng.random() < 0.5:
                    msg.update(operator="totals", parallelism=rng.choice([0, 1, 2, 3, 129, "x"]))
                if msg["op"] == "channel_end":
                    msg["name"] = rng.choice(["out", "nope", 5])  # never the real input's end
            payload = json.dumps(msg).encode() if rng.random() < 0.8 else rng.randbytes(rng.randrange(64))
            kind = rng.random()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                try:
                    s.connect(path)
                    if kind < 0.1:  # vanish mid-frame
                        s.sendall(struct.pack(">IB", len(payload) + 10, cs.JSON) + payload)
                    elif kind < 0.2:  # a header claiming a huge frame
                        s.sendall(struct.pack(">IB", 1 << 31, rng.choice([cs.JSON, cs.PICKLE, 0])))
                    else:
                        s.sendall(
                            struct.pack(">IB", len(payload), rng.choice([cs.JSON, cs.JSON, cs.PICKLE, 7]))
                            + payload
                        )
                        if kind < 0.6:
                            cs.recv(s, trusted=False, limit=cs.MAX_REPLY)
                except (OSError, ConnectionError, ValueError):
                    pass

    deadline = time.monotonic() + 4
    threads = [threading.Thread(target=fuzz, args=(deadline,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert client.get_job_status().result().name == "RUNNING"
    _finish_exactly(client)
