"""Re-keying across nodes: does a second node double a job that keys its keyed output again?

    python experiments/cluster_rekey.py --json [--events 1000000 --repeats 3]
    python experiments/cluster_rekey.py --json --checkpointed [--interval-ms 500]

W1's per-record job keyed by its key (running count and sum per key, two ValueStates), whose
output is keyed again by a region (the key modulo 1000) into a second per-record operator (a count
per region): on a cluster every row crosses to the node owning its region's key group
(cluster.rekey_plans). Each run is timed from the first batch written until the second operator
took every event; the runs alternate, ``--repeats`` times, medians reported:

- ``rekey_scaleout``: 2 nodes over 1 node, parallelism 1 on each, each node process and its
  workers pinned to a core of its own, as in cluster_scaleout.py (``rekey_pinned_*_meps``, and the
  nodes' CPU microseconds per event, ``rekey_node_cpu_us_per_event_*``);
- ``rekey_one_node_cluster_vs_engine``: a 1-node cluster against the same job on the node engine
  alone (where the second operator's gate is fed inside the engine), both at parallelism 2,
  unpinned.

``--checkpointed``: what exactly once costs a job that re-keys. A checkpointed job forwards what
its nodes' checkpoints commit (cluster.forward_log), so records cross the re-key up to a checkpoint
interval later. The same job on 2 unpinned nodes with and without checkpointing (every
``--interval-ms``), alternating: ``rekey_checkpointed_vs_plain`` (events/s as fast as the writer
goes) and, with ``--paced-events`` paced below capacity (``--pace-meps``), each one's tail: from
the last batch written until the second operator took every event.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import cloudpickle
from _common import emit, log, median, w1
from cluster_scaleout import BATCH, SETTLE, W1, CountSum, alternating_runs, processed, runs_of

from stretch.cluster import StretchCluster
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.datastream.state import ValueStateDescriptor

REGIONS = 1000
PACED_BATCH = 4096  # rows a write in the paced runs: the input comes evenly
OUT = Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # nodes do not have experiments/


class RegionOf(CountSum):
    """CountSum, whose output leads with the key's region: what the second operator keys by."""

    def process_element(self, value, ctx):
        for key, count, total in super().process_element(value, ctx):
            yield key % REGIONS, count, total


class RegionCount(KeyedProcessFunction):
    def open(self, runtime_context):
        self.n = runtime_context.get_state(ValueStateDescriptor("n", Types.LONG()))

    def process_element(self, value, ctx):
        n = (self.n.value() or 0) + 1
        self.n.update(n)
        yield value[0], n, value[2]


def rekeyed_job(parallelism: int, durable: bool = False) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    users = env.from_source(ChannelSource("w1", W1, durable=durable), None, "w1").key_by(0)
    regions = users.process(RegionOf(), OUT).name("count").key_by(0)
    regions.process(RegionCount(), OUT).name("regions").sink_to(DiscardingSink())
    return env


def rekey(events: int, keys: int, repeats: int) -> dict:
    data = w1(events, keys, seed=3).to_batches(max_chunksize=BATCH)
    ones, twos, alone, engine = alternating_runs(data, repeats, "re-keying", rekeyed_job, "regions")
    one, two = [r["meps"] for r in ones], [r["meps"] for r in twos]
    return {
        "rekey_events": events,
        "rekey_repeats": repeats,
        "rekey_pinned_1_node_meps": round(median(one), 3),
        "rekey_pinned_2_nodes_meps": round(median(two), 3),
        "rekey_scaleout": round(median([b / a for a, b in zip(one, two)]), 3),
        "rekey_node_cpu_us_per_event_1_node": round(median([r["cpu_us"] for r in ones]), 3),
        "rekey_node_cpu_us_per_event_2_nodes": round(median([r["cpu_us"] for r in twos]), 3),
        "rekey_one_node_cluster_meps": round(median(alone), 3),
        "rekey_engine_meps": round(median(engine), 3),
        "rekey_one_node_cluster_vs_engine": round(median([c / e for c, e in zip(alone, engine)]), 3),
        "runs": runs_of(one, two, alone, engine),
    }


