"""An output channel's log writer: a forward log's (``timed``) keeps the records' timestamps and
puts the producers' watermarks between them, in order, as batches of no rows; another output
channel drops the engine's columns and takes no watermarks."""

from __future__ import annotations

import pyarrow as pa

from stretch import _shm as shm
from stretch.runtime.batch import TS_COLUMN
from stretch.runtime.channel_log import ChannelLog, LogTail
from stretch.runtime.channel_writers import ChannelLogWriter, watermark_of


def _batch(values, ts):
    return pa.RecordBatch.from_arrays(
        [pa.array(values, pa.int64()), pa.array(ts, pa.int64()), pa.array([7] * len(values), pa.int32())],
        names=["f0", TS_COLUMN, "__kg"],
    )


def _written(tmp_path, timed: bool) -> list:
    prefix = shm.engine_prefix()
    tail = LogTail.create(prefix, 0)
    log = ChannelLog(tmp_path / "log")
    try:
        writer = ChannelLogWriter(log, tail, transactional=False, timed=timed)
        writer.write(_batch([1, 2], [10, 11]), producer=1)
        writer.watermark(11)
        writer.write(_batch([3], [15]), producer=1)
        writer.watermark(20)
        reader = ChannelLog(tmp_path / "log", create=False)
        try:
            return [
                ("watermark", watermark_of(b)) if watermark_of(b) is not None else ("rows", b.to_pydict())
                for b in reader.read(0, reader.end_offset)
            ]
        finally:
            reader.close()
    finally:
        log.close()
        tail.close()
        shm.unlink_prefix(prefix)


def test_a_timed_log_keeps_timestamps_and_watermarks_in_order(tmp_path):
    assert _written(tmp_path, timed=True) == [
        ("rows", {"f0": [1, 2], TS_COLUMN: [10, 11]}),
        ("watermark", 11),
        ("rows", {"f0": [3], TS_COLUMN: [15]}),
        ("watermark", 20),
    ]


def test_another_output_channel_keeps_only_the_records(tmp_path):
    assert _written(tmp_path, timed=False) == [("rows", {"f0": [1, 2]}), ("rows", {"f0": [3]})]
