"""The bases of sources and sinks.

The definitions live in ``stretch.contracts.connectors``, below the engine that calls them."""

from stretch.contracts.connectors import (
    RecordPositionedSource,
    Sink,
    SinkWriter,
    Source,
)

__all__ = [
    "RecordPositionedSource",
    "Sink",
    "SinkWriter",
    "Source",
]
