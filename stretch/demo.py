"""The demo job (``stretch demo``): a keyed running count and sum over generated click events.

It shows the engine end to end on embedded defaults: a rate-limited generator feeds a gate, a
KeyedProcessFunction keeps per-user state in shared memory at the chosen parallelism, and the
demo prints the throughput every second from the job's own counters.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, RuntimeContext, StreamExecutionEnvironment
from stretch.datastream.connectors import DataGeneratorSource, DiscardingSink, RateLimiterStrategy
from stretch.datastream.state import ValueStateDescriptor

USERS = 10_000


def click_batch(start: int, n: int) -> pa.RecordBatch:
    """Deterministic click events: (user, amount) for event indexes start..start+n-1."""
    idx = np.arange(start, start + n, dtype=np.int64)
    user = (idx * 2654435761) % USERS
    amount = ((idx * 40503) % 1000) / 100.0
    return pa.record_batch({"user": user, "amount": amount})


class RunningTotal(KeyedProcessFunction):
    """Per user: how many clicks and how much they spent so far."""

    def open(self, runtime_context: RuntimeContext):
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.total = runtime_context.get_state(ValueStateDescriptor("total", Types.DOUBLE()))

    def process_element(self, value, ctx):
        c = (self.count.value() or 0) + 1
        t = (self.total.value() or 0.0) + value["amount"]
        self.count.update(c)
        self.total.update(t)
        yield ctx.get_current_key(), c, t


def run(seconds: float = 10.0, parallelism: int = 2, rate: float = 200_000.0, out=print) -> dict:
    """Run the demo job; prints one line per second; returns the final counters."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    count = int(rate * seconds)
    source = DataGeneratorSource(
        batch_function=click_batch,
        count=count,
        rate_limiter_strategy=RateLimiterStrategy.per_second(rate),
        batch_rows=8192,
    )
    clicks = env.from_source(source, None, "clicks")
    totals = clicks.key_by("user").process(
        RunningTotal(), Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])
    )
    totals.name("running-total").sink_to(DiscardingSink())
    client = env.execute_async("stretch demo")
    out(
        f"stretch demo: {count:,} click events at {rate:,.0f}/s, keyed by {USERS:,} users, parallelism {parallelism}"
    )
    last_in, last_t, started = 0, time.monotonic(), time.monotonic()
    while not client.wait(1.0).is_globally_terminal_state():
        now = time.monotonic()
        op = client.describe()["operators"][0]
        records = sum(i["records_in"] for i in op["instances"])
        per_instance = " ".join(f"#{i['index']}:{i['records_in']:,}" for i in op["instances"])
        out(
            f"  {now - started:5.1f}s  {(records - last_in) / (now - last_t):>12,.0f} events/s"
            f"  total {records:>12,}  gate depth {op['gate_depth']:>3}  instances {per_instance}"
        )
        last_in, last_t = records, now
    elapsed = time.monotonic() - started
    out(
        f"done: {count:,} events in {elapsed:.1f}s ({count / elapsed:,.0f} events/s), status {client.wait().name}"
    )
    return {"events": count, "seconds": elapsed}
