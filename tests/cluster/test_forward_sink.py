"""What an instance's forward sends, in which order (cluster.forward_sink): its records with their
timestamps, each watermark after the records before it, at most IN_FLIGHT writes on their way,
and its split named after its node and instance."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest

from stretch.cluster.forward_sink import IN_FLIGHT, ForwardSink
from stretch.common import Types
from stretch.runtime.batch import TS_COLUMN, Records
from stretch.runtime.event_time import MIN_WATERMARK

PAIR = Types.TUPLE([Types.STRING(), Types.LONG()])


class Recorder:
    """Stands in for the ClusterWriter a forward's sender thread opens: what it was told, in order."""

    made: list = []

    def __init__(self, address, job, channel, secret=None, tls=None, split=None):
        self.split, self.calls, self.gate = split, [], threading.Event()
        self.gate.set()
        Recorder.made.append(self)

    def write(self, table):
        self.gate.wait(10)
        self.calls.append(("rows", table))

    def advance(self, watermark):
        self.calls.append(("watermark", watermark))

    def close(self):
        self.calls.append(("closed", None))


@pytest.fixture
def recorder(monkeypatch):
    import stretch.cluster.writer

    Recorder.made = []
    monkeypatch.setattr(stretch.cluster.writer, "ClusterWriter", Recorder)
    return Recorder


def writer(timed=True, node="node-3", instance=2):
    sink = ForwardSink("users->regions", {"job": "j", "address": "/nowhere"}, timed)
    sink.node = node
    w = sink.create_writer(2)
    w.open(instance)
    return w


def records(values, ts):
    return Records(items=values, type_info=PAIR, timestamps=np.array(ts, dtype=np.int64))


def test_records_keep_their_timestamps_and_each_watermark_follows_the_records_before_it(recorder):
    w = writer()
    w.write_records(records([("a", 1), ("b", 2)], [10, 12]), 2)
    w.watermark(11)
    w.watermark(12)  # two in a row: one may stand for both
    w.write_records(records([("c", 3)], [15]), 2)
    w.flush(wait=False)
    w.close()
    (sent,) = recorder.made
    assert sent.split.startswith("node-3/2#")  # the placeholder node-3/2 it takes the place of
    kinds = [k for k, _ in sent.calls]
    assert kinds[0] == "rows" and kinds[-2:] == ["rows", "closed"]
    assert set(kinds[1:-2]) == {"watermark"}
    marks = [v for k, v in sent.calls if k == "watermark"]
    assert marks[-1] == 12 and marks == sorted(marks)
    first, last = sent.calls[0][1], sent.calls[-2][1]
    assert first.column(TS_COLUMN).to_pylist() == [10, 12]
    assert first.drop_columns([TS_COLUMN]).to_pylist() == [{"f0": "a", "f1": 1}, {"f0": "b", "f1": 2}]
    assert last.column(TS_COLUMN).to_pylist() == [15]


def test_without_event_time_no_timestamps_and_no_watermarks_go(recorder):
    w = writer(timed=False)
    w.write_records(records([("a", 1)], [10]), 1)
    w.watermark(11)
    w.close()
    (sent,) = recorder.made
    assert sent.split is None
    assert [k for k, _ in sent.calls] == ["rows", "closed"]
    assert sent.calls[0][1].schema.names == ["f0", "f1"]


def test_an_instance_that_never_spoke_closes_its_split_all_the_same(recorder):
    writer().close()
    (sent,) = recorder.made
    assert sent.calls == [("watermark", MIN_WATERMARK), ("closed", None)]


def test_an_instance_waits_once_its_writes_in_flight_are_taken_and_an_epoch_waits_for_all(recorder):
    w = writer()
    batch = pa.RecordBatch.from_pylist([{"f0": "a", "f1": 1}])
    w.write(batch, 2)
    w.flush(wait=False)
    while not recorder.made:
        threading.Event().wait(0.01)
    sent = recorder.made[0]
    sent.gate.clear()  # the receiving node is slow: writes wait
    for _ in range(IN_FLIGHT):
        w.write(batch, 2)
        w.flush(wait=False)
    blocked = threading.Thread(target=lambda: (w.write(batch, 2), w.flush(wait=False)))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # backpressure: the instance waits instead of holding more
    sent.gate.set()
    blocked.join(10)
    w.flush(wait=True)
    assert sum(k == "rows" for k, _ in sent.calls) == IN_FLIGHT + 2
    w.close()


def test_records_with_and_without_timestamps_go_as_writes_of_their_own_in_order(recorder):
    w = writer()
    w.write_records(records([("a", 1)], [10]), 2)
    w.write_records(Records(items=[("b", 2)], type_info=PAIR), 2)  # a processing-time timer's
    w.write_records(records([("c", 3)], [12]), 2)
    w.close()
    (sent,) = recorder.made
    rows = [v for k, v in sent.calls if k == "rows"]
    assert [t.column("f0").to_pylist() for t in rows] == [["a"], ["b"], ["c"]]
    assert [TS_COLUMN in t.schema.names for t in rows] == [True, False, True]
