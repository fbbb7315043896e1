"""Where a restarted source starts: record-positioned sources start at the record a checkpoint
left them at, without generating what they skip and whatever their batch sizes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from stretch.common import Types
from stretch.common.batch_decoding import from_batch
from stretch.datastream.connectors import (
    ArrowSource,
    DataGeneratorSource,
    NumberSequenceSource,
    RateLimiterStrategy,
)
from stretch.datastream.connectors.base import Source
from stretch.datastream.stream_execution_environment import _CollectionSource

N = 1000


def _records(item) -> list:
    return list(from_batch(item)) if isinstance(item, pa.RecordBatch) else list(item)


def _read(source, position: int) -> tuple[list, int]:
    """Everything a reader started at ``position`` yields, and the position it ends at."""
    out = []
    for item in source.create_reader(SimpleNamespace(position=position)):
        out.extend(_records(item))
        position = source.advance(position, item)
    return out, position


SOURCES = {
    "generator": lambda: DataGeneratorSource(lambda i: (i, -i), count=N, batch_rows=64),
    "batches": lambda: DataGeneratorSource(
        batch_function=lambda s, n: pa.record_batch({"x": np.arange(s, s + n)}), count=N, batch_rows=100
    ),
    "rate limited": lambda: DataGeneratorSource(
        lambda i: i, count=N, rate_limiter_strategy=RateLimiterStrategy.per_second(20_000)
    ),
    "number sequence": lambda: NumberSequenceSource(5, 5 + N - 1, batch_rows=128),
    "arrow": lambda: ArrowSource(pa.table({"x": np.arange(N)}), max_chunksize=70),
    "collection": lambda: _CollectionSource(pa.record_batch({"x": np.arange(N)}), chunk_rows=90),
}


@pytest.mark.parametrize("kind", list(SOURCES))
@pytest.mark.parametrize("position", [0, 1, 333, N - 1, N])
def test_a_record_positioned_source_resumes_at_its_record(kind, position):
    everything, end = _read(SOURCES[kind](), 0)
    assert len(everything) == end == N
    rest, end = _read(SOURCES[kind](), position)
    assert rest == everything[position:] and end == N


def test_a_resumed_generator_generates_nothing_it_skips():
    called = []
    source = DataGeneratorSource(
        lambda i: called.append(i) or i,
        count=N,
        rate_limiter_strategy=RateLimiterStrategy.per_second(1000),  # a whole second to replay
        type_info=Types.LONG(),
    )
    rest, _ = _read(source, N - 10)
    assert rest == called == list(range(N - 10, N))


def test_a_source_of_its_own_counts_items_and_is_read_again():
    class Letters(Source):
        def create_reader(self, context=None):
            yield from (["a", "b"], ["c"], ["d", "e", "f"])

    source = Letters()
    assert not source.seekable
    position = 0
    for item in source.create_reader():
        position = source.advance(position, item)
    assert position == 3  # items: a restart reads them again and skips this many