def checkpointed(
    events: int, keys: int, repeats: int, interval_ms: int, pace_meps: float, paced_events: int
) -> dict:
    """The job with and without checkpointing on 2 nodes (see the module's docstring), medians:
    the events/s as fast as the writer goes, and the tail with the input paced at ``pace_meps``
    (below what the nodes do: the tail is then the records' way through, not a backlog)."""
    data = w1(events, keys, seed=3).to_batches(max_chunksize=BATCH)
    paced = w1(paced_events, keys, seed=4).to_batches(max_chunksize=PACED_BATCH)
    runs: dict[str, list] = {"plain": [], "checkpointed": [], "plain_paced": [], "checkpointed_paced": []}
    for r in range(repeats):
        log(f"checkpointed re-keying, repeat {r + 1} of {repeats} ...")
        runs["plain"].append(_two_nodes(data, None))
        runs["checkpointed"].append(_two_nodes(data, interval_ms))
        runs["plain_paced"].append(_two_nodes(paced, None, pace_meps))
        runs["checkpointed_paced"].append(_two_nodes(paced, interval_ms, pace_meps))
    meps = {k: [m for m, _t in v] for k, v in runs.items()}
    return {
        "rekey_checkpoint_interval_ms": interval_ms,
        "rekey_plain_meps": round(median(meps["plain"]), 3),
        "rekey_checkpointed_meps": round(median(meps["checkpointed"]), 3),
        "rekey_checkpointed_vs_plain": round(
            median([c / p for p, c in zip(meps["plain"], meps["checkpointed"])]), 3
        ),
        "rekey_paced_meps": pace_meps,
        "rekey_plain_tail_ms": round(median([t for _m, t in runs["plain_paced"]]), 1),
        "rekey_checkpointed_tail_ms": round(median([t for _m, t in runs["checkpointed_paced"]]), 1),
        "runs": runs,
    }


def _two_nodes(data, interval_ms: int | None, pace_meps: float | None = None) -> tuple[float, float]:
    """(M events/s, tail ms: from the last batch written until the second operator took every
    event) of the job on 2 nodes, checkpointed every ``interval_ms`` if given, the input paced at
    ``pace_meps`` if given."""
    rows = sum(b.num_rows for b in data)
    with (
        tempfile.TemporaryDirectory() as checkpoints,
        StretchCluster.local(nodes=2, checkpoint_dir=checkpoints if interval_ms else None) as cluster,
    ):
        env = rekeyed_job(1, durable=interval_ms is not None)
        if interval_ms:
            env.enable_checkpointing(interval_ms)
        client = env.execute_async(f"rekey {time.time_ns()}", cluster=cluster)
        writer = client.writer("w1")
        time.sleep(SETTLE)
        t0 = time.perf_counter()
        sent = 0
        for i, b in enumerate(data):
            if pace_meps:  # each batch at its time: the last one's write is where the tail starts
                time.sleep(max(0.0, t0 + sent / (pace_meps * 1e6) - time.perf_counter()))
            writer.write(b, query="w1", batch=i)
            sent += b.num_rows
        written = time.perf_counter()
        while sum(processed(d, "regions") for d in client.describe().values()) < rows:
            time.sleep(0.005)
        done = time.perf_counter()
        client.cancel()
        writer.close()
    return round(rows / (done - t0) / 1e6, 3), round((done - written) * 1000, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpointed", action="store_true", help="with and without checkpointing")
    parser.add_argument("--interval-ms", type=int, default=500)
    parser.add_argument("--pace-meps", type=float, default=0.05, help="the paced runs' input rate")
    parser.add_argument("--paced-events", type=int, default=200_000, help="events of a paced run")
    args = parser.parse_args()
    if args.checkpointed:
        figures = checkpointed(
            args.events, args.keys, args.repeats, args.interval_ms, args.pace_meps, args.paced_events
        )
        emit(figures, args.json)
    else:
        emit(rekey(args.events, args.keys, args.repeats), args.json)


if __name__ == "__main__":
    main()
