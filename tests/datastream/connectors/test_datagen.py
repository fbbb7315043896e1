import time

import numpy as np
import pyarrow as pa

from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DataGeneratorSource, RateLimiterStrategy


def test_generator_function_records_in_order():
    env = StreamExecutionEnvironment.get_execution_environment()
    src = DataGeneratorSource(
        lambda i: (i, str(i)), count=1000, type_info=Types.TUPLE([Types.LONG(), Types.STRING()])
    )
    with env.from_source(src, None, "gen").execute_and_collect() as it:
        assert list(it) == [(i, str(i)) for i in range(1000)]


def test_rate_limit_is_kept():
    env = StreamExecutionEnvironment.get_execution_environment()
    src = DataGeneratorSource(
        batch_function=lambda start, n: pa.record_batch({"x": np.arange(start, start + n)}),
        count=4000,
        rate_limiter_strategy=RateLimiterStrategy.per_second(4000),
    )
    t0 = time.monotonic()
    with env.from_source(src, None, "gen").execute_and_collect() as it:
        got = [r.x for r in it]
    elapsed = time.monotonic() - t0
    assert got == list(range(4000))
    assert elapsed >= 0.9  # 4000 records at 4000/s cannot finish in much less than a second
