"""Arrow and Parquet sources and sinks: batches go in and out without a Python object per record."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stretch.common.records import RECORD_KIND_KEY
from stretch.contracts.connectors import RecordPositionedSource, Sink, SinkWriter, Source


def _as_rows(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Arrow data becomes Row records (fields by name) unless it already says what it is."""
    meta = batch.schema.metadata or {}
    if RECORD_KIND_KEY in meta:
        return batch
    return batch.replace_schema_metadata({**meta, RECORD_KIND_KEY: b"row"})


class ArrowSource(RecordPositionedSource):
    """A pyarrow Table or RecordBatches, fed to the job batch by batch (``max_chunksize`` rows)."""

    def __init__(self, data: pa.Table | pa.RecordBatch | list, max_chunksize: int = 65536):
        if isinstance(data, pa.RecordBatch):
            data = pa.Table.from_batches([data])
        elif isinstance(data, list):
            data = pa.Table.from_batches(data)
        self.table = data
        self.max_chunksize = max_chunksize

    def create_reader(self, context=None):
        for batch in self.table.slice(self.resume_at(context)).to_batches(max_chunksize=self.max_chunksize):
            yield _as_rows(batch)


class ParquetSource(Source):
    """Parquet files (a file, a directory or a list of files), read batch by batch."""

    def __init__(
        self, path: str | os.PathLike | list, columns: list[str] | None = None, batch_size: int = 65536
    ):
        self.paths = [str(p) for p in path] if isinstance(path, list) else [str(path)]
        self.columns = columns
        self.batch_size = batch_size

    def _files(self) -> list[str]:
        out = []
        for p in self.paths:
            if Path(p).is_dir():
                out.extend(sorted(str(f) for f in Path(p).rglob("*.parquet")))
            else:
                out.append(p)
        return out

    def create_reader(self, context=None):
        for f in self._files():
            pf = pq.ParquetFile(f)
            for batch in pf.iter_batches(batch_size=self.batch_size, columns=self.columns):
                yield _as_rows(batch)


class _ParquetWriter(SinkWriter):
    def __init__(self, path: Path):
        self.path = path
        self.tmp = path.with_name(path.name + ".inprogress")
        self.writer: pq.ParquetWriter | None = None

    def write(self, batch: pa.RecordBatch, producer: int) -> None:
        if self.writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.writer = pq.ParquetWriter(self.tmp, batch.schema)
        elif batch.schema != self.writer.schema:
            batch = batch.cast(self.writer.schema)
        self.writer.write_batch(batch)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.tmp.replace(self.path)

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.tmp.unlink(missing_ok=True)


class ParquetSink(Sink):
    """Writes the results to one Parquet file, made visible (renamed) only when the job finishes."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        return _ParquetWriter(self.path)
