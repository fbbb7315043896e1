"""The DataStream API, with PyFlink's names (``pyflink.datastream``).

The function, state and window interfaces are defined in ``stretch.contracts``, below the engine,
and re-exported here with the API that builds jobs from them.
"""

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
    AllWindowFunction,
    BroadcastProcessFunction,
    CoFlatMapFunction,
    CoGroupFunction,
    CoMapFunction,
    CoProcessFunction,
    FilterFunction,
    FlatMapFunction,
    JoinFunction,
    KeyedBroadcastProcessFunction,
    KeyedCoProcessFunction,
    KeyedProcessFunction,
    KeySelector,
    MapFunction,
    ProcessAllWindowFunction,
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
from stretch.datastream.all_windowed_stream import AllWindowedStream
from stretch.datastream.broadcast_stream import BroadcastConnectedStream, BroadcastStream
from stretch.datastream.checkpoint_config import (
    CheckpointConfig,
    CheckpointingMode,
    ExternalizedCheckpointRetention,
)
from stretch.datastream.connected_streams import ConnectedStreams
from stretch.datastream.data_stream import DataStream, DataStreamSink, KeyedStream, WindowedStream
from stretch.datastream.job_client import CloseableIterator, JobClient, JobExecutionResult
from stretch.datastream.join import (
    BandJoinedStreams,
    CoGroupedStreams,
    IntervalJoin,
    IntervalJoined,
    JoinedStreams,
)
from stretch.datastream.stream_execution_environment import StreamExecutionEnvironment

__all__ = [
    "AggregateFunction",
    "AllWindowFunction",
    "AllWindowedStream",
    "BandJoinedStreams",
    "BroadcastConnectedStream",
    "BroadcastProcessFunction",
    "BroadcastStream",
    "CheckpointConfig",
    "CheckpointingMode",
    "CloseableIterator",
    "CoFlatMapFunction",
    "CoGroupFunction",
    "CoGroupedStreams",
    "CoMapFunction",
    "CoProcessFunction",
    "ConnectedStreams",
    "DataStream",
    "DataStreamSink",
    "EmbeddedRocksDBStateBackend",
    "ExternalizedCheckpointRetention",
    "FilterFunction",
    "FlatMapFunction",
    "HashMapStateBackend",
    "IntervalJoin",
    "IntervalJoined",
    "JobClient",
    "JobExecutionResult",
    "JobStatus",
    "JoinFunction",
    "JoinedStreams",
    "KeySelector",
    "KeyedBroadcastProcessFunction",
    "KeyedCoProcessFunction",
    "KeyedProcessFunction",
    "KeyedStream",
    "MapFunction",
    "OutputTag",
    "ProcessAllWindowFunction",
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
