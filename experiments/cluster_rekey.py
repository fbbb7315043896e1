"""Re-keying across nodes: does a second node double a job that keys its keyed output again?

    python experiments/cluster_rekey.py --json [--events 1000000 --repeats 3]

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
"""

from __future__ import annotations

import argparse
import sys

import cloudpickle
from _common import emit, median, w1
from cluster_scaleout import BATCH, W1, CountSum, alternating_runs, runs_of

from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.datastream.state import ValueStateDescriptor

REGIONS = 1000
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


def rekeyed_job(parallelism: int) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    users = env.from_source(ChannelSource("w1", W1, durable=False), None, "w1").key_by(0)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    emit(rekey(args.events, args.keys, args.repeats), args.json)


if __name__ == "__main__":
    main()
