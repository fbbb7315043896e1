"""Scale-out: does a second node double the work done? And what does the cluster's hop cost?

    python experiments/cluster_scaleout.py --json [--scaleout-events 2000000 --repeats 3]

(also part of ``experiments/cluster_scale.py --json``). A per-record KeyedProcessFunction
(running count and sum per key, two ValueStates) over W1, each run timed from the first batch
written until every event went through the operator; the runs of the figures alternate,
``--repeats`` times, medians reported:

- ``scaleout_efficiency``: 2 nodes over 1 node, parallelism 1 on each, each node process (and every worker it starts)
  pinned to a core of its own (``os.sched_setaffinity``: node-0 on core 0, node-1 on core 1); the
  writer is the same in both (this process, unpinned, one ClusterWriter sending W1 batches as named
  micro-batches through shared memory). On a 2-core machine the writer shares the cores with the
  2 nodes, while beside 1 node it has the other core to itself: ``writer_cpu_share`` says how much
  of the cores it took, ``node_core_share_*`` how much of its core each node got (the rest went
  to whatever else ran on the machine), and ``scaleout_efficiency_per_cpu`` what 2 nodes would do
  with a core each to themselves: twice the nodes' CPU per event on 1 node over that on 2.
- ``one_node_cluster_vs_engine``: a 1-node cluster against the same job on the node engine alone
  (no cluster: ``channels.open_writer`` into its channel), both at parallelism 2, unpinned.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import cloudpickle
import pyarrow as pa
from _common import emit, log, median, w1

from stretch import channels
from stretch.cluster import StretchCluster
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.datastream.state import ValueStateDescriptor

W1 = Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])
BATCH = 65_536
SETTLE = 2.0  # seconds


# Nodes do not have experiments/ on their path: its functions travel by value, imported or run.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class CountSum(KeyedProcessFunction):
    """W1's per-record job: each key's running count and sum, in two ValueStates."""

    def open(self, runtime_context):
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.sum = runtime_context.get_state(ValueStateDescriptor("sum", Types.DOUBLE()))

    def process_element(self, value, ctx):
        c = (self.count.value() or 0) + 1
        s = (self.sum.value() or 0.0) + value[2]
        self.count.update(c)
        self.sum.update(s)
        yield value[0], c, s


def per_record_job(parallelism: int) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.from_source(ChannelSource("w1", W1, durable=False), None, "w1").key_by(0).process(
        CountSum(), Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])
    ).name("count").sink_to(DiscardingSink())
    return env


def processed(describe: dict, operator: str = "count") -> int:
    """Events ``operator`` took so far, from a job's ``describe()``."""
    return sum(o["records_in"] for o in describe["operators"] if o["name"] == operator)


def timed_run(writer, data: list[pa.RecordBatch], progress, named: bool) -> float:
    """Seconds from the first batch written until ``progress()`` counts every event processed."""
    rows = sum(b.num_rows for b in data)
    t0 = time.perf_counter()
    for i, b in enumerate(data):
        if named:
            writer.write(b, query="w1", batch=i)
        else:
            writer.write(b)
    while progress() < rows:  # asked every 50 ms (each ask costs the nodes a describe)
        time.sleep(0.05)
    return time.perf_counter() - t0


