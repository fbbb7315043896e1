"""Spark reads a job's output channel: streaming by offsets, or in batch what the log retained.

An offset is a batch index of the channel's log (``stretch.runtime.channel_log``), so a range of
offsets splits into partitions that executors read in parallel straight from the log's files.
A streaming query's ``commit(end)`` records its position in the log, which then lets go of what
every registered reader committed; a query restarted from its checkpoint continues from the
offsets Spark stored there.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition

from stretch.channels import OutputLog, locate_output, run_start
from stretch.spark.options import job_and_channel
from stretch.spark.schemas import spark_values

_ARROW = {
    "bigint": pa.int64(),
    "int": pa.int32(),
    "smallint": pa.int16(),
    "tinyint": pa.int8(),
    "double": pa.float64(),
    "float": pa.float32(),
    "boolean": pa.bool_(),
    "string": pa.string(),
    "binary": pa.binary(),
    "date": pa.date32(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "timestamp_ntz": pa.timestamp("us"),
}


@dataclass
class LogRange(InputPartition):
    """Batches ``start`` .. ``end`` of the log in ``directory``."""

    directory: str
    start: int
    end: int


def arrow_schema_of(spark_schema) -> pa.Schema:
    return pa.schema(
        [(f.name, _ARROW.get(f.dataType.simpleString(), pa.string())) for f in spark_schema.fields]
    )


def read_range(partition: LogRange, schema: pa.Schema):
    """The partition's batches, as Spark's schema has them (by position)."""
    if not isinstance(partition, LogRange):  # Spark's stand-in where partitions() planned none
        return
    with OutputLog(partition.directory) as log:
        for batch in log.read(partition.start, partition.end):
            columns = [spark_values(c).cast(f.type) for c, f in zip(batch.columns, schema)]
            yield pa.RecordBatch.from_arrays(columns, schema=schema)


def split(directory: str, start: int, end: int, parts: int) -> list[LogRange]:
    n = max(1, min(parts, end - start))
    bounds = [start + (end - start) * i // n for i in range(n + 1)]
    return [LogRange(directory, a, b) for a, b in pairwise(bounds) if b > a]


def log_offset(option: str, value: str | int, start: int, end: int, run: int, where: str) -> int:
    """Option ``option``'s offset in a log holding offsets ``start`` .. ``end`` (exclusive) whose
    current run's first result is ``run``: ``value`` is ``run``, ``earliest`` retained, ``latest``
    or an offset; refused below what the log holds (its older batches are gone). ``where``: the
    log, for the messages ("channel 'totals' of job 'clicks'")."""
    if value == "earliest":
        return start
    if value == "run":
        return run
    if value == "latest":
        return end
    try:
        offset = int(value)
    except ValueError:
        raise ValueError(f"{option} must be run, earliest, latest or an offset, got {value!r}") from None
    if offset < start:
        raise ValueError(
            f"{option} {offset} is before the oldest batch {where} still holds: {holds(start, end)}"
        )
    return offset


def log_range(first: int, stop: int, ending_given: bool, start: int, end: int, where: str) -> tuple[int, int]:
    """A batch read's range ``first`` .. ``stop`` of a log holding ``start`` .. ``end``: past the
    end it reads up to the end (nothing, if it starts there: not there yet); an ending the user
    gave (``ending_given``) before the starting is refused."""
    if stop < first and ending_given:  # from past the end up to the end ("latest"): nothing
        raise ValueError(
            f"endingOffsets {stop} is before startingOffsets {first} on {where}: {holds(start, end)}"
        )
    return min(first, end), min(stop, end)


def holds(start: int, end: int) -> str:
    """What a log holding offsets ``start`` .. ``end`` (exclusive) holds, for a message."""
    if end == start:
        return f"its log holds no batch (its next is offset {end})"
    return f"its log holds offsets {start} to {end - 1}"


class _ChannelOptions:
    def __init__(self, options, schema):
        self.job, self.channel = job_and_channel(options)
        self.where = locate_output(self.job, self.channel)
        self.directory = self.where["log"]
        self.parts = int(options.get("partitions", 2))
        self.arrow_schema = arrow_schema_of(schema)

    def log(self) -> OutputLog:
        return OutputLog(self.directory)

    def offset_of(self, option: str, name: str, log: OutputLog) -> int:
        """Option ``option``'s offset: ``run`` (the first result of the job's current run, or
        of its last run once none runs), ``earliest`` retained, ``latest`` or a number; refused
        below what the log holds (its older batches are gone)."""
        run = run_start(self.where, log.start)
        return log_offset(option, name, log.start, log.end, run, self.described())

    def described(self) -> str:
        return f"channel {self.channel!r} of job {self.job!r}"


class StretchStreamReader(_ChannelOptions, DataSourceStreamReader):
    """``spark.readStream.format("stretch")``; option ``startingOffsets``: ``run`` (default: the
    first result of the job's current run, or of its last run once none runs), ``earliest`` (all the log retained, earlier runs'
    results too) or an offset; option ``query``: a stable name under which the log keeps what
    this query has not committed (Spark does not tell a source its checkpoint location)."""

    def __init__(self, options, schema):
        super().__init__(options, schema)
        self.reader_id = options.get("query")
        self.starting = options.get("startingOffsets", "run")

    def initialOffset(self) -> dict:
        log = self.log()
        start = self.offset_of("startingOffsets", self.starting, log)
        if self.reader_id:
            log.register(self.reader_id, start)
        return {"offset": start}

    def latestOffset(self, start=None, limit=None) -> dict:
        return {"offset": self.log().end}

    def partitions(self, start: dict, end: dict) -> list[LogRange]:
        return split(self.directory, start["offset"], end["offset"], self.parts)

    def read(self, partition: LogRange):
        return read_range(partition, self.arrow_schema)

    def commit(self, end: dict) -> None:
        if self.reader_id:
            self.log().commit(self.reader_id, end["offset"])


class StretchBatchReader(_ChannelOptions, DataSourceReader):
    """``spark.read.format("stretch")``: what the channel's log holds now, options
    ``startingOffsets`` (``run``, default: the results of the job's current run, or of its last
    run once none runs; ``earliest``: every run's results retained; ``latest``; an offset) and
    ``endingOffsets`` (``latest``, default; an offset, exclusive). Offsets past the log's end
    read up to its end (nothing, if the range starts there); an ending before the start, or an
    offset below what the log still holds, is refused naming the offsets the log holds."""

    def __init__(self, options, schema):
        super().__init__(options, schema)
        ending = options.get("endingOffsets", "latest")
        with self.log() as log:
            start = self.offset_of("startingOffsets", options.get("startingOffsets", "run"), log)
            end = self.offset_of("endingOffsets", ending, log)
            self.start, self.end = log_range(
                start, end, ending != "latest", log.start, log.end, self.described()
            )

    def partitions(self) -> list[LogRange]:
        return split(self.directory, self.start, self.end, self.parts)

    def read(self, partition: LogRange):
        return read_range(partition, self.arrow_schema)
