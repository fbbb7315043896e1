"""The DataStream API, with PyFlink's names (``pyflink.datastream``).

The environment, streams and job handles are imported on first use: they pull in the engine, and
the engine's workers import the function interfaces from this package without needing them.
"""

from importlib import import_module

from stretch.common.job_status import JobStatus
from stretch.contracts.execution import (
    EmbeddedRocksDBStateBackend,
    HashMapStateBackend,
    RuntimeExecutionMode,
    SlotSharingGroup,
    TimeCharacteristic,
)
from stretch.contracts.functions import (
    AggregateFunction,
    CoGroupFunction,
    FilterFunction,
    FlatMapFunction,
    JoinFunction,
    KeyedProcessFunction,
    KeySelector,
    MapFunction,
    ProcessFunction,
    ProcessJoinFunction,
    ProcessWindowFunction,
    ReduceFunction,
    RuntimeContext,
    TimeDomain,
    TimerService,
    WindowFunction,
)
from stretch.contracts.output_tag import OutputTag
from stretch.datastream.checkpoint_config import (
    CheckpointConfig,
    CheckpointingMode,
    ExternalizedCheckpointRetention,
)

_LAZY = {
    "DataStream": "stretch.datastream.data_stream",
    "DataStreamSink": "stretch.datastream.data_stream",
    "KeyedStream": "stretch.datastream.data_stream",
    "WindowedStream": "stretch.datastream.data_stream",
    "JoinedStreams": "stretch.datastream.join",
    "CoGroupedStreams": "stretch.datastream.join",
    "IntervalJoin": "stretch.datastream.join",
    "IntervalJoined": "stretch.datastream.join",
    "BandJoinedStreams": "stretch.datastream.join",
    "CloseableIterator": "stretch.datastream.job_client",
    "JobClient": "stretch.datastream.job_client",
    "JobExecutionResult": "stretch.datastream.job_client",
    "StreamExecutionEnvironment": "stretch.datastream.stream_execution_environment",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stretch.datastream' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AggregateFunction",
    "CheckpointConfig",
    "CheckpointingMode",
    "CloseableIterator",
    "CoGroupFunction",
    "DataStream",
    "DataStreamSink",
    "EmbeddedRocksDBStateBackend",
    "ExternalizedCheckpointRetention",
    "FilterFunction",
    "FlatMapFunction",
    "HashMapStateBackend",
    "JobClient",
    "JobExecutionResult",
    "JobStatus",
    "JoinFunction",
    "KeySelector",
    "KeyedProcessFunction",
    "KeyedStream",
    "MapFunction",
    "OutputTag",
    "ProcessFunction",
    "ProcessJoinFunction",
    "ProcessWindowFunction",
    "ReduceFunction",
    "RuntimeContext",
    "RuntimeExecutionMode",
    "SlotSharingGroup",
    "StreamExecutionEnvironment",
    "TimeCharacteristic",
    "TimeDomain",
    "TimerService",
    "WindowFunction",
    "WindowedStream",
]
