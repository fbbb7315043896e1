"""The gate: many producer and reader processes on one tiny gate, checked against what was sent.

The gates here are tiny (a few slots, 64 KiB of data) so that producers spend most of their time
blocked on backpressure and the data area wraps many times.
"""

from __future__ import annotations

import pickle
import random
import threading
import time
from collections import Counter

import pyarrow as pa
import pytest

from stretch._shm import Segment
from stretch.runtime import gate as gate_module
from stretch.runtime.gate import Gate, GateClosed, Kind

SLOTS = 4
DATA = 64 << 10


@pytest.fixture
def make_gate(shm_prefix):
    gates = []

    def make(slots=SLOTS, data=DATA, readers=8):
        g = Gate.create(shm_prefix, "gate", slot_capacity=slots, data_bytes=data, max_readers=readers)
        gates.append(g)
        return g

    yield make
    for g in gates:
        g.segment.close()


def _await(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


SCHEMA = pa.schema([("p", pa.int64()), ("b", pa.int64()), ("i", pa.int64()), ("payload", pa.string())])


def _rows(p: int, b: int, n: int, rng: random.Random) -> list[tuple]:
    return [(p, b, i, f"{p}:{b}:{i}:" + "x" * rng.randrange(0, 120)) for i in range(n)]


def _batch(rows: list[tuple]) -> pa.RecordBatch:
    cols = list(zip(*rows)) if rows else [[], [], [], []]
    return pa.record_batch([pa.array(c, t.type) for c, t in zip(cols, SCHEMA)], schema=SCHEMA)


def _producer_plan(p: int, n_batches: int) -> list[list[tuple]]:
    """Producer p's batches: mostly small, every 40th one big enough (> 16 KiB) to be split."""
    rng = random.Random(p)
    plan = []
    for b in range(n_batches):
        n = rng.randrange(250, 350) if b % 40 == 17 else rng.randrange(1, 40)
        plan.append(_rows(p, b, n, rng))
    return plan


def _read_all(g: Gate, reader: int, until_eos=True, slow=0.0, seed=0, timeout=30.0) -> list[tuple]:
    """Read from the reader's cursor to the end of stream; a log of (seq, kind, arg0, arg1, rows)."""
    rng = random.Random(seed)
    seq = g.cursor(reader)
    log = []
    while True:
        if not g.wait(seq, timeout):
            raise TimeoutError(f"reader {reader} waited {timeout} s for entry {seq}")
        e = g.read(seq)
        assert e.seq == seq
        rows = [tuple(r.values()) for r in e.batch.to_pylist()] if e.kind is Kind.DATA else None
        log.append((seq, int(e.kind), e.arg0, e.arg1, rows))
        seq += 1
        g.advance(reader, seq)  # only after copying: the batch is a view of the gate
        if e.kind is Kind.END_OF_STREAM and until_eos:
            return log
        if slow:
            time.sleep(rng.random() * slow)


def _reader_proc(name: str, reader: int, path: str, slow: float = 0.0):
    def run():
        g = Gate.attach(name)
        log = _read_all(g, reader, slow=slow, seed=reader)
        with open(path, "wb") as f:
            pickle.dump(log, f)

    return run


def _producer_proc(name: str, p: int, plan: list[list[tuple]]):
    def run():
        g = Gate.attach(name)
        for rows in plan:
            g.append_batch(_batch(rows), producer=p, timeout=60)

    return run


def _load(path) -> list:
    with open(path, "rb") as f:
        return pickle.load(f)


def test_many_producers_and_readers_on_a_tiny_gate(make_gate, forked, tmp_path):
    n_producers, n_batches, n_readers = 3, 200, 3
    g = make_gate()
    plans = {p: _producer_plan(p, n_batches) for p in range(1, n_producers + 1)}
    for j in range(n_readers):
        assert g.open_reader(j, at=0) == 0
    readers = [
        forked.start(_reader_proc(g.name, j, str(tmp_path / f"r{j}"), slow=0.003 if j == 2 else 0.0))
        for j in range(n_readers)
    ]
    producers = [forked.start(_producer_proc(g.name, p, plans[p])) for p in plans]
    depths = []
    while any(p.is_alive() for p in producers):
        depths.append(g.depth())
        time.sleep(0.005)
    forked.join(producers, timeout=60)
    g.append_control(Kind.END_OF_STREAM, 7, 8)
    forked.join(readers, timeout=60)

    logs = [_load(tmp_path / f"r{j}") for j in range(n_readers)]
    for log in logs[1:]:
        assert log == logs[0], "every reader must see the same entries in the same order"
    log = logs[0]
    assert [e[0] for e in log] == list(range(len(log))), "sequence numbers are consecutive from 0"
    assert log[-1][1:4] == (Kind.END_OF_STREAM, 7, 8)
    assert all(e[1] == Kind.DATA for e in log[:-1]), "end of stream comes after all the data"
    assert g.tail == len(log)

    data = [e for e in log if e[1] == Kind.DATA]
    for _, _, arg0, _, rows in data:
        assert rows, "no empty entries"
        assert {r[0] for r in rows} == {arg0}, "arg0 carries the producer of the entry"
    got = [r for e in data for r in e[4]]
    sent = [r for plan in plans.values() for rows in plan for r in rows]
    assert Counter(got) == Counter(sent), "every row arrives exactly once"
    for p, plan in plans.items():
        assert [r for r in got if r[0] == p] == [r for rows in plan for r in rows], f"producer {p} order"
    assert len(data) > n_producers * n_batches, "the big batches were split into several entries"
    assert max(depths) <= SLOTS, "depth never exceeds the gate's slots"
    assert SLOTS in depths, "the gate was seen full: producers were held back"
    assert g.depth() == 0


def test_slow_reader_holds_back_producers_and_loses_nothing(make_gate, forked, tmp_path):
    g = make_gate()
    plan = _producer_plan(1, 120)
    g.open_reader(0, at=0)
    g.open_reader(1, at=0)

    def fast():
        # Records how far ahead of the slow reader it ever got.
        gg = Gate.attach(g.name)
        seq, lead = 0, 0
        while True:
            assert gg.wait(seq, 30)
            lead = max(lead, seq - gg.cursor(1))
            e = gg.read(seq)
            seq += 1
            gg.advance(0, seq)
            if e.kind is Kind.END_OF_STREAM:
                break
        with open(tmp_path / "lead", "w") as f:
            f.write(str(lead))

    forked.start(fast)
    slow = forked.start(_reader_proc(g.name, 1, str(tmp_path / "slow"), slow=0.01))
    forked.start(_producer_proc(g.name, 1, plan))
    forked.join(forked.procs[2:], timeout=60)
    g.append_control(Kind.END_OF_STREAM)
    forked.join(timeout=60)
    assert not slow.is_alive()
    got = [r for e in _load(tmp_path / "slow") if e[1] == Kind.DATA for r in e[4]]
    assert got == [r for rows in plan for r in rows]
    assert int((tmp_path / "lead").read_text()) <= SLOTS


def test_close_wakes_blocked_producers_and_reader_with_gate_closed(make_gate, forked):
    g = make_gate(slots=2)
    g.open_reader(0, at=0)  # never advances: the gate fills after two entries
    small = _batch([(1, 0, 0, "x")])

    def producer():
        gg = Gate.attach(g.name)
        try:
            while True:
                gg.append_batch(small, producer=1)
        except GateClosed:
            return

    def reader():
        gg = Gate.attach(g.name)
        gg.open_reader(1)
        try:
            gg.wait(10_000)  # far beyond anything appended: blocks until closed
        except GateClosed:
            return
        raise AssertionError("wait returned on a gate that never got the entry")

    procs = [forked.start(producer), forked.start(producer), forked.start(reader)]
    _await(lambda: g.tail == 2, what="the gate to fill")
    time.sleep(0.3)  # everybody is asleep now: one producer on space, one on the lock, the reader
    assert all(p.is_alive() for p in procs)
    assert g.tail == 2
    t0 = time.monotonic()
    g.close()
    assert g.closed
    forked.join(procs, timeout=5)
    assert time.monotonic() - t0 < 2.0, "close() must wake the sleepers promptly"


def test_closed_gate_still_drains_what_was_appended(make_gate):
    g = make_gate()
    g.open_reader(0, at=0)
    g.append_batch(_batch([(1, 0, 0, "a")]))
    g.append_control(Kind.MARK, 5)
    g.close()
    assert g.wait(0, 1.0) and g.wait(1, 1.0)
    assert g.read(0).batch.column("payload").to_pylist() == ["a"]
    assert g.read(1).arg0 == 5
    with pytest.raises(GateClosed):
        g.wait(2, 1.0)


def test_entry_larger_than_the_gate_raises_a_clear_value_error(make_gate):
    g = make_gate()
    g.open_reader(0, at=0)
    assert g.max_entry_bytes == DATA // 4
    for size in (DATA // 4 + 100, DATA + 1000):
        with pytest.raises(ValueError, match=rf"does not fit a gate of {DATA} bytes"):
            g.append_batch(_batch([(1, 0, 0, "y" * size)]))
    assert g.tail == 0
    # The producer lock was not left held: the gate keeps working.
    g.append_batch(_batch([(1, 1, 0, "ok")]), timeout=2)
    assert g.tail == 1
    assert g.read(0).batch.column("payload").to_pylist() == ["ok"]


def test_a_rejected_batch_is_not_partially_appended(make_gate):
    """A batch is accepted whole or not at all: a reader must not see part of a rejected batch."""
    g = make_gate()
    g.open_reader(0, at=0)
    rows = [(1, 0, i, "s") for i in range(3)] + [(1, 0, 3, "h" * DATA)]
    with pytest.raises(ValueError, match="does not fit"):
        g.append_batch(_batch(rows))
    assert g.tail == 0, f"{g.tail} entries of the rejected batch were published"


def test_batch_larger_than_a_quarter_is_split_and_arrives_complete(make_gate):
    g = make_gate(slots=16)
    g.open_reader(0, at=0)
    rows = _rows(1, 0, 300, random.Random(5))  # about 30 KB: more than a quarter of 64 KiB
    last = g.append_batch(_batch(rows), producer=3)
    assert last == g.tail - 1
    assert g.tail > 1, "the batch was split"
    entries = [g.read(s) for s in range(g.tail)]
    assert all(e.kind is Kind.DATA and e.arg0 == 3 for e in entries)
    assert [tuple(r.values()) for e in entries for r in e.batch.to_pylist()] == rows


def test_batch_larger_than_the_whole_gate_streams_through_a_reader(make_gate, forked, tmp_path):
    g = make_gate(slots=8)
    g.open_reader(0, at=0)
    forked.start(_reader_proc(g.name, 0, str(tmp_path / "r")))
    rows = _rows(2, 0, 2000, random.Random(6))  # about 3x the gate's data area
    g.append_batch(_batch(rows), producer=2, timeout=30)
    g.append_control(Kind.END_OF_STREAM)
    forked.join(timeout=30)
    log = _load(tmp_path / "r")
    assert [r for e in log if e[1] == Kind.DATA for r in e[4]] == rows


def test_depth_reflects_the_slowest_active_reader(make_gate):
    g = make_gate(slots=16)
    assert g.depth() == 0
    for j in range(3):
        g.open_reader(j, at=0)
    for i in range(5):
        g.append_control(Kind.MARK, i)
    assert g.depth() == 5
    g.advance(0, 5)
    g.advance(1, 2)
    g.advance(2, 4)
    assert g.depth() == 3
    g.close_reader(1)
    assert g.depth() == 1
    g.close_reader(2)
    assert g.depth() == 0
    g.close_reader(0)
    assert g.depth() == 0, "no active reader: nothing is pending"


def test_reader_opened_late_starts_at_the_tail(make_gate):
    g = make_gate(slots=16)
    g.open_reader(0, at=0)
    for i in range(3):
        g.append_control(Kind.MARK, i)
    assert g.open_reader(1) == 3
    assert g.cursor(1) == 3
    for i in range(3, 5):
        g.append_control(Kind.MARK, i)
    seen = []
    seq = g.cursor(1)
    while g.wait(seq, 0.05):
        seen.append(g.read(seq).arg0)
        seq += 1
        g.advance(1, seq)
    assert seen == [3, 4]
    assert g.depth() == 5  # reader 0 has read nothing


def test_without_readers_producers_never_block(make_gate):
    g = make_gate()
    t0 = time.monotonic()
    for b in range(50):
        g.append_batch(_batch([(1, b, 0, "z" * 1000)]), timeout=1)
    assert g.tail == 50
    assert time.monotonic() - t0 < 5


def test_wait_times_out_when_nothing_arrives(make_gate):
    g = make_gate()
    g.open_reader(0)
    t0 = time.monotonic()
    assert g.wait(0, 0.2) is False
    assert 0.15 <= time.monotonic() - t0 < 2.0


def test_full_gate_times_out_a_producer_with_a_deadline(make_gate):
    g = make_gate(slots=2)
    g.open_reader(0, at=0)
    g.append_control(Kind.MARK)
    g.append_control(Kind.MARK)
    with pytest.raises(TimeoutError):
        g.append_batch(_batch([(1, 0, 0, "t")]), timeout=0.2)
    g.advance(0, 1)  # space again; the lock was released by the failed append
    g.append_batch(_batch([(1, 0, 0, "t")]), timeout=1)
    assert g.tail == 3


def test_bad_reader_slot_and_non_gate_segment_are_rejected(make_gate, shm_prefix):
    g = make_gate(readers=4)
    with pytest.raises(ValueError, match="reader slot"):
        g.open_reader(4)
    with pytest.raises(ValueError, match="reader slot"):
        g.open_reader(-1)
    seg = Segment.create(shm_prefix, "notgate", 1 << 16)
    try:
        with pytest.raises(ValueError, match="not a gate"):
            Gate(seg)
    finally:
        seg.close()


@pytest.mark.parametrize(
    ("free", "expected"),
    [(1 << 30, 32 << 20), (64 << 20, 8 << 20), (16 << 20, 2 << 20), (3 << 20, 1 << 20), (0, 1 << 20)],
)
def test_default_gate_size_is_32_mib_or_an_eighth_of_the_free_shared_memory(
    shm_prefix, monkeypatch, free, expected
):
    monkeypatch.setattr(gate_module, "free_bytes", lambda: free)
    assert gate_module.default_data_bytes() == expected
    if expected <= 8 << 20:  # and a gate made without a size gets it
        g = Gate.create(shm_prefix, "gate")
        try:
            assert g.data_capacity == expected
        finally:
            g.segment.close()


def _append_entry(g, b: int, control: bool, max_rows: int, rng) -> tuple[int, int]:
    """A watermark (``control``) or a batch of up to ``max_rows`` rows: its sequence number and
    how many positions it takes (a control record one)."""
    if control:
        return g.append_control(Kind.WATERMARK, 0, b), 1
    rows = rng.randrange(0, max_rows)
    return g.append_batch(_batch(_rows(0, b, rows, rng))), max(rows, 1)


def test_positions_count_rows_and_name_the_entry_that_holds_them(make_gate):
    g = make_gate(slots=16, readers=2)
    g.open_reader(0, 0)
    rng = random.Random(3)
    expected, position = [], 0
    for b in range(10):
        seq, size = _append_entry(g, b, b % 3 == 2, 40, rng)
        expected.append((seq, position, position + size))
        position += size
    assert g.position == position
    for seq, start, end in expected:
        assert g.start_of(seq) == start
        entry = g.read(seq)
        assert (entry.start, entry.end) == (start, end)
        assert {g.seq_at(p) for p in range(start, end)} == {seq}  # every position inside the entry
    assert g.seq_at(position) == g.tail  # the next entry's position: a reader opened there waits
    assert g.end_position is None
    end_seq = g.append_control(Kind.END_OF_STREAM)
    g.append_control(Kind.CHECKPOINT, 1)  # what follows the end does not move it
    assert g.end_position == g.start_of(end_seq) == position


def test_seq_at_finds_the_entry_of_a_position_after_the_ring_wrapped(make_gate):
    """seq_at searches the entries still in the ring: checked against a plain list of every
    entry's (seq, start, end), for every position of the live entries, while a reader keeps a few
    entries behind the tail and the ring wraps many times."""
    g = make_gate(slots=8, readers=2)
    g.open_reader(0, 0)
    rng = random.Random(7)
    entries, position = [], 0
    for b in range(60):
        seq, size = _append_entry(g, b, b % 4 == 3, 30, rng)
        entries.append((seq, position, position + size))
        position += size
        live = entries[-rng.randrange(1, 7) :]  # the reader lets the others go
        g.advance(0, live[0][0])
        for seq, start, end in live:
            assert {g.seq_at(p) for p in range(start, end)} == {seq}
        assert g.seq_at(position) == g.tail


def test_rows_from_counts_the_records_queued_from_a_position_not_the_marks(make_gate):
    """What a rescale or an update reports as queued behind its position: checked against a plain
    list with one flag per position (a record, or a watermark or an empty batch, which take a
    position and hold none), from every position of the live entries, as the ring wraps."""
    g = make_gate(slots=8, readers=2)
    g.open_reader(0, 0)
    rng = random.Random(11)
    records: list[bool] = []  # per position: does it hold a record
    entries = []
    for b in range(60):
        seq, size = _append_entry(g, b, b % 3 == 1, 30, rng)
        start = len(records)
        holds = g.read(seq).batch is not None and g.read(seq).batch.num_rows > 0
        records += [holds] * size
        entries.append((seq, start))
        live = entries[-rng.randrange(1, 7) :]
        g.advance(0, live[0][0])
        for p in range(live[0][1], len(records) + 1):
            assert g.rows_from(p) == sum(records[p:]), p
    assert sum(records) < len(records)  # marks and empty batches were among them


def test_a_nudge_wakes_a_waiting_reader_without_an_entry(make_gate):
    g = make_gate()
    since = g.wake_count()
    assert not g.wait(0, timeout=0.01, since=since)  # nothing happened: an ordinary timeout
    nudger = threading.Timer(0.05, g.nudge)
    nudger.start()
    t0 = time.monotonic()
    assert not g.wait(0, timeout=5, since=since)  # woken by the nudge, with nothing to read
    assert time.monotonic() - t0 < 2
    nudger.join()
    assert not g.wait(0, timeout=5, since=since)  # nudged before the wait began: at once
    since = g.wake_count()
    g.append_control(Kind.WATERMARK, 0, 1)
    assert g.wait(0, timeout=5, since=since)  # an entry arrived: readable


def _stream_bytes(batch: pa.RecordBatch) -> int:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().size


def _shapes() -> list[pa.RecordBatch]:
    rng = random.Random(7)
    n = 300
    ints = pa.array([rng.randrange(1 << 40) if rng.random() > 0.1 else None for _ in range(n)], pa.int64())
    text = pa.array([("x" * rng.randrange(30)) if rng.random() > 0.2 else None for _ in range(n)])
    nested = pa.array([{"a": [i, i + 1], "b": str(i)} for i in range(n)])
    labelled = pa.record_batch({"n": ints}).replace_schema_metadata({"k": "v" * 50})
    kg = pa.field("__kg", pa.uint16(), metadata={b"stretch.kg_runs": b"1"})
    return [
        pa.record_batch({"n": ints, "s": text, "t": nested}),
        pa.record_batch({"n": ints, "s": text}).slice(17, 101),  # buffers shared with the whole
        pa.record_batch({"b": pa.array([True, False, None] * 7)}),
        pa.record_batch({"n": ints}).slice(0, 0),
        labelled,
        pa.record_batch([ints, pa.array(range(n), pa.uint16())], schema=pa.schema([("n", pa.int64()), kg])),
        pa.record_batch({"d": pa.array(["a", "b", None, "a"] * 20).dictionary_encode()}),
        pa.record_batch(
            {"l": pa.array([["a", "b"], ["b"]] * 5, pa.list_(pa.dictionary(pa.int8(), pa.string())))}
        ),
    ]


@pytest.mark.parametrize("i", range(len(_shapes())))
def test_an_entrys_size_is_its_ipc_streams(i):
    """The gate sizes an entry without writing it: the size must be the stream's to the byte."""
    batch = _shapes()[i]
    assert gate_module._ipc_size(batch) == _stream_bytes(batch)


def _pairs(start: int, n: int) -> pa.RecordBatch:
    return pa.record_batch({"k": pa.array([i % 3 for i in range(start, start + n)], pa.int64())})


def test_small_entries_queued_are_read_as_one_up_to_what_must_stay_apart(make_gate):
    g = make_gate(slots=64, data=1 << 20)
    g.open_reader(0, 0)
    plain = [_pairs(0, 1), _pairs(1, 2), _pairs(3, 1)]
    tagged = plain[0].replace_schema_metadata({"stretch.txn": "7"})
    appended = [
        *[(b, 0) for b in plain],  # joined
        (pa.record_batch({"k": pa.array([], pa.int64())}), 0),  # no rows: alone
        (_pairs(4, 1), 5),  # another transaction's rows: apart from the next
        (_pairs(5, 1), 6),
        (tagged, 0),  # another schema (metadata): apart
        (_pairs(6, 300), 0),  # not small: alone
        (_pairs(306, 2), 0),
        (_pairs(308, 1), 0),  # joined, up to the watermark
    ]
    for batch, txn in appended:
        g.append_batch(batch, txn=txn)
    g.append_control(Kind.WATERMARK, 1, 100)
    g.append_batch(_pairs(309, 1))
    read, seq = [], 0
    while seq < g.tail:
        entry, last = g.read_joined(seq)
        read.append((entry.kind, entry.batch.to_pylist() if entry.batch is not None else None, entry.start))
        assert entry.end == g.start_of(last + 1)  # one entry over the positions of those it joins
        seq = last + 1
    rows = lambda *bs: [r for b in bs for r in b.to_pylist()]  # noqa: E731
    starts = [g.start_of(s) for s in range(g.tail)]
    assert read == [
        (Kind.DATA, rows(*plain), starts[0]),
        (Kind.DATA, [], starts[3]),
        (Kind.DATA, rows(appended[4][0]), starts[4]),
        (Kind.DATA, rows(appended[5][0]), starts[5]),
        (Kind.DATA, rows(tagged), starts[6]),
        (Kind.DATA, rows(appended[7][0]), starts[7]),
        (Kind.DATA, rows(appended[8][0], appended[9][0]), starts[8]),
        (Kind.WATERMARK, None, starts[10]),
        (Kind.DATA, rows(_pairs(309, 1)), starts[11]),
    ]
