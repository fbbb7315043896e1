"""Files as a source of text lines and as a row-encoded sink (``pyflink.datastream.connectors.
file_system``): FileSource with ``StreamFormat.text_line_format()``, FileSink with an Encoder,
an OutputFileConfig, a RollingPolicy and a bucket assigner, laid out as Flink lays them out.

The sink runs in the job's process, fed in order from its sink gate, so in a checkpointed job it is
exactly once like every job sink: records reach a part file only once the checkpoint covering them
completes, and after a recovery what the job replays replaces what was not committed.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

from stretch.common.batch_decoding import from_batch
from stretch.common.records import to_batch
from stretch.common.serialization import Encoder
from stretch.common.typeinfo import Types
from stretch.contracts.connectors import RecordPositionedSource, Sink, SinkWriter

_LINES_PER_BATCH = 4096


# ---- source --------------------------------------------------------------------------------
class StreamFormat:
    """How a file's bytes become records; stretch has Flink's text line format."""

    def __init__(self, charset: str):
        self.charset = charset

    @staticmethod
    def text_line_format(charset_name: str = "UTF-8") -> StreamFormat:
        """One STRING record per line, without its line break (``\\n``, ``\\r`` or ``\\r\\n``)."""
        "".encode(charset_name)  # an unknown charset fails here
        return StreamFormat(charset_name)


def _visible(path: Path) -> bool:
    """Flink's default file filter: files whose names start with '.' or '_' are skipped."""
    return not path.name.startswith((".", "_"))


def _files(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and _visible(f))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"FileSource: no such file or directory: {str(p)!r}")
    return out


class FileSource(RecordPositionedSource):
    """The lines of the given files, and of every file under the given directories (in name order),
    as a bounded stream of STRING. A restart goes on at the line where the checkpoint left it."""

    type_info = Types.STRING()

    def __init__(self, stream_format: StreamFormat, paths: list[Path]):
        self.stream_format = stream_format
        self.paths = paths

    @staticmethod
    def for_record_stream_format(stream_format: StreamFormat, *paths: str) -> FileSourceBuilder:
        if not paths:
            raise ValueError("FileSource needs at least one path")
        return FileSourceBuilder(stream_format, [Path(p) for p in paths])

    def files(self) -> list[Path]:
        """The files it reads, in the order it reads them (a cluster splits the source by file)."""
        return _files(self.paths)

    def of_file(self, path: Path) -> FileSource:
        """The same source over one of its files."""
        return FileSource(self.stream_format, [path])

    def create_reader(self, context=None):
        skip = self.resume_at(context)
        lines: list[str] = []
        for path in _files(self.paths):
            with open(path, encoding=self.stream_format.charset, newline=None) as f:
                for line in f:  # universal newlines: every break reads as "\n"
                    if skip:
                        skip -= 1
                        continue
                    lines.append(line[:-1] if line.endswith("\n") else line)
                    if len(lines) == _LINES_PER_BATCH:
                        yield to_batch(lines, Types.STRING())
                        lines = []
        if lines:
            yield to_batch(lines, Types.STRING())


class FileSourceBuilder:
    def __init__(self, stream_format: StreamFormat, paths: list[Path]):
        self._format, self._paths = stream_format, paths

    def process_static_file_set(self) -> FileSourceBuilder:
        """The files as they are now: a bounded stream (the default)."""
        return self

    def monitor_continuously(self, discovery_interval) -> FileSourceBuilder:
        raise NotImplementedError(
            "FileSource.monitor_continuously is not supported: stretch reads the static file set "
            "(a bounded stream); write new data to a channel (stretch.channels) instead"
        )

    def set_file_enumerator(self, *args) -> FileSourceBuilder:
        raise NotImplementedError("custom file enumerators are not supported")

    def build(self) -> FileSource:
        _files(self._paths)  # a missing path fails where the job is defined
        return FileSource(self._format, self._paths)


