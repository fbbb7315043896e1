"""Throughput on W1 (keyed running count+sum): stretch beside a dict loop and a numba loop.

    python experiments/throughput.py --json

Peers, all on the same in-memory data and all producing the running (count, sum) of every event:
a plain Python dict loop and a numba hash loop on one core (the per-core floor and ceiling), and
stretch's KeyedProcessFunction with ValueState and its vectorized built-in ``sum`` at parallelism
1 and 2. stretch is timed from the first batch written into the job's input channel until its last
result is out (the job is started and warm before), so start-up is not counted. Medians of
``--repeats`` runs; the numba loop, whose memory and caches make single passes vary several-fold
on a shared machine, is its best of ``--numba-passes`` passes per repeat over warm memory (its
ceiling), with their spread. ``--cpu`` also reports the CPU seconds of the writing process and of
each worker process per stretch run (Linux). Also measures the shared memory used per key with
10 M distinct keys, by the rolling ``sum`` (an int64 count a key) and by the KeyedProcessFunction
(two ValueStates a key); ``--state-only`` measures only that.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa
from _common import OUT, CpuSampler, emit, log, median, w1
from numba import njit

from stretch import channels
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.datastream.state import ValueStateDescriptor

W1_TYPE = Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])
SETTLE = 0.5  # seconds between starting a job and timing it


# ---- peers on one core ---------------------------------------------------------------------
def dict_loop(keys: list, values: list) -> list:
    counts: dict = {}
    sums: dict = {}
    out = []
    append = out.append
    for k, v in zip(keys, values):
        c = counts.get(k, 0) + 1
        counts[k] = c
        s = sums.get(k, 0.0) + v
        sums[k] = s
        append((k, c, s))
    return out


@njit(cache=True)
def _numba_loop(keys, values, table_keys, table_count, table_sum, out_count, out_sum):
    mask = table_keys.shape[0] - 1
    for i in range(keys.shape[0]):
        k = keys[i]
        h = (np.uint64(k) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
        s = np.int64(h) & mask
        while table_count[s] != 0 and table_keys[s] != k:
            s = (s + 1) & mask
        table_keys[s] = k
        table_count[s] += 1
        table_sum[s] += values[i]
        out_count[i] = table_count[s]
        out_sum[i] = table_sum[s]


class NumbaLoop:
    """The numba peer with its output and table memory allocated once, up front, as stretch's gates
    and state are, and written again right before each timed pass: a pass then measures the loop,
    not page faults (the output's pages, left idle while stretch runs, may have gone cold)."""

    def __init__(self, events: int, distinct: int):
        size = 1 << (2 * distinct - 1).bit_length()
        self.out_c = np.zeros(events, np.int64)
        self.out_s = np.zeros(events, np.float64)
        self.table = (np.zeros(size, np.int64), np.zeros(size, np.int64), np.zeros(size, np.float64))

    def run(self, keys: np.ndarray, values: np.ndarray) -> float:
        """One pass over warm memory; its seconds."""
        for t in (*self.table, self.out_c, self.out_s):
            t.fill(0)
        t0 = time.perf_counter()
        _numba_loop(keys, values, *self.table, self.out_c, self.out_s)
        return time.perf_counter() - t0


# ---- stretch ---------------------------------------------------------------------------------
class CountSum(KeyedProcessFunction):
    def open(self, runtime_context):
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.sum = runtime_context.get_state(ValueStateDescriptor("sum", Types.DOUBLE()))

    def process_element(self, value, ctx):
        c = (self.count.value() or 0) + 1
        s = (self.sum.value() or 0.0) + value[2]
        self.count.update(c)
        self.sum.update(s)
        yield value[0], c, s


def stretch_job(kind: str, parallelism: int, durable: bool = False):
    """``durable``: log the input channel (the default for users); the figures measure the
    engine's keyed processing without that copy unless ``--durable-input``."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    keyed = env.from_source(ChannelSource("w1", W1_TYPE, durable=durable), None, "w1").key_by(0)
    if kind == "process":
        out = keyed.process(CountSum(), Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()]))
    else:
        out = keyed.sum([1, 2])
    out.name(kind).sink_to(DiscardingSink())
    client = env.execute_async(f"throughput {kind} p{parallelism}")
    return client, channels.open_writer(client, "w1")


def stretch_run(
    kind: str, parallelism: int, data: pa.Table, durable: bool = False, cpu: dict | None = None
) -> float:
    """Seconds from the first batch written to the last result out; with ``cpu``, the CPU seconds
    the writer (this process) and the busy workers used meanwhile go into it."""
    client, writer = stretch_job(kind, parallelism, durable)
    batches = data.to_batches(max_chunksize=65536)
    time.sleep(SETTLE)  # the spare workers finish starting: not on the 2 cores while the run is timed
    sampler = CpuSampler() if cpu is not None else None
    t0 = time.monotonic()
    for b in batches:
        writer.write(b)
    writer.end()
    client.wait()
    if sampler is not None:
        cpu.update(sampler.stop())
    return client._coordinator.output_complete_at - t0


def state_bytes_per_key(distinct: int, kind: str = "sum") -> float:
    """Shared memory held by an operator over `distinct` keys, one record each: the rolling sum of
    an int64 count (``sum``) or CountSum's two ValueStates (``process``)."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    row_type = Types.TUPLE([Types.LONG(), Types.LONG()]) if kind == "sum" else W1_TYPE
    keyed = env.from_source(ChannelSource("keys", row_type, durable=False), None, "keys").key_by(0)
    out = keyed.sum(1) if kind == "sum" else keyed.process(CountSum(), W1_TYPE)
    out.name("count").sink_to(DiscardingSink())
    client = env.execute_async(f"state bytes per key ({kind})")
    writer = channels.open_writer(client, "keys")
    keys = np.random.default_rng(2).permutation(distinct).astype(np.int64)
    for start in range(0, distinct, 1 << 16):
        part = keys[start : start + (1 << 16)]
        columns = {"f0": part, "f1": np.ones(len(part), np.int64)}
        if kind != "sum":
            columns["f2"] = np.ones(len(part), np.float64)
        writer.write(pa.record_batch(columns))
    while client.describe()["operators"][0]["records_in"] < distinct:
        time.sleep(0.05)
    state = client.describe()["operators"][0]["state_bytes"]
    writer.end()
    client.wait()
    return state / distinct


def state_figures(distinct: int) -> dict:
    """Bytes per key of the rolling sum's state and of the KeyedProcessFunction's."""
    return {
        "state_bytes_per_key": round(state_bytes_per_key(distinct), 2),
        "state_bytes_per_key_process": round(state_bytes_per_key(distinct, "process"), 2),
        "state_keys": distinct,
    }


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [
        "dict_loop_meps",
        "process_p1_meps",
        "process_p2_meps",
        "numba_loop_meps",
        "sum_p1_meps",
        "sum_p2_meps",
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    colors = ["#999999", "#4c72b0", "#4c72b0", "#999999", "#dd8452", "#dd8452"]
    ax.bar([n.removesuffix("_meps") for n in names], [result[n] for n in names], color=colors)
    ax.set_yscale("log")
    ax.set_ylabel("million events / s (log)")
    ax.set_title(f"W1 keyed running count+sum, {result['events']:,} events, {result['keys']:,} keys")
    for i, n in enumerate(names):
        ax.text(i, result[n], f"{result[n]:.2f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--state-keys", type=int, default=10_000_000)
    ap.add_argument("--plot", default=str(OUT / "throughput.png"))
    ap.add_argument("--durable-input", action="store_true", help="log the input channel, as it is by default")
    ap.add_argument("--numba-passes", type=int, default=5, help="passes of the numba loop per repeat")
    ap.add_argument("--cpu", action="store_true", help="CPU seconds per process of each stretch run")
    ap.add_argument("--state-only", action="store_true", help="measure only the state bytes per key")
    args = ap.parse_args()
    if args.state_only:
        emit(state_figures(args.state_keys), args.json)
        return
    data = w1(args.events, args.keys)
    keys_np = data["f0"].to_numpy()
    values_np = data["f2"].to_numpy()
    keys_list, values_list = keys_np.tolist(), values_np.tolist()
    n = args.events
    times: dict[str, list[float]] = {}
    peer = NumbaLoop(n, args.keys)
    peer.run(keys_np[:1000], values_np[:1000])  # compile outside the timing
    numba_passes: list[float] = []
    cpu: dict[str, list] = {}
    for r in range(args.repeats):
        log(f"repeat {r + 1}/{args.repeats}")
        t0 = time.perf_counter()
        dict_loop(keys_list, values_list)
        times.setdefault("dict_loop", []).append(time.perf_counter() - t0)
        numba_passes += [peer.run(keys_np, values_np) for _ in range(args.numba_passes)]
        for kind in ("process", "sum"):
            for p in (1, 2):
                used = {} if args.cpu else None
                times.setdefault(f"{kind}_p{p}", []).append(
                    stretch_run(kind, p, data, args.durable_input, used)
                )
                if used is not None:
                    cpu.setdefault(f"{kind}_p{p}", []).append(used)
    result = {f"{name}_meps": round(n / median(ts) / 1e6, 3) for name, ts in times.items()}
    result["numba_loop_meps"] = round(n / min(numba_passes) / 1e6, 3)  # its best pass: the ceiling
    result["numba_loop_median_meps"] = round(n / median(numba_passes) / 1e6, 3)
    result["numba_loop_spread"] = round(max(numba_passes) / min(numba_passes), 2)  # slowest / best pass
    result.update(state_figures(args.state_keys))
    result.update(
        events=n,
        keys=args.keys,
        repeats=args.repeats,
        ratio_sum_p2_vs_numba=round(result["sum_p2_meps"] / result["numba_loop_meps"], 3),
        ratio_process_p2_vs_dict=round(result["process_p2_meps"] / result["dict_loop_meps"], 3),
        scaling_process=round(result["process_p2_meps"] / result["process_p1_meps"], 3),
        scaling_sum=round(result["sum_p2_meps"] / result["sum_p1_meps"], 3),
    )
    if cpu:  # per run: the writer's and the workers' CPU seconds (the busiest workers first)
        result["cpu_seconds"] = cpu
    OUT.mkdir(exist_ok=True)
    plot(result, args.plot)
    result["plot"] = args.plot
    emit(result, args.json)


if __name__ == "__main__":
    main()
