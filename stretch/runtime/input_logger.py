"""The durable log of an input channel, kept by the job from the channel's gate.

A logger thread of the job reads the gate that a channel's writers append to (with a reader slot
of its own, so the gate keeps nothing it has not logged: a slow disk slows the writers, never
loses data) and copies each data entry's Arrow IPC bytes, as they are, to the channel's log. The
log's order is the gate's order, the order the job processes the channel in; its offsets
continue across runs of the job.
"""

from __future__ import annotations

import threading

from stretch.runtime.channel_log import ChannelLog, LogTail
from stretch.runtime.gate import Gate, GateClosed, Kind


class InputLogger(threading.Thread):
    def __init__(
        self,
        name: str,
        gate: Gate,
        reader: int,
        log: ChannelLog,
        producer: int | None = None,
        tail: LogTail | None = None,
    ):
        """``producer``: log only this producer's entries (a gate that other stages also feed).
        ``tail``: where the log's end is published (a checkpointed job's source reads the log)."""
        super().__init__(name=f"stretch-log-{name}", daemon=True)
        self.gate, self.reader, self.log, self.producer, self.tail = gate, reader, log, producer, tail
        gate.open_reader(reader, 0)

    def run(self) -> None:
        gate, seq = self.gate, self.gate.cursor(self.reader)
        try:
            while True:
                if not gate.wait(seq, timeout=0.2):
                    continue
                entry = gate.read(seq)
                if entry.kind is Kind.DATA and self.producer in (None, entry.arg0):
                    offset = self.log.append_ipc(gate.payload(seq))
                    if self.tail is not None:
                        self.tail.publish(offset + 1)
                seq += 1
                gate.advance(self.reader, seq)
                if entry.kind is Kind.END_OF_STREAM:
                    self.log.end()
                    if self.tail is not None:
                        self.tail.publish(self.log.end_offset, LogTail.ENDED)
                    return
        except GateClosed:
            pass
        finally:
            self.log.close()