# ---- sink ----------------------------------------------------------------------------------
class OutputFileConfig:
    """Part file names: ``{prefix}-{uuid}-{subtask}-{counter}{suffix}`` (Flink's)."""

    def __init__(self, part_prefix: str = "part", part_suffix: str = ""):
        self.part_prefix, self.part_suffix = part_prefix, part_suffix

    def get_part_prefix(self) -> str:
        return self.part_prefix

    def get_part_suffix(self) -> str:
        return self.part_suffix

    @staticmethod
    def builder() -> OutputFileConfig.Builder:
        return OutputFileConfig.Builder()

    class Builder:
        def __init__(self):
            self._prefix, self._suffix = "part", ""

        def with_part_prefix(self, prefix: str) -> OutputFileConfig.Builder:
            self._prefix = prefix
            return self

        def with_part_suffix(self, suffix: str) -> OutputFileConfig.Builder:
            self._suffix = suffix
            return self

        def build(self) -> OutputFileConfig:
            return OutputFileConfig(self._prefix, self._suffix)


def _ms(value) -> int:
    return int(value.to_milliseconds()) if hasattr(value, "to_milliseconds") else int(value)


class RollingPolicy:
    """When a part file is finished and the next one started (Flink's DefaultRollingPolicy):
    at ``part_size`` bytes, ``rollover_interval`` ms after it was opened, or after
    ``inactivity_interval`` ms without records (checked when records arrive and at the end)."""

    def __init__(self, part_size: int, rollover_interval: int, inactivity_interval: int):
        self.part_size = part_size
        self.rollover_interval = rollover_interval
        self.inactivity_interval = inactivity_interval

    @staticmethod
    def default_rolling_policy(
        part_size: int = 1024 * 1024 * 128, rollover_interval=60 * 1000, inactivity_interval=60 * 1000
    ) -> RollingPolicy:
        return RollingPolicy(int(part_size), _ms(rollover_interval), _ms(inactivity_interval))

    def should_roll(self, size: int, opened_ms: int, last_write_ms: int, now_ms: int) -> bool:
        return (
            size >= self.part_size
            or now_ms - opened_ms >= self.rollover_interval
            or now_ms - last_write_ms >= self.inactivity_interval
        )


class BucketAssigner:
    """The subdirectory of the base path a record goes to."""

    def __init__(self, format_str: str | None, tz: timezone | None):
        self.format_str, self.tz = format_str, tz

    @staticmethod
    def base_path_bucket_assigner() -> BucketAssigner:
        return BucketAssigner(None, None)

    @staticmethod
    def date_time_bucket_assigner(format_str: str = "yyyy-MM-dd--HH", timezone_id: str | None = None):
        """Flink's default: the processing time, formatted (Java's yyyy MM dd HH mm ss letters)."""
        tz = None if timezone_id is None else _zone(timezone_id)
        return BucketAssigner(format_str, tz)

    def bucket(self, now: float) -> str:
        if self.format_str is None:
            return ""
        t = datetime.fromtimestamp(now, self.tz) if self.tz else datetime.fromtimestamp(now)
        fmt = self.format_str
        for java, py in (
            ("yyyy", "%Y"),
            ("MM", "%m"),
            ("dd", "%d"),
            ("HH", "%H"),
            ("mm", "%M"),
            ("ss", "%S"),
        ):
            fmt = fmt.replace(java, py)
        return t.strftime(fmt)


def _zone(zone_id: str):
    from zoneinfo import ZoneInfo

    if zone_id.upper() in ("UTC", "Z"):
        return timezone(timedelta(0))
    return ZoneInfo(zone_id)


class _Part:
    def __init__(self, directory: Path, final_name: str):
        directory.mkdir(parents=True, exist_ok=True)
        self.final = directory / final_name
        self.in_progress = directory / f".{final_name}.inprogress.{uuid.uuid4()}"
        self.file = open(self.in_progress, "wb")  # noqa: SIM115 - kept open across writes
        self.size = 0
        self.opened = self.last_write = time.time() * 1000

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.size += len(data)
        self.last_write = time.time() * 1000

    def finish(self) -> None:
        self.file.close()
        os.replace(self.in_progress, self.final)


