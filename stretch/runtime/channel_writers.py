"""What appends to channels: outside writers into an input channel's gate, and the job into an
output channel's log."""

from __future__ import annotations

import time
from collections import deque

import pyarrow as pa

from stretch.common.records import schema_for, to_batch
from stretch.common.typeinfo import TypeInformation
from stretch.contracts.connectors import SinkWriter
from stretch.runtime.gate import Gate, GateClosed
from stretch.runtime.routing import keyed_by_field
from stretch.state.key_groups import warm_up as warm_key_groups


class ChannelAppender:
    """Appends batches to an input channel's gate, given the job's reply to a writer's join."""

    def __init__(self, name: str, reply: dict):
        self.name = name
        self._gate = Gate.attach(reply["segment"])
        self.type_info = TypeInformation.from_json(reply["type"]) if reply["type"] else None
        self.schema = schema_for(self.type_info) if self.type_info is not None else None
        # When the job keys the channel by a field right away, this writer is the keyed operator's
        # producer: it computes the key groups and appends to the operator's gate directly.
        self._key_field = reply.get("key_field")
        self._max_parallelism = reply.get("max_parallelism")
        self._producer = reply.get("producer", 0)
        if self._key_field is not None:
            warm_key_groups()  # compile (or load) the key-group kernels now, not on the first write

    def write(self, data) -> None:
        """Append records (a list), or a pyarrow RecordBatch/Table whose schema fits the channel."""
        if isinstance(data, pa.Table):
            for batch in data.to_batches():
                self.write(batch)
            return
        if isinstance(data, pa.RecordBatch):
            batch = data
            if self.schema is not None and not batch.schema.remove_metadata().equals(
                self.schema.remove_metadata()
            ):
                raise ValueError(
                    f"batch schema does not match channel {self.name!r}:\n  batch:   {batch.schema.remove_metadata()}"
                    f"\n  channel: {self.schema.remove_metadata()}"
                )
        else:
            batch = to_batch(list(data), self.type_info)
        if batch.num_rows:
            if self._key_field is not None:
                batch = keyed_by_field(batch, self._key_field, self._max_parallelism)
            try:
                self._gate.append_batch(batch, producer=self._producer)
            except GateClosed:
                raise RuntimeError(f"the job reading channel {self.name!r} has stopped") from None


class ChannelLogWriter(SinkWriter):
    """The job's side of an output channel: appends each result batch to the channel's log and
    wakes the readers waiting on its live tail."""

    def __init__(self, log, tail, transactional: bool = False):
        """``transactional``: readers see appended batches only once a checkpoint commits them."""
        self.log, self.tail, self.transactional = log, tail, transactional
        log.set_committed(log.end_offset if transactional else None)
        self.appended_at: deque[float] = deque(maxlen=100_000)  # recent appends (latency plots)

    def write(self, batch, producer: int) -> None:
        data = [i for i, n in enumerate(batch.schema.names) if not n.startswith("__")]
        if batch.num_rows:
            offset = self.log.append(batch.select(data) if len(data) < batch.num_columns else batch)
            if not self.transactional:
                self.tail.publish(offset + 1)
            self.appended_at.append(time.monotonic())

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
