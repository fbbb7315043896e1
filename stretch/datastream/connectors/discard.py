"""DiscardingSink: drops every record (for benchmarks and side-effect-only jobs)."""

from __future__ import annotations

from stretch.contracts.connectors import Sink, SinkWriter


class _Discard(SinkWriter):
    def write(self, batch, producer) -> None:
        pass

    def write_records(self, records, producer) -> None:
        pass  # never converts the records it drops


class DiscardingSink(Sink):
    runs_in = "instance"

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        return _Discard()
