"""Sources and sinks (PyFlink: ``pyflink.datastream.connectors``)."""

from stretch.contracts.connectors import Sink, Source
from stretch.datastream.connectors.arrow import ArrowSource, ParquetSink, ParquetSource
from stretch.datastream.connectors.datagen import DataGeneratorSource, RateLimiterStrategy
from stretch.datastream.connectors.discard import DiscardingSink
from stretch.datastream.connectors.file_system import (
    FileSink,
    FileSource,
    OutputFileConfig,
    RollingPolicy,
    StreamFormat,
)
from stretch.datastream.connectors.number_seq import NumberSequenceSource

__all__ = [
    "ArrowSource",
    "DataGeneratorSource",
    "DiscardingSink",
    "FileSink",
    "FileSource",
    "NumberSequenceSource",
    "OutputFileConfig",
    "ParquetSink",
    "ParquetSource",
    "RateLimiterStrategy",
    "RollingPolicy",
    "Sink",
    "Source",
    "StreamFormat",
]
