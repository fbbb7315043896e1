"""PrintSink: what ``DataStream.print()`` writes, formatted as PyFlink prints it."""

from __future__ import annotations

import decimal
import math
import queue
import sys

import pyarrow as pa

from stretch.common.batch_decoding import from_batch
from stretch.common.records import RECORD_KIND_KEY
from stretch.common.row import Row, RowKind
from stretch.contracts.connectors import Sink, SinkWriter

_INFERRED = b"stretch.inferred"
_KIND_PREFIX = {
    RowKind.INSERT: "+I",
    RowKind.UPDATE_BEFORE: "-U",
    RowKind.UPDATE_AFTER: "+U",
    RowKind.DELETE: "-D",
}


def _java_str(value) -> str:
    """``toString()`` of the Java value a typed field is in PyFlink: ``null``, ``true``, Tuple's
    ``(a,1)``, List's ``[a, b]``, Map's ``{k=1}``, Row's ``+I[a, 1]``, Double's ``1.0E20``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Row):
        kind = _KIND_PREFIX.get(value.get_row_kind(), "+I")
        return kind + "[" + ", ".join(_java_str(v) for v in value._values) + "]"
    if isinstance(value, tuple):
        return "(" + ",".join(_java_str(v) for v in value) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_java_str(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_java_str(k)}={_java_str(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return _java_double(value)
    return str(value)


def _java_double(x: float) -> str:
    """Java's ``Double.toString``: plain from 10^-3 to 10^7, else ``d.dddE±n``; both shortest."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    if x == 0 or 1e-3 <= abs(x) < 1e7:
        return repr(x)  # Python writes these plainly too, with the same shortest digits
    d = decimal.Decimal(repr(x))
    digits = "".join(map(str, d.as_tuple().digits)).rstrip("0") or "0"
    sign = "-" if x < 0 else ""
    return f"{sign}{digits[0]}.{digits[1:] or '0'}E{d.adjusted()}"


def _row_str(row: Row) -> str:
    """PyFlink's print() of a ROW stream: ``'{kind}[{','.join(str(field))}]'``, in Python (its
    ``_align_output_type``), so ``+I[1,a]`` and ``+I[2,None]``."""
    kind = _KIND_PREFIX.get(row.get_row_kind(), "+I")
    return kind + "[" + ",".join(str(v) for v in row._values) + "]"


def format_records(batch: pa.RecordBatch) -> list[str]:
    """Lines as PyFlink prints them: Python's str for untyped streams, Java's for typed ones."""
    meta = batch.schema.metadata or {}
    records = from_batch(batch)
    if meta.get(_INFERRED) == b"1" or meta.get(RECORD_KIND_KEY) == b"pickled":
        return [r if isinstance(r, str) else str(r) for r in records]
    if meta.get(RECORD_KIND_KEY) == b"row":
        return [_row_str(r) for r in records]
    return [_java_str(r) for r in records]


class _PrintWriter(SinkWriter):
    def __init__(self, identifier: str | None, parallel: bool, stream):
        self.identifier = identifier
        self.parallel = parallel
        self.stream = stream

    def write(self, batch: pa.RecordBatch, producer: int) -> None:
        if self.parallel:
            prefix = f"{self.identifier}:{producer}> " if self.identifier else f"{producer}> "
        else:
            prefix = f"{self.identifier}> " if self.identifier else ""
        out = self.stream or sys.stdout
        out.write("".join(f"{prefix}{line}\n" for line in format_records(batch)))
        out.flush()


class PrintSink(Sink):
    """Prints each record on a line of standard output (or ``stream``)."""

    def __init__(self, sink_identifier: str | None = None, stream=None):
        self.sink_identifier = sink_identifier
        self.stream = stream

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        return _PrintWriter(self.sink_identifier, upstream_parallelism > 1, self.stream)


class CollectSink(Sink):
    """Marks the sink that ``execute_and_collect()`` reads itself.

    In a checkpointed job the job serves it instead (a transactional sink like any other): its
    writer hands committed batches to the caller's iterator through a queue.
    """

    runs_in = "reader"

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        return QueueWriter()


class QueueWriter(SinkWriter):
    """Committed batches for a reader in the job's process; None marks the end of the stream."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()

    def write(self, batch, producer: int) -> None:
        self.queue.put(batch)

    def close(self) -> None:
        self.queue.put(None)

    def abort(self) -> None:
        self.queue.put(None)
