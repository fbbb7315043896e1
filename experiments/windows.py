"""Event-time windows on W2: stretch beside a numba loop and Spark Structured Streaming.

    python experiments/windows.py --json

W2 is W1's events (int64 key uniform over 100k keys, float64 value) with event time = the
event's index in microseconds, 1 % of the events late by up to 50 ms; the job is a 10 ms
tumbling window with count and sum per key, watermarks bounded at 50 ms out of order (so no
event is dropped and every peer computes the same windows). Timestamps are microseconds here,
so window sizes and the bound are given to stretch in the same unit (10 ms = 10_000).

Peers, in one run, all on the same data:
  vector_p1/p2   stretch, ``key_by("f0").window(...).aggregate([count(), sum("f2")])`` (numba
                 kernels over Arrow batches), parallelism 1 and 2
  process_p2     stretch, a per-record ProcessWindowFunction at parallelism 2 (on fewer events)
  numba_loop     one core: a numba loop doing the same windowed aggregation over the same 65536-event
                 batches, with the same watermark after each batch; its memory is allocated once and
                 written through before each pass, and it reports the fastest of its passes
                 (``--peer-passes`` per repeat) and their spread (slowest / fastest - 1)
  spark_ss       Spark Structured Streaming, local mode: ``groupBy(window(ts, "10 milliseconds"),
                 f0)`` with the same watermark, parquet files in, ``noop`` sink out (fewer events)
stretch is timed from the first batch written into the job's input channel until its last
result is out (start-up excluded); Spark from query start to its end (session start excluded).
Medians over ``--repeats`` (the numba peer: the minimum over its passes). ``window_p99_latency_ms`` is measured separately, with the input
paced at event-time speed (1 M events/s, one batch per 10 ms): from the moment the batch whose
watermark passes a window's end is written to the moment that window's last result is read from
the job's output channel, over the windows after a warm-up (``--latency-warmup`` seconds, while
the job first meets its keys), the job started and settled first; medians over
``--latency-repeats`` runs. ``window_startup_max_latency_ms`` is the worst window of the warm-up:
how far behind the job falls while its state first grows to the keys. It is reported for W2's
100k keys and, to show how the per-key work at a firing weighs in, for 1k keys.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _common import OUT, emit, log, median
from numba import njit

from stretch import channels
from stretch.common import Duration, Types, WatermarkStrategy
from stretch.datastream import ProcessWindowFunction, StreamExecutionEnvironment
from stretch.datastream import aggregates as A
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.window import TumblingEventTimeWindows

SETTLE = 0.5  # seconds between starting a latency run's job and writing to it

W2_TYPE = Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])  # key, event time (µs), value
WINDOW = 10_000  # 10 ms in µs
BOUND = 50_000  # 50 ms in µs
BATCH = 65_536


def w2(events: int, keys: int = 100_000, seed: int = 1) -> pa.Table:
    rng = np.random.default_rng(seed)
    ts = np.arange(events, dtype=np.int64)
    late = rng.random(events) < 0.01
    ts[late] -= rng.integers(0, BOUND, int(late.sum()))
    return pa.table(
        {
            "f0": rng.integers(0, keys, events, dtype=np.int64),
            "f1": np.maximum(ts, 0),
            "f2": rng.random(events),
        }
    )


# ---- numba peer ------------------------------------------------------------------------------
@njit(cache=True)
def _numba_windows(keys, ts, vals, tkeys, ring_w, ring_c, ring_s, wm_state, out_k, out_w, out_c, out_s):
    """Fold a batch into (key, window) accumulators, then emit what the batch's watermark closes.

    The table maps a key to a slot (open addressing); each slot has a ring of R windows, as a
    hand-written single-core aggregation would. wm_state = [max ts, watermark, lowest open window,
    highest window]. Returns the number of results written.
    """
    mask = tkeys.shape[0] - 1
    r_mask = ring_w.shape[1] - 1
    hi = wm_state[3]
    for i in range(keys.shape[0]):
        k = keys[i]
        h = (np.uint64(k) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
        s = np.int64(h) & mask
        while tkeys[s] != -1 and tkeys[s] != k:
            s = (s + 1) & mask
        tkeys[s] = k
        t = ts[i]
        if t > wm_state[0]:
            wm_state[0] = t
        w = t // WINDOW
        if (w + 1) * WINDOW - 1 <= wm_state[1]:
            continue  # late beyond the bound (does not happen on W2)
        q = w & r_mask
        if ring_c[s, q] != 0 and ring_w[s, q] != w:
            return -1  # the ring is too small for the open windows (sized for W2 below)
        if ring_c[s, q] == 0:
            ring_w[s, q] = w
            ring_c[s, q] = 1
            ring_s[s, q] = vals[i]
        else:
            ring_c[s, q] += 1
            ring_s[s, q] += vals[i]
        if w > hi:
            hi = w
    wm_state[3] = hi
    wm = wm_state[0] - BOUND - 1
    n = 0
    if wm > wm_state[1]:
        wm_state[1] = wm
        last = (wm - WINDOW + 1) // WINDOW
        for w in range(wm_state[2], min(last, hi) + 1):
            q = w & r_mask
            for s in range(tkeys.shape[0]):
                if ring_c[s, q] != 0 and ring_w[s, q] == w:
                    out_k[n], out_w[n], out_c[n], out_s[n] = tkeys[s], w, ring_c[s, q], ring_s[s, q]
                    ring_c[s, q] = 0
                    n += 1
        wm_state[2] = max(wm_state[2], last + 1)
    return n


class NumbaLoop:
    """The peer's table, rings and outputs are allocated once and written through before each
    pass (``reset``), so no pass pays the page faults of fresh memory."""

    def __init__(self, keys: int, events: int):
        self.size = 1 << (2 * keys - 1).bit_length()
        self.out = [np.empty(events, np.int64) for _ in range(3)] + [np.empty(events, np.float64)]
        self.tkeys = np.empty(self.size, np.int64)
        self.rings = [np.empty((self.size, 16), t) for t in (np.int64, np.int64, np.float64)]
        for o in self.out:
            o.fill(0)

    def reset(self) -> None:
        self.tkeys.fill(-1)
        for r in self.rings:
            r.fill(0)

    def run(self, data: pa.Table) -> int:
        """One pass over ``data`` (after ``reset``): the number of window results."""
        tkeys, (ring_w, ring_c, ring_s) = self.tkeys, self.rings
        state = np.array([-(2**62), -(2**62), 0, 0], np.int64)
        emitted = 0
        for b in data.to_batches(max_chunksize=BATCH):
            k, t, v = (b.column(i).to_numpy() for i in range(3))
            n = _numba_windows(k, t, v, tkeys, ring_w, ring_c, ring_s, state, *self.out)
            if n < 0:
                raise RuntimeError("numba peer: a key has more open windows than its ring holds")
            emitted += n
        state[0] = 2**62  # end of input: the watermark goes to the maximum
        empty = np.zeros(0, np.int64)
        emitted += _numba_windows(
            empty, empty, empty.astype(np.float64), tkeys, ring_w, ring_c, ring_s, state, *self.out
        )
        return emitted


# ---- stretch ---------------------------------------------------------------------------------
class CountSum(ProcessWindowFunction):
    def process(self, key, context, elements):
        n, s = 0, 0.0
        for e in elements:
            n += 1
            s += e[2]
        yield key, context.window().start, n, s


def strategy():
    return WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(BOUND)).with_timestamp_assigner(
        "f1"
    )


def stretch_job(kind: str, parallelism: int, sink=None):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    windowed = (
        env.from_source(ChannelSource("w2", W2_TYPE, durable=False), strategy(), "w2")
        .key_by("f0")
        .window(TumblingEventTimeWindows(WINDOW))
    )
    if kind == "vector":
        out = windowed.aggregate([A.count(), A.sum("f2")])
    else:
        out = windowed.process(
            CountSum(), Types.TUPLE([Types.LONG(), Types.LONG(), Types.LONG(), Types.DOUBLE()])
        )
    out.name("windows").sink_to(sink or DiscardingSink())
    client = env.execute_async(f"windows {kind} p{parallelism}")
    return client, channels.open_writer(client, "w2")


def stretch_run(kind: str, parallelism: int, data: pa.Table) -> tuple[float, int]:
    """(seconds from the first batch written to the last result out, results emitted)."""
    client, writer = stretch_job(kind, parallelism)
    batches = data.to_batches(max_chunksize=BATCH)
    t0 = time.monotonic()
    for b in batches:
        writer.write(b)
    writer.end()
    client.wait()
    elapsed = client._coordinator.output_complete_at - t0
    return elapsed, client.describe()["operators"][0]["records_out"]


def window_latencies(parallelism: int, seconds: float, keys: int) -> list[tuple[int, float]]:
    """(window end, latency in ms) of every window, the input paced at event-time speed into a job
    started and settled first (SETTLE), so that its start is not counted."""
    per_batch = WINDOW  # 10 ms of events per batch, written every 10 ms
    data = w2(int(seconds * 1_000_000), keys, seed=3)
    client, writer = stretch_job("vector", parallelism, ChannelSink("out"))
    time.sleep(SETTLE)
    reader = channels.open_reader(client, "out")
    arrivals: list[tuple[float, np.ndarray]] = []

    def read():
        while (b := reader.read_batch()) is not None:
            arrivals.append((time.monotonic(), b.column("window_end").to_numpy()))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    passed: list[tuple[int, float]] = []  # (watermark after the batch, when the batch was written)
    max_ts = -(2**62)
    start = time.monotonic()
    for i, b in enumerate(data.to_batches(max_chunksize=per_batch)):
        time.sleep(max(0.0, start + i * 0.01 - time.monotonic()))
        writer.write(b)
        passed.append((max(max_ts, int(b.column("f1").to_numpy().max())) - BOUND - 1, time.monotonic()))
        max_ts = max(max_ts, int(b.column("f1").to_numpy().max()))
    marks = np.array([w for w, _ in passed])
    written = np.array([w for _, w in passed])
    time.sleep(0.5)  # results of windows the last watermark closed
    writer.end()
    t.join(60)
    client.wait()
    done: dict[int, float] = {}  # window end -> when its last result (of any instance) came
    for at, ends in arrivals:
        for end in np.unique(ends).tolist():
            done[end] = at
    latencies = []
    for end, at in done.items():
        i = int(np.searchsorted(marks, end - 1))  # first batch whose watermark passed the end
        if i < len(marks):
            latencies.append((end, (at - written[i]) * 1000))
    return latencies


def latency_figures(args, keys: int) -> dict:
    """Medians over ``--latency-repeats`` runs: p50 and p99 over the windows after the warm-up,
    and the worst window of the warm-up, while the job first meets its keys (its state grows)."""
    p50, p99, startup, windows = [], [], [], 0
    warmup = args.latency_warmup * 1_000_000
    for _ in range(args.latency_repeats):
        every = window_latencies(2, args.latency_seconds, keys)
        after = [ms for end, ms in every if end > warmup]
        p50.append(float(np.percentile(after, 50)))
        p99.append(float(np.percentile(after, 99)))
        startup.append(max(ms for end, ms in every if end <= warmup))
        windows = len(after)
    return {
        "p50": round(median(p50), 2),
        "p99": round(median(p99), 2),
        "p99_runs": [round(x, 2) for x in p99],
        "startup_max": round(median(startup), 2),
        "windows": windows,
    }


# ---- Spark -----------------------------------------------------------------------------------
def spark_run(data: pa.Table, spark) -> float:
    from pyspark.sql import functions as F

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "w2"
        src.mkdir()
        micros = pa.array(data["f1"].to_numpy(), pa.timestamp("us"))
        table = pa.table({"f0": data["f0"], "ts": micros, "f2": data["f2"]})
        for i, b in enumerate(table.to_batches(max_chunksize=BATCH * 4)):
            pq.write_table(pa.Table.from_batches([b]), src / f"part-{i:05d}.parquet")
        schema = "f0 LONG, ts TIMESTAMP, f2 DOUBLE"
        stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(str(src))
        agg = (
            stream.withWatermark("ts", "50 milliseconds")
            .groupBy(F.window("ts", "10 milliseconds"), "f0")
            .agg(F.count("*").alias("n"), F.sum("f2").alias("s"))
        )
        t0 = time.monotonic()
        query = (
            agg.writeStream.format("noop")
            .outputMode("append")
            .option("checkpointLocation", str(Path(tmp) / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        return time.monotonic() - t0


def spark_session():
    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.master("local[2]")
        .appName("stretch windows benchmark")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--process-events", type=int, default=500_000)
    ap.add_argument("--spark-events", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer-passes", type=int, default=3, help="numba peer passes per repeat (min taken)")
    ap.add_argument("--latency-seconds", type=float, default=7.0)
    ap.add_argument("--latency-warmup", type=float, default=2.0)
    ap.add_argument("--latency-repeats", type=int, default=3)
    ap.add_argument("--no-spark", action="store_true", help="skip the Spark peer")
    args = ap.parse_args()
    data = w2(args.events, args.keys)
    small = data.slice(0, args.process_events)
    spark_data = data.slice(0, args.spark_events)
    times: dict[str, list[float]] = {}
    results: dict[str, int] = {}
    peer = NumbaLoop(args.keys, args.events)
    peer.reset()
    peer.run(data.slice(0, 1000))  # compile outside the timing
    peer_passes: list[float] = []
    spark = None if args.no_spark else spark_session()
    for r in range(args.repeats):
        log(f"repeat {r + 1}/{args.repeats}")
        for _ in range(args.peer_passes):
            peer.reset()
            t0 = time.perf_counter()
            results["numba_loop"] = peer.run(data)
            peer_passes.append(time.perf_counter() - t0)
        for p in (1, 2):
            elapsed, results[f"vector_p{p}"] = stretch_run("vector", p, data)
            times.setdefault(f"vector_p{p}", []).append(elapsed)
        elapsed, results["process_p2"] = stretch_run("process", 2, small)
        times.setdefault("process_p2", []).append(elapsed)
        if spark is not None:
            times.setdefault("spark_ss", []).append(spark_run(spark_data, spark))
    if spark is not None:
        spark.stop()
    events = {"process_p2": args.process_events, "spark_ss": args.spark_events}
    result = {"numba_loop_meps": round(args.events / min(peer_passes) / 1e6, 3)}
    result.update(
        {
            f"{name}_meps": round(events.get(name, args.events) / median(ts) / 1e6, 3)
            for name, ts in times.items()
        }
    )
    if results["vector_p2"] != results["numba_loop"] or results["vector_p1"] != results["numba_loop"]:
        raise SystemExit(f"peers disagree on the number of window results: {results}")
    lat = latency_figures(args, args.keys)
    few_keys = latency_figures(args, 1000)
    result.update(
        window_p50_latency_ms=lat["p50"],
        window_p99_latency_ms=lat["p99"],
        window_p99_latency_ms_runs=lat["p99_runs"],
        window_startup_max_latency_ms=lat["startup_max"],
        window_p99_latency_ms_1k_keys=few_keys["p99"],
        windows_measured=lat["windows"],
        events=args.events,
        keys=args.keys,
        window_results=results["numba_loop"],
        repeats=args.repeats,
        numba_loop_passes=len(peer_passes),
        numba_loop_spread=round(max(peer_passes) / min(peer_passes) - 1, 3),
        ratio_vector_p2_vs_numba=round(result["vector_p2_meps"] / result["numba_loop_meps"], 3),
        scaling_vector=round(result["vector_p2_meps"] / result["vector_p1_meps"], 3),
    )
    if "spark_ss_meps" in result:
        result["ratio_vector_p2_vs_spark"] = round(result["vector_p2_meps"] / result["spark_ss_meps"], 1)
    OUT.mkdir(exist_ok=True)
    emit(result, args.json)


if __name__ == "__main__":
    main()
