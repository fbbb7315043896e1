"""What appends to channels: outside writers into an input channel's gate, and the job into an
output channel's log."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import pyarrow as pa

from stretch._shm import pid_alive
from stretch.common.records import schema_for, to_batch, type_info_of
from stretch.common.typeinfo import TypeInformation
from stretch.contracts.connectors import SinkWriter
from stretch.runtime.batch import TS_COLUMN, resolve_field
from stretch.runtime.event_time import mark_batch
from stretch.runtime.gate import Gate, GateClosed, Kind
from stretch.runtime.key_group_runs import block_rows
from stretch.runtime.routing import keyed_by_field
from stretch.runtime.transactions import end_marker, tagged
from stretch.state.key_groups import warm_up as warm_key_groups


class ChannelAppender:
    """Appends batches to an input channel's gate, given the job's reply to a writer's join.

    An untyped channel takes the shape of the first batch any writer appends (``establish`` asks
    the job for it, registering this writer's shape if it is the first): records are converted to
    it, and a batch of another schema is refused here, before the job sees it.
    """

    def __init__(self, name: str, reply: dict, establish: Callable[[pa.Schema], pa.Schema] | None = None):
        self.name = name
        self._gate = Gate.attach(reply["segment"])
        self._pid = reply.get("pid")  # the job's process: a writer of a killed job must not write on
        self.type_info = TypeInformation.from_json(reply["type"]) if reply["type"] else None
        self.schema = schema_for(self.type_info) if self.type_info is not None else None
        self._establish = establish
        # When the job keys the channel by a field right away, this writer is the keyed operator's
        # producer: it computes the key groups and appends to the operator's gate directly.
        self._key_field = reply.get("key_field")
        self._max_parallelism = reply.get("max_parallelism")
        self._producer = reply.get("producer", 0)
        self._runs = reply.get("runs", False)  # the operator reads batches in runs of key groups
        if self._key_field is not None:
            warm_key_groups()  # compile (or load) the key-group kernels now, not on the first write

    def write(self, data, txn: int = 0, round: str | None = None) -> None:
        """Append records (a list), or a pyarrow RecordBatch/Table whose schema fits the channel;
        ``txn``: as part of that input transaction; ``round``: the writer's micro-batch (see
        runtime.transactions)."""
        self.check_open()
        if isinstance(data, pa.Table):
            for batch in data.to_batches():
                self.write(batch, txn, round)
            return
        if isinstance(data, pa.RecordBatch):
            batch = _widened(data, self.schema)
            self.check_fits(batch)
        else:
            records = list(data)
            batch = to_batch(records, self.type_info)
            if self.type_info is None and batch.num_rows:
                shape = self._shape(batch.schema)
                if not batch.schema.equals(shape, check_metadata=True):
                    batch = to_batch(records, type_info_of(shape))  # as the channel's first records
        if batch.num_rows:
            self._append(batch, txn, round)

    def check_fits(self, batch: pa.RecordBatch) -> None:
        """Raise unless the batch's schema is the channel's (with the records' event timestamps
        beside, ``__ts``, when they come with them: a cluster's forward)."""
        schema = batch.schema
        if TS_COLUMN in schema.names:
            schema = schema.remove(schema.get_field_index(TS_COLUMN))
        expected = self.schema if self.schema is not None else self._shape(schema)
        if not schema.remove_metadata().equals(expected.remove_metadata()):
            raise ValueError(
                f"batch schema does not match channel {self.name!r}:\n  batch:   {batch.schema.remove_metadata()}"
                f"\n  channel: {expected.remove_metadata()}"
            )

    def end_txn(self, txn: int, name: tuple | None = None) -> None:
        """The end of input transaction ``txn`` (see runtime.transactions), after its batches."""
        self.check_open()
        try:
            if self._key_field is not None:  # the keyed operator's gate: a marker entry
                self._gate.append_control(Kind.MARK, 1, txn)
            else:  # the channel's gate, whose log must keep it: a marker batch
                self._gate.append_batch(
                    end_marker(self.schema or pa.schema([]), txn, name), producer=self._producer
                )
        except GateClosed as e:
            raise RuntimeError(f"channel {self.name!r} takes no more records: {e}") from None

    def append_mark(self, watermark: int | None) -> None:
        """The channel's watermark (None: idle) set from outside the job, in order with its rows:
        a zero-row mark batch that the channel's source task passes on (runtime.event_time)."""
        if self._key_field is not None:
            raise ValueError(
                f"channel {self.name!r} writes straight into a keyed gate: it has no source task"
            )
        self.check_open()
        try:
            self._gate.append_batch(
                mark_batch(self.schema or pa.schema([]), watermark), producer=self._producer
            )
        except GateClosed as e:
            raise RuntimeError(f"channel {self.name!r} takes no more records: {e}") from None

    def append_keyed(self, batch: pa.RecordBatch) -> None:
        """Append a batch the keyed operator's gate held before (its ``__kg`` and ``__key``
        columns included), as it is: rows a cluster node took before and hands on after releasing
        their key groups (``Coordinator.release``), which need not be keyed again."""
        if self._key_field is None:
            raise ValueError(f"channel {self.name!r} does not write straight into a keyed operator's gate")
        self.check_open()
        try:
            self._gate.append_batch(batch, producer=self._producer)
        except GateClosed as e:
            raise RuntimeError(f"channel {self.name!r} takes no more records: {e}") from None

    def _append(self, batch: pa.RecordBatch, txn: int, round: str | None) -> None:
        if self._key_field is not None:  # straight into a keyed gate: no watermarks made here
            _refuse_null_keys(batch, self._key_field, self.name)
            runs = self._runs and self._gate.instance_readers() > 1
            block = block_rows(self._gate.read_ns_per_row, self._max_parallelism) if runs else 0
            batch = keyed_by_field(batch, self._key_field, self._max_parallelism, runs=runs, block=block)
        elif txn or round is not None:
            batch = tagged(batch, txn, round)
        try:
            self._gate.append_batch(batch, producer=self._producer, txn=txn)
        except GateClosed as e:
            raise RuntimeError(f"channel {self.name!r} takes no more records: {e}") from None

    def check_open(self) -> None:
        """Raise if the job reading the channel has ended (saying how) or its process is gone."""
        if self._gate.closed:
            reason = self._gate.closed_reason or "the job has ended"
            raise RuntimeError(f"channel {self.name!r} takes no more records: {reason}")
        if self._pid is not None and not pid_alive(self._pid):
            raise RuntimeError(
                f"channel {self.name!r} takes no more records: the process of its job ({self._pid}) is gone"
            )

    def _shape(self, schema: pa.Schema) -> pa.Schema:
        """The untyped channel's shape: the first batch's, as the job recorded it."""
        if self.schema is None:
            self.schema = self._establish(schema) if self._establish is not None else schema
        return self.schema


def _refuse_null_keys(batch: pa.RecordBatch, field, channel: str) -> None:
    """As in Flink, a key must not be null: the write is refused, naming the first such record."""
    column = batch.column(resolve_field(batch.schema, field))
    if column.null_count:
        i = next(i for i, valid in enumerate(column.is_valid().to_pylist()) if not valid)
        record = batch.slice(i, 1).to_pylist()[0]
        raise ValueError(
            f"record {i} written to channel {channel!r} has a null key (field {field!r}): {record!r}; "
            "keys must not be null (as in Flink)"
        )


class ChannelLogWriter(SinkWriter):
    """The job's side of an output channel: appends each result batch to the channel's log and
    wakes the readers waiting on its live tail."""

    def __init__(self, log, tail, transactional: bool = False, timed: bool = False):
        """``transactional``: readers see appended batches only once a checkpoint commits them.
        ``timed``: the records keep their timestamps (``__ts``) and the producers' watermarks go
        in between them (``watermark_batch``): a checkpointed cluster job's forward log."""
        self.log, self.tail, self.transactional, self.timed = log, tail, transactional, timed
        log.set_committed(log.end_offset if transactional else None)
        self.appended_at: deque[float] = deque(maxlen=100_000)  # recent appends (latency plots)

    def write(self, batch, producer: int, ipc=None) -> int | None:
        """Append the batch to the log; its offset (None for an empty batch). ``ipc``: the batch's
        Arrow IPC stream as its gate holds it, appended as it is unless engine columns must go."""
        data = [
            i
            for i, n in enumerate(batch.schema.names)
            if not n.startswith("__") or (self.timed and n == TS_COLUMN)
        ]
        if not batch.num_rows:
            return None
        if len(data) < batch.num_columns:
            offset = self.log.append(batch.select(data))
        else:
            offset = self.log.append(batch) if ipc is None else self.log.append_ipc(ipc)
        if not self.transactional:
            self.tail.publish(offset + 1)
        self.appended_at.append(time.monotonic())
        return offset

    def watermark(self, value: int) -> None:
        """The producers' watermark passed ``value``: a mark in the log, after the records before."""
        if self.timed:
            self.log.append(watermark_batch(value))
            if not self.transactional:
                self.tail.publish(self.log.end_offset)

    def commit(self, offset: int) -> None:
        """Readers may now read up to ``offset`` (a checkpoint covering it completed)."""
        self.log.set_committed(offset)
        self.tail.publish(offset)

    def rollback(self, offset: int) -> None:
        """Drop what was appended from ``offset`` on: a failed attempt's uncommitted output."""
        self.log.truncate(offset)

    def close(self) -> None:
        self.log.set_committed(None)
        self.log.end()
        self.log.close()
        self.tail.publish(self.log.end_offset, self.tail.ENDED)

    def abort(self) -> None:
        self.log.close()
        self.tail.publish(self.log.end_offset, self.tail.FAILED)


WATERMARK_KEY = b"stretch.watermark"


def watermark_batch(value: int) -> pa.RecordBatch:
    """A watermark as a log entry: a batch of no rows, its value in the schema's metadata."""
    schema = pa.schema([], metadata={WATERMARK_KEY: str(int(value)).encode()})
    return pa.RecordBatch.from_pylist([], schema=schema)


def watermark_of(batch: pa.RecordBatch) -> int | None:
    """The watermark a log entry is (``watermark_batch``), or None for records."""
    value = (batch.schema.metadata or {}).get(WATERMARK_KEY)
    return None if value is None else int(value)


_WIDER = {(pa.string(), pa.large_string()), (pa.binary(), pa.large_binary())}


def _widened(batch: pa.RecordBatch, schema: pa.Schema | None) -> pa.RecordBatch:
    """The batch with its string and binary columns cast to the channel's large ones, when that is
    all that differs: ``pa.table({"user": ["a"]})`` builds 32-bit offsets, a STRING field is
    stored with 64-bit ones."""
    if schema is None or batch.schema.names != schema.names:
        return batch
    types = []
    for mine, theirs in zip(batch.schema.types, schema.types, strict=True):
        if mine != theirs and (mine, theirs) not in _WIDER:
            return batch
        types.append(theirs)
    if types == batch.schema.types:
        return batch
    fields = [f.with_type(t) for f, t in zip(batch.schema, types, strict=True)]
    columns = [c.cast(t) for c, t in zip(batch.columns, types, strict=True)]
    return pa.RecordBatch.from_arrays(columns, schema=pa.schema(fields, metadata=batch.schema.metadata))
