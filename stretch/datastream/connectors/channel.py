"""Named channels: a running job's input or output that other Python code writes or reads.

``ChannelSource(name)`` makes a job read whatever writers append to the channel until one of them
ends it; writers reach the job through its control socket (see ``stretch.channels``) and then move
data through shared memory directly. ``ChannelSink(name)`` appends the job's results to a durable
log under the job's state directory (``stretch.runtime.channel_log``) that readers read by offset,
during the run and after it.
"""

from __future__ import annotations

import time
from collections import deque

from stretch.common.typeinfo import TypeInformation
from stretch.datastream.connectors.base import Sink, SinkWriter, Source


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"a channel name must be a non-empty string without '/', got {name!r}")
    return name


class ChannelSource(Source):
    """The job's input is the channel ``name``; records must match ``type_info`` when given.

    ``durable``: the job logs what writers append under its state directory, in the order it
    reads it (``stretch.runtime.input_logger``); ``False`` saves that copy of every batch.
    """

    seekable = True  # in a checkpointed job its position is an offset of the channel's log

    def __init__(self, name: str, type_info: TypeInformation | None = None, durable: bool = True):
        self.channel_name = _check_name(name)
        self.type_info = type_info
        self.durable = durable

    def create_reader(self, context=None):
        if context.res.checkpoints is not None:
            return self._read_log(context)
        return self._read_gate(context)

    def _read_log(self, context):
        """A checkpointed job reads the channel's log (which the job keeps from the channel's gate)
        from its position on, so a recovery can go back to a checkpoint's offset."""
        from stretch.runtime.channel_log import ChannelLog, LogTail

        directory, tail_name = context.res.channel_logs[self.channel_name]
        log, tail = ChannelLog(directory, create=False), LogTail.attach(tail_name)
        offset = context.position
        try:
            while True:
                end = tail.end
                if offset < end:
                    for batch in log.read(offset, end):
                        offset += 1
                        yield batch
                elif tail.state != LogTail.RUNNING:
                    return
                elif not tail.wait(offset, timeout=0.1):
                    if context.should_stop():
                        return
                    yield None  # nothing yet: lets watermark generators notice idleness
        finally:
            log.close()
            tail.close()

    def _read_gate(self, context):
        from stretch.runtime.gate import Kind

        gate = context.channel_gate(self.channel_name)
        seq = gate.cursor(0)
        while True:
            if not gate.wait(seq, timeout=0.1):
                if context.should_stop():
                    return
                yield None  # nothing yet: lets watermark generators notice idleness
                continue
            entry = gate.read(seq)
            if entry.kind is Kind.END_OF_STREAM:
                gate.advance(0, seq + 1)
                return
            if entry.kind is Kind.DATA:
                yield entry.batch  # zero-copy: processed before the cursor moves past it
            seq += 1
            gate.advance(0, seq)


class ChannelSink(Sink):
    """The job's output goes to the channel ``name``: a durable log that readers consume by offset
    (``stretch.channels.open_reader``, or Spark's ``format("stretch")``)."""

    def __init__(self, name: str):
        self.name = _check_name(name)

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        raise RuntimeError("the job writes its channel logs itself (ChannelLogWriter)")


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