class _FileWriter(SinkWriter):
    def __init__(self, sink: FileSink):
        self.sink = sink
        self.uid = str(uuid.uuid4())
        self.counter = 0
        self.parts: dict[str, _Part] = {}

    def write(self, batch, producer: int) -> None:
        now = time.time()
        now_ms = now * 1000
        for name, part in list(self.parts.items()):
            if self.sink.rolling_policy.should_roll(part.size, part.opened, part.last_write, now_ms):
                part.finish()
                del self.parts[name]
        encode = self.sink.encoder.encode
        bucket = self.sink.bucket_assigner.bucket(now)
        part_size = self.sink.rolling_policy.part_size
        part = self.parts.get(bucket)
        for record in from_batch(batch):
            if part is not None and part.size > part_size:  # Flink's check, before each record
                part.finish()
                part = None
            if part is None:
                part = self.parts[bucket] = self._new_part(bucket)
            part.write(encode(record))
        if part is not None:
            part.file.flush()

    def _new_part(self, bucket: str) -> _Part:
        cfg = self.sink.output_file_config
        name = f"{cfg.part_prefix}-{self.uid}-0-{self.counter}{cfg.part_suffix}"
        self.counter += 1
        return _Part(self.sink.base_path / bucket, name)

    def close(self) -> None:
        """End of input: every part file is finished, as Flink does at the end of a bounded job."""
        for part in self.parts.values():
            part.finish()
        self.parts = {}

    def abort(self) -> None:
        """A failed or cancelled job leaves its in-progress files hidden and unfinished (as Flink)."""
        for part in self.parts.values():
            part.file.close()
        self.parts = {}


class FileSink(Sink):
    """Row-encoded files under ``base_path``: one line per record (``encoder``), in buckets
    (default: ``yyyy-MM-dd--HH`` of the processing time), rolled by ``rolling_policy``."""

    runs_in = "job"

    def __init__(
        self, base_path: Path, encoder: Encoder, output_file_config, rolling_policy, bucket_assigner
    ):
        self.base_path = base_path
        self.encoder = encoder
        self.output_file_config = output_file_config
        self.rolling_policy = rolling_policy
        self.bucket_assigner = bucket_assigner

    @staticmethod
    def for_row_format(base_path: str, encoder: Encoder) -> FileSink.RowFormatBuilder:
        if not isinstance(encoder, Encoder):
            raise TypeError(
                f"for_row_format needs an Encoder (Encoder.simple_string_encoder()), got {encoder!r}"
            )
        return FileSink.RowFormatBuilder(Path(base_path), encoder)

    @staticmethod
    def for_bulk_format(base_path: str, writer_factory):
        raise NotImplementedError("bulk formats are not supported; use ParquetSink, or for_row_format")

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        return _FileWriter(self)

    class RowFormatBuilder:
        def __init__(self, base_path: Path, encoder: Encoder):
            self._base_path, self._encoder = base_path, encoder
            self._config = OutputFileConfig()
            self._policy = RollingPolicy.default_rolling_policy()
            self._buckets = BucketAssigner.date_time_bucket_assigner()

        def with_output_file_config(self, output_file_config: OutputFileConfig) -> FileSink.RowFormatBuilder:
            self._config = output_file_config
            return self

        def with_rolling_policy(self, rolling_policy: RollingPolicy) -> FileSink.RowFormatBuilder:
            self._policy = rolling_policy
            return self

        def with_bucket_assigner(self, bucket_assigner: BucketAssigner) -> FileSink.RowFormatBuilder:
            self._buckets = bucket_assigner
            return self

        def with_bucket_check_interval(self, interval) -> FileSink.RowFormatBuilder:
            return self

        def build(self) -> FileSink:
            return FileSink(self._base_path, self._encoder, self._config, self._policy, self._buckets)


__all__ = [
    "BucketAssigner",
    "FileSink",
    "FileSource",
    "OutputFileConfig",
    "RollingPolicy",
    "StreamFormat",
]
