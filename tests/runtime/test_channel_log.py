"""The durable channel log against a plain list of the batches appended."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

from stretch.runtime.channel_log import ChannelLog


def batch(i: int, rows: int = 50) -> pa.RecordBatch:
    return pa.record_batch(
        {"n": pa.array(range(i * 1000, i * 1000 + rows), pa.int64()), "s": [f"b{i}"] * rows}
    )


def test_offsets_ranges_and_reopen(tmp_path):
    log = ChannelLog(tmp_path, segment_bytes=4096)
    model = [batch(i, random.Random(i).randrange(1, 200)) for i in range(40)]
    assert [log.append(b) for b in model[:25]] == list(range(25))
    rng = random.Random(1)
    for _ in range(20):
        a = rng.randrange(0, 25)
        b = rng.randrange(a, 26)
        assert list(log.read(a, b)) == model[a:b]
    log.close()
    again = ChannelLog(tmp_path, segment_bytes=4096)  # a restarted job continues the offsets
    assert again.end_offset == 25
    assert [again.append(b) for b in model[25:]] == list(range(25, 40))
    assert list(again.read(0)) == model
    assert len(list(tmp_path.glob("seg-*.arrows"))) > 3
    with pytest.raises(LookupError):
        list(again.read(0, 41))


def test_batches_appended_together_read_as_if_appended_one_by_one(tmp_path):
    """``append_ipcs`` (the logger's copy of what is queued) against the batches one by one:
    the same offsets, the same batches, across segments and a reopen; a truncate still works."""
    log = ChannelLog(tmp_path, segment_bytes=4096)
    rng = random.Random(3)
    model = [batch(i, rng.randrange(1, 120)) for i in range(200)]

    def ipc(b: pa.RecordBatch) -> pa.Buffer:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, b.schema) as writer:
            writer.write_batch(b)
        return sink.getvalue()

    k = 0
    while k < 150:
        group = model[k : k + rng.randrange(1, 30)]
        assert log.append_ipcs([ipc(b) for b in group]) == k
        k += len(group)
    log.close()
    again = ChannelLog(tmp_path, segment_bytes=4096)
    assert [again.append(b) for b in model[k:]] == list(range(k, len(model)))
    assert list(again.read(0)) == model
    again.truncate(100)
    assert again.append_ipcs([ipc(model[100]), ipc(model[101])]) == 100
    assert list(again.read(0)) == model[:102]


def test_segments_go_when_every_reader_committed_past_them(tmp_path):
    log = ChannelLog(tmp_path, segment_bytes=4096)
    reader = ChannelLog(tmp_path, create=False)  # a reader, as a Spark executor opens it
    reader.register("spark-a")
    reader.register("spark-b")
    model = [batch(i) for i in range(30)]
    for b in model[:20]:
        log.append(b)
    reader.commit("spark-a", 20)
    reader.commit("spark-b", 12)
    assert reader.start_offset == 0  # readers never delete: the job does, at its next segment
    for b in model[20:]:
        log.append(b)
    assert 0 < log.start_offset <= 12
    assert list(reader.read(12)) == model[12:]
    with pytest.raises(LookupError, match="no longer retained"):
        list(reader.read(0))
    reader.commit("spark-b", 5)  # commits never move back
    assert reader.commits() == {"spark-a": 20, "spark-b": 12}


def test_a_reader_that_caught_up_never_loses_what_comes_next(tmp_path):
    log = ChannelLog(tmp_path, segment_bytes=1 << 20)
    reader = ChannelLog(tmp_path, create=False)
    reader.register("q")
    model = [batch(i) for i in range(6)]
    for b in model[:3]:
        log.append(b)
    reader.commit("q", 3)
    log.append(model[3])
    assert list(reader.read(3)) == model[3:4]


def test_size_bound_drops_the_oldest_segments(tmp_path):
    log = ChannelLog(tmp_path, max_bytes=20_000, segment_bytes=4096)
    model = [batch(i) for i in range(100)]
    for b in model:
        log.append(b)
    held = sum(p.stat().st_size for p in tmp_path.glob("seg-*.arrows"))
    assert held <= 20_000 + 4096 + 2000
    start = log.start_offset
    assert start > 0
    assert list(log.read(start)) == model[start:]


def test_the_size_bound_keeps_everything_from_a_pinned_offset(tmp_path):
    """A checkpointed job pins its input log at the latest checkpoint's offset: a recovery must
    be able to read from there, however much arrived since."""
    log = ChannelLog(tmp_path, max_bytes=20_000, segment_bytes=4096)
    model = [batch(i) for i in range(100)]
    log.pinned = 10
    for b in model:
        log.append(b)
    assert log.start_offset <= 10
    assert list(log.read(10)) == model[10:]
    log.pinned = 60  # the next checkpoint: what comes before it may go
    log.append(batch(100))
    model.append(batch(100))
    assert 10 < log.start_offset <= 60
    assert list(log.read(60)) == model[60:]


def test_truncate_drops_the_end_and_the_next_append_reuses_its_offsets(tmp_path):
    log = ChannelLog(tmp_path, segment_bytes=4096)
    model = [batch(i) for i in range(40)]
    for b in model:
        log.append(b)
    log.truncate(23)
    assert log.end_offset == 23
    assert log.append(batch(99)) == 23
    assert list(log.read(20)) == [*model[20:23], batch(99)]
    log.truncate(0)
    assert log.end_offset == 0 and list(log.read(0)) == []


def test_readers_stop_at_the_committed_offset(tmp_path):
    log = ChannelLog(tmp_path, segment_bytes=4096)
    for i in range(10):
        log.append(batch(i))
    log.set_committed(6)
    assert ChannelLog(tmp_path, create=False).readable_end == 6
    log.set_committed(None)
    assert ChannelLog(tmp_path, create=False).readable_end == 10


def test_another_process_reads_while_the_job_appends(tmp_path):
    log = ChannelLog(tmp_path, segment_bytes=4096)
    model = [batch(i) for i in range(12)]
    for b in model:
        log.append(b)
    code = textwrap.dedent(f"""
        from stretch.runtime.channel_log import ChannelLog
        log = ChannelLog({str(tmp_path)!r})
        print(sum(b.column("n").to_numpy().sum() for b in log.read(3, 12)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == sum(int(b.column("n").to_numpy().sum()) for b in model[3:12])
    assert not log.ended
    log.end()
    assert ChannelLog(tmp_path).ended


def test_a_poke_wakes_a_reader_waiting_for_more_without_adding_any(shm_prefix):
    """A checkpoint asked of a job whose channel is idle wakes its source at once (LogTail.poke)."""
    import threading
    import time

    from stretch.runtime.channel_log import LogTail

    tail = LogTail.create(shm_prefix, 5)
    reader = LogTail.attach(tail.name)
    try:
        assert reader.wait(4, timeout=0.01)  # offset 4 is there already
        t0 = time.monotonic()
        assert not reader.wait(5, timeout=0.05)  # nothing more: a timeout
        assert time.monotonic() - t0 >= 0.04
        woke = {}

        def wait() -> None:
            start = time.monotonic()
            woke["more"] = reader.wait(5, timeout=10)
            woke["after"] = time.monotonic() - start

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.2)
        tail.poke()
        waiter.join(5)
        assert woke["more"] is False and 0.15 < woke["after"] < 2  # woken by the poke, not data
        assert tail.end == 5
        tail.publish(6)
        assert reader.wait(5, timeout=0.01)  # and real data still wakes it, with True
    finally:
        reader.close()
        tail.close()
