"""Types, rows, time and watermark strategies (PyFlink: ``pyflink.common``)."""

from stretch.common.job_status import JobStatus
from stretch.common.row import Row, RowKind
from stretch.common.time import Duration, Instant, Time
from stretch.common.typeinfo import TypeInformation, Types
from stretch.common.watermark_strategy import TimestampAssigner, WatermarkStrategy

__all__ = [
    "Duration",
    "Instant",
    "JobStatus",
    "Row",
    "RowKind",
    "Time",
    "TimestampAssigner",
    "TypeInformation",
    "Types",
    "WatermarkStrategy",
]
