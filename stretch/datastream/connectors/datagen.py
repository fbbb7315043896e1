"""DataGeneratorSource: records from a generator function, optionally rate-limited (as Flink's)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pyarrow as pa

from stretch.common.typeinfo import TypeInformation
from stretch.contracts.connectors import RecordPositionedSource


class RateLimiterStrategy:
    """How fast a generator source emits: ``per_second(n)`` records, or unlimited."""

    def __init__(self, records_per_second: float | None):
        if records_per_second is not None and records_per_second <= 0:
            raise ValueError("records_per_second must be positive")
        self.records_per_second = records_per_second

    @staticmethod
    def per_second(records_per_second: float) -> RateLimiterStrategy:
        return RateLimiterStrategy(records_per_second)

    @staticmethod
    def no_op() -> RateLimiterStrategy:
        return RateLimiterStrategy(None)


class DataGeneratorSource(RecordPositionedSource):
    """Calls ``generator_function(index)`` for index 0..count-1 (count None: without end).

    With ``batch_function(start, n) -> pyarrow.RecordBatch`` instead, whole batches are generated
    without a Python object per record. The rate limit is kept per batch of ``batch_rows``.
    """

    def __init__(
        self,
        generator_function: Callable | None = None,
        count: int | None = None,
        rate_limiter_strategy: RateLimiterStrategy | None = None,
        type_info: TypeInformation | None = None,
        batch_function: Callable[[int, int], pa.RecordBatch] | None = None,
        batch_rows: int = 4096,
    ):
        if (generator_function is None) == (batch_function is None):
            raise ValueError("give exactly one of generator_function or batch_function")
        self.generator_function = generator_function
        self.batch_function = batch_function
        self.count = count
        self.rate = (rate_limiter_strategy or RateLimiterStrategy.no_op()).records_per_second
        self.type_info = type_info
        self.batch_rows = batch_rows
        self.bounded = count is not None

    def create_reader(self, context=None):
        index = first = self.resume_at(context)  # a restart goes on from there, at the same rate
        start = time.monotonic()
        rows = self.batch_rows
        if self.rate is not None:
            rows = max(1, min(rows, int(self.rate // 100) or 1))  # at least ~100 batches a second
        while self.count is None or index < self.count:
            n = rows if self.count is None else min(rows, self.count - index)
            if self.batch_function is not None:
                yield self.batch_function(index, n)
            else:
                gen = self.generator_function
                yield [gen(i) for i in range(index, index + n)]
            index += n
            if self.rate is not None:
                ahead = (index - first) / self.rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
