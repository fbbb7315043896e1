"""Driver-side sinks: a thread per sink reads its sink gate in order and writes the records out."""

from __future__ import annotations

import threading

from stretch.plan.stages import SinkSpec
from stretch.runtime.gate import Gate, GateClosed, Kind


class SinkRunner(threading.Thread):
    """Feeds one sink's writer from its gate until end of stream, then closes the writer."""

    def __init__(self, spec: SinkSpec, gate: Gate, coordinator, writer=None):
        """``writer``: the job's own writer for sinks it serves itself (output channels)."""
        super().__init__(name=f"stretch-sink-{spec.name}", daemon=True)
        self.spec = spec
        self.writer = writer
        self.gate = gate
        self.coordinator = coordinator

    def run(self) -> None:
        error = None
        writer = None
        try:
            writer = self.writer or self.spec.sink.create_writer(self.spec.upstream_parallelism)
            seq = 0
            while True:
                if not self.gate.wait(seq, timeout=0.2):
                    continue
                entry = self.gate.read(seq)
                if entry.kind is Kind.DATA:
                    writer.write(entry.batch, entry.arg0)
                seq += 1
                self.gate.advance(0, seq)
                if entry.kind is Kind.END_OF_STREAM:
                    break
            writer.close()
            writer = None
        except GateClosed:
            pass
        except BaseException as e:
            error = e
        finally:
            if writer is not None:
                try:
                    writer.abort()
                except Exception:
                    pass
            self.coordinator.sink_finished(self.spec.id, error)