def process_tree(pid: int) -> list[int]:
    """A process and every process under it (a node's job workers, zygote and spares)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def pin_nodes(cluster: StretchCluster) -> None:
    """node-i and everything under it on core i: a core each, as on a machine each."""
    for i, pid in enumerate(cluster.launcher.pids().values()):
        for p in process_tree(pid):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(p, {i % os.cpu_count()})


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pids: list[int]) -> float:
    """CPU seconds the processes under ``pids`` used so far (those still there)."""
    total = 0.0
    for pid in pids:
        for p in process_tree(pid):
            with contextlib.suppress(OSError, IndexError, ValueError):
                total += cpu_seconds(p)
    return total


def cluster_run(
    nodes: int, data: list[pa.RecordBatch], pinned: bool, parallelism: int, job=None, last: str = "count"
) -> dict:
    """The per-record job (or ``job(parallelism)``, done once ``last`` took every event) on a
    local cluster of ``nodes``: ``meps`` (M events/s), ``writer`` (the share of the machine's cores
    the writer, this process, used), ``node_share`` (of a core, each node's processes on average)
    and ``cpu_us`` (the nodes' CPU microseconds per event)."""
    with StretchCluster.local(nodes=nodes) as cluster:
        client = (job or per_record_job)(parallelism).execute_async(
            f"scaleout {nodes} {time.time_ns()}", cluster=cluster
        )
        if pinned:
            pin_nodes(cluster)
        writer = client.writer("w1")
        time.sleep(SETTLE)  # spare workers finish starting: not on the cores while the run is timed
        if pinned:
            pin_nodes(cluster)  # what started meanwhile
        pids = list(cluster.launcher.pids().values())
        before, used, w0 = cpu_seconds(os.getpid()), tree_cpu(pids), time.perf_counter()
        progress = lambda: sum(processed(d, last) for d in client.describe().values())  # noqa: E731
        elapsed = timed_run(writer, data, progress, True)
        wall = time.perf_counter() - w0
        share = (cpu_seconds(os.getpid()) - before) / wall / os.cpu_count()
        used = tree_cpu(pids) - used
        client.cancel()
        writer.close()
    rows = sum(b.num_rows for b in data)
    return {
        "meps": rows / elapsed / 1e6,
        "writer": share,
        "node_share": used / wall / nodes,
        "cpu_us": used / rows * 1e6,
    }


def engine_run(data: list[pa.RecordBatch], parallelism: int, job=None, last: str = "count") -> float:
    """Events per second (M) of the per-record job (or ``job``) on the node engine alone."""
    client = (job or per_record_job)(parallelism).execute_async(f"scaleout engine {time.time_ns()}")
    writer = channels.open_writer(client, "w1")
    time.sleep(SETTLE)
    elapsed = timed_run(writer, data, lambda: processed(client.describe(), last), False)
    client.cancel()
    return sum(b.num_rows for b in data) / elapsed / 1e6


def alternating_runs(data, repeats: int, what: str, job=None, last: str = "count") -> tuple:
    """(1 pinned node, 2 pinned nodes, 1 unpinned node at parallelism 2, the engine alone): each
    kind's runs of ``job`` (the per-record job by default), alternating, ``repeats`` times."""
    ones, twos, alone, engine = [], [], [], []
    for r in range(repeats):
        log(f"{what}, repeat {r + 1} of {repeats} ...")
        ones.append(cluster_run(1, data, True, 1, job, last))
        twos.append(cluster_run(2, data, True, 1, job, last))
        alone.append(cluster_run(1, data, False, 2, job, last)["meps"])
        engine.append(engine_run(data, 2, job, last))
    return ones, twos, alone, engine


def runs_of(one, two, alone, engine) -> dict:
    """Each kind's runs (M events/s), for the record."""
    return {
        "pinned_1_node": [round(x, 3) for x in one],
        "pinned_2_nodes": [round(x, 3) for x in two],
        "one_node_cluster": [round(x, 3) for x in alone],
        "engine": [round(x, 3) for x in engine],
    }


def scaleout(events: int, keys: int, repeats: int) -> dict:
    """The two scale-out figures (see the module's docstring), runs alternating, medians."""
    data = w1(events, keys, seed=3).to_batches(max_chunksize=BATCH)
    ones, twos, alone, engine = alternating_runs(data, repeats, "scale-out")
    one, two = [r["meps"] for r in ones], [r["meps"] for r in twos]
    return {
        "scaleout_events": events,
        "scaleout_repeats": repeats,
        "pinned_1_node_meps": round(median(one), 3),
        "pinned_2_nodes_meps": round(median(two), 3),
        "scaleout_efficiency": round(median([b / a for a, b in zip(one, two)]), 3),
        "writer_cpu_share_2_nodes": round(median([r["writer"] for r in twos]), 3),
        # how much of its core each node got: below 1, the machine's other load took the rest
        "node_core_share_1_node": round(median([r["node_share"] for r in ones]), 3),
        "node_core_share_2_nodes": round(median([r["node_share"] for r in twos]), 3),
        "node_cpu_us_per_event_1_node": round(median([r["cpu_us"] for r in ones]), 3),
        "node_cpu_us_per_event_2_nodes": round(median([r["cpu_us"] for r in twos]), 3),
        # what 2 nodes would do with a core each to themselves: the work per event, 1 node over 2
        "scaleout_efficiency_per_cpu": round(
            median([2 * a["cpu_us"] / b["cpu_us"] for a, b in zip(ones, twos)]), 3
        ),
        "one_node_cluster_meps": round(median(alone), 3),
        "engine_meps": round(median(engine), 3),
        "one_node_cluster_vs_engine": round(median([c / e for c, e in zip(alone, engine)]), 3),
        "runs": runs_of(one, two, alone, engine),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options, for its own command line and cluster_scale.py's."""
    parser.add_argument("--scaleout-events", type=int, default=2_000_000, help="0: no scale-out runs")
    parser.add_argument("--scaleout-keys", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3, help="scale-out runs of each kind")


def from_arguments(args) -> dict:
    return scaleout(args.scaleout_events, args.scaleout_keys, args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    add_arguments(parser)
    args = parser.parse_args()
    emit(from_arguments(args), args.json)


if __name__ == "__main__":
    main()
