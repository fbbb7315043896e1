"""A stand-in for PyFlink's ``DataStreamTestSinkFunction`` (``pyflink.datastream.tests.test_util``),
so Flink's own test cases run on stretch with their expected outputs unchanged.

Flink's sink collects records on the Java side: ``get_results()`` returns each record as Java's
``toString`` of it (a Row as ``+I[a, 1]``, a Tuple as ``(a,1)``, null as ``null``), and
``get_results(True)`` returns Python's ``str`` of the record as PyFlink pickled it. This sink
collects the batches that reach it in the job's process and renders them the same two ways.
"""

from __future__ import annotations

import datetime
import decimal

import numpy as np
import pyarrow as pa

from stretch.common.batch_decoding import from_batch
from stretch.common.records import RECORD_KIND_KEY
from stretch.common.row import Row
from stretch.contracts.connectors import Sink, SinkWriter


def _children(arrow_type, n: int) -> list:
    if arrow_type is not None and pa.types.is_struct(arrow_type):
        return [arrow_type.field(i).type for i in range(arrow_type.num_fields)]
    return [None] * n


def java_str(value, arrow_type=None) -> str:
    """What Java's ``toString`` gives for the value Flink converts a typed record's field to
    (``arrow_type``, how stretch carried it, tells a FLOAT, which Java prints as a float)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and arrow_type is not None and pa.types.is_float32(arrow_type):
        return str(np.float32(value))
    if isinstance(value, Row):
        fields = zip(value._values, _children(arrow_type, len(value)), strict=True)
        return value.get_row_kind().short_string() + "[" + ", ".join(java_str(v, t) for v, t in fields) + "]"
    if isinstance(value, tuple):
        return (
            "("
            + ",".join(java_str(v, t) for v, t in zip(value, _children(arrow_type, len(value)), strict=True))
            + ")"
        )
    if isinstance(value, list):
        item = (
            arrow_type.value_type
            if arrow_type is not None and (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type))
            else None
        )
        return "[" + ", ".join(java_str(v, item) for v in value) + "]"
    if isinstance(value, datetime.datetime):  # java.sql.Timestamp: millis without trailing zeros
        text = value.strftime("%Y-%m-%d %H:%M:%S")
        return text + "." + (f"{value.microsecond // 1000:03d}".rstrip("0") or "0")
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return format(value.normalize() if value == value.to_integral() else value, "f")
    return str(value)


class _Collect(SinkWriter):
    def __init__(self, into: list):
        self.into = into

    def write(self, batch, producer: int) -> None:
        meta = batch.schema.metadata or {}
        kind = meta.get(RECORD_KIND_KEY)
        untyped = kind == b"pickled" or meta.get(b"stretch.inferred") == b"1"  # PyFlink: pickled objects
        if kind in (b"row", b"tuple"):
            arrow_type = pa.struct(list(batch.schema))
        else:
            arrow_type = batch.schema.field(0).type if batch.num_columns == 1 else None
        self.into.extend((untyped, arrow_type, record) for record in from_batch(batch))


class DataStreamTestSinkFunction(Sink):
    """Collects what reaches it (the writer runs in the job's own process, this one)."""

    runs_in = "job"

    def __init__(self):
        self._records: list = []

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        return _Collect(self._records)

    def get_results(self, is_python_object: bool = False, stringify: bool = True) -> list:
        records, self._records[:] = list(self._records), []
        if is_python_object:
            return [str(r) if stringify else r for _, _, r in records]
        return [str(r) if untyped else java_str(r, t) for untyped, t, r in records]

    def clear(self) -> None:
        self._records.clear()
