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


def run(
    seconds: float = 10.0,
    parallelism: int = 1,
    rate: float = 200_000.0,
    schedule: tuple[int, ...] = (2, 4, 1),
    elastic: bool = False,
    out=print,
) -> dict:
    """Run the demo job; prints a line per second and each rescale's report; returns a summary.

    The operator starts at ``parallelism`` and is rescaled live to each value of ``schedule`` at
    evenly spaced moments of the run, or, with ``elastic``, by the elasticity controller.
    """
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    if elastic:
        from stretch.elasticity import ThresholdPolicy

        env.enable_elasticity(ThresholdPolicy(), 1, 4, interval_ms=1000, cooldown_ms=2000)
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
    plan = "" if elastic or not schedule else ", rescaling live to " + " -> ".join(map(str, schedule))
    out(
        f"stretch demo: {count:,} click events at {rate:,.0f}/s, keyed by {USERS:,} users, "
        f"parallelism {parallelism}{plan}{' (elastic)' if elastic else ''}"
    )
    moments = [] if elastic else [seconds * (i + 1) / (len(schedule) + 1) for i in range(len(schedule))]
    steps = list(zip(moments, schedule))
    seen_rescales = 0
    last_in, last_t, started = 0, time.monotonic(), time.monotonic()
    while not client.wait(0.25).is_globally_terminal_state():
        now = time.monotonic()
        if steps and now - started >= steps[0][0]:
            _, p = steps.pop(0)
            try:
                client.rescale("running-total", p)
            except RuntimeError:
                break  # the input ended first
        for r in client._coordinator.rescales[seen_rescales:]:
            out(
                f"  {now - started:5.1f}s  rescaled {r['old_parallelism']} -> {r['new_parallelism']} in "
                f"{r['elapsed_ms']:.2f} ms (epoch {r['epoch']}, 0 state bytes copied)"
            )
        seen_rescales = len(client._coordinator.rescales)
        if now - last_t < 1.0:
            continue
        op = client.describe()["operators"][0]
        records = op["records_in"]
        out(
            f"  {now - started:5.1f}s  {(records - last_in) / (now - last_t):>12,.0f} events/s"
            f"  total {records:>12,}  parallelism {op['parallelism']}  gate depth {op['gate_depth']:>3}"
        )
        last_in, last_t = records, now
    elapsed = time.monotonic() - started
    status = client.wait()
    out(f"done: {count:,} events in {elapsed:.1f}s ({count / elapsed:,.0f} events/s), status {status.name}")
    return {"events": count, "seconds": elapsed, "rescales": list(client._coordinator.rescales)}
