"""Types, rows, time and watermark strategies (PyFlink: ``pyflink.common``)."""

from stretch.common.configuration import Configuration
from stretch.common.execution_config import ExecutionConfig
from stretch.common.job_status import JobStatus
from stretch.common.restart_strategy import RestartStrategies
from stretch.common.row import Row, RowKind
from stretch.common.serialization import Encoder
from stretch.common.time import Duration, Instant, Time
from stretch.common.typeinfo import TypeInformation, Types
from stretch.common.watermark_strategy import TimestampAssigner, WatermarkStrategy

__all__ = [
    "Configuration",
    "Duration",
    "Encoder",
    "ExecutionConfig",
    "Instant",
    "JobStatus",
    "RestartStrategies",
    "Row",
    "RowKind",
    "Time",
    "TimestampAssigner",
    "TypeInformation",
    "Types",
    "WatermarkStrategy",
]
