"""DiscardingSink: drops every record (for benchmarks and side-effect-only jobs)."""

from __future__ import annotations

from stretch.datastream.connectors.base import Sink, SinkWriter


class _Discard(SinkWriter):
    def write(self, batch, producer) -> None:
        pass


class DiscardingSink(Sink):
    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        return _Discard()
