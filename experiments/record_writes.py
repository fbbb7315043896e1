"""A writer that writes one record at a time, the way a first program feeds a job.

    python experiments/record_writes.py --json

Each ``channels.open_writer(...).write([record])`` is one entry of the channel's gate. The job is
``key_by(lambda r: r[0]).reduce(sum)`` at parallelism 1 behind a channel that is not durable (the
engine alone), and ``--records`` records (keys uniform over 100) are written one per call; the
rate is records over the time from the first write until the job has finished with the last.
Beside it: ``key_by(0)`` (a field: the writer keys each record itself and appends it to the
operator's gate); the default, durable channel (the job logs every batch); the same at
parallelism 2; and a checkpointed job (its source reads the log). The peer is the same running sum
in plain Python across two processes: records put one at a time on a ``multiprocessing.Queue``
and summed per key by a consumer process. Medians of ``--repeats``, alternating.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time

from _common import emit, log, median

from stretch import channels
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])


def records(n: int) -> list[tuple[int, int]]:
    rng = random.Random(1)
    return [(rng.randrange(100), rng.randrange(1000)) for _ in range(n)]


def stretch_rate(
    data: list,
    by_field: bool = False,
    durable: bool = False,
    parallelism: int = 1,
    checkpointed: bool = False,
) -> float:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    if checkpointed:
        env.enable_checkpointing(1000)
    stream = env.from_source(ChannelSource("in", PAIR, durable=durable), None, "in")
    keyed = stream.key_by(0) if by_field else stream.key_by(lambda r: r[0])
    keyed.reduce(lambda a, b: (a[0], a[1] + b[1])).sink_to(DiscardingSink())
    client = env.execute_async(f"record writes {time.monotonic_ns()}")
    writer = channels.open_writer(client, "in")
    writer.write([data[0]])  # the job's first batch: its kernels and tables are ready
    t0 = time.perf_counter()
    for record in data:
        writer.write([record])
    writer.end()
    client.wait()
    return len(data) / (time.perf_counter() - t0)


def _consume(queue, n: int, done) -> None:
    totals: dict = {}
    for _ in range(n):
        key, value = queue.get()
        totals[key] = totals.get(key, 0) + value
    done.put(len(totals))


def queue_rate(data: list) -> float:
    """The peer: one record a put, to a process that keeps the running sums."""
    ctx = mp.get_context("fork")
    queue, done = ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=_consume, args=(queue, len(data), done))
    consumer.start()
    t0 = time.perf_counter()
    for record in data:
        queue.put(record)
    done.get()
    rate = len(data) / (time.perf_counter() - t0)
    consumer.join()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--records", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    data = records(args.records)
    cases = {
        "selector": lambda: stretch_rate(data),
        "field": lambda: stretch_rate(data, by_field=True),
        "durable": lambda: stretch_rate(data, durable=True),
        "durable_p2": lambda: stretch_rate(data, durable=True, parallelism=2),
        "checkpointed": lambda: stretch_rate(data, durable=True, checkpointed=True),
        "queue": lambda: queue_rate(data),
    }
    runs: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(args.repeats):
        for k, run in cases.items():
            runs[k].append(run())
        log(f"repeat {i + 1}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in runs.items()))
    rate = {k: median(v) for k, v in runs.items()}
    selector, queue = rate["selector"], rate["queue"]
    emit(
        {
            "record_writes_per_s": round(selector),
            "record_writes_by_field_per_s": round(rate["field"]),
            "record_writes_durable_per_s": round(rate["durable"]),
            "record_writes_durable_p2_per_s": round(rate["durable_p2"]),
            "record_writes_checkpointed_per_s": round(rate["checkpointed"]),
            "mp_queue_records_per_s": round(queue),
            "record_writes_vs_mp_queue": round(selector / queue, 2),
            "records": args.records,
            "repeats": args.repeats,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
