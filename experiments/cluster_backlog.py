"""A node added while the source nodes are seconds behind their writers: how long does a key wait?

    python experiments/cluster_backlog.py --json [--backlog-repeats 3 --backlog-s 2.5]

(also part of ``experiments/cluster_scale.py --json --backlog``). A per-record KeyedProcessFunction
(running count and sum per key, two ValueStates) over W1 runs on ``StretchCluster.local(nodes=2)``,
parallelism 2 on each node. A writer fills the nodes' gates until each holds at least
``--backlog-s`` seconds of work (its queued events over the rate it processes them), keeps writing
named micro-batches (holding back while each node has more than 1.2 times that queued), and a
third node joins: a third of the key
groups move, in steps of 8, while the backlog stands. Reported (medians over ``--repeats``, the
runs of both jobs alternating, ``--backlog-repeats`` times):

- ``max_stall_backlog_ms``: the longest any key group refused rows during the node change (a
  move's release to its adoption), for the job keyed by a field: its old owner stops the key
  groups at the readers' frontier and forwards the rows of theirs it had queued, pre-copied: the
  state and the queued rows go ahead while the old owner still takes rows of the key groups, and
  the release ships only the rows taken meanwhile;
- ``precopy_backlog_max_ms``: the longest pre-copy (writers' rows of its key groups were taken
  meanwhile, and waited unprocessed as the backlog ahead of them did); ``rows_precopied``: the
  queued rows that went ahead with the pre-copies;
- ``handoff_backlog_p50_ms``: a move's release to adoption, the median over the node change's;
- ``backlog_ms``: the least of the two source nodes' backlogs as the node change began;
- ``rows_forwarded``: the queued rows that went with the moved key groups;
- ``max_stall_backlog_barrier_ms``, ``stall_barrier_over_frontier``: the same, with the nodes'
  handoffs working off the moving key groups' backlog before releasing them, as every handoff did
  before (``STRETCH_HANDOFF_AT_TAIL`` in the nodes' environment), side by side; as do, still, jobs
  whose keyed operators a source task feeds on the node (a key selector function);
- ``lost``/``duplicated``: per key, the events the cluster's state counts against those written.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np
from _common import emit, log, median, w1
from cluster_scaleout import CountSum

from stretch.cluster import StretchCluster
from stretch.cluster.node_job import AT_TAIL_ENV
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.state.key_groups import key_groups_of

W1 = Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])
OUT = Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])
BATCH = 20_000


def job() -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.engine_config.gate_slots = 512  # gates that hold seconds of this job's work
    env.engine_config.gate_bytes = 256 << 20
    env.from_source(ChannelSource("w1", W1, durable=False), None, "w1").key_by(0).process(
        CountSum(), OUT
    ).name("count").sink_to(DiscardingSink())
    return env


def processed(cluster, name: str) -> dict[str, int]:
    """Events each node's operator took so far (of the nodes running the job already)."""
    return {
        node: sum(o["records_in"] for o in status["jobs"][name]["operators"] if o["name"] == "count")
        for node, status in cluster.status().items()
        if name in status["jobs"]
    }


def counts(client, keys: int) -> np.ndarray:
    state = client.query_state("count")
    held = np.zeros(keys, dtype=np.int64)
    if state.num_rows:
        held[state.column("key").to_numpy()] = state.column("count").to_numpy()
    return held


def run(at_tail: bool, data, keys: int, backlog_s: float) -> dict:
    """One node change under a backlog; its figures. ``at_tail``: the nodes work off the moving
    key groups' backlog first."""
    mp = 128
    if at_tail:
        os.environ[AT_TAIL_ENV] = "1"  # the nodes started now inherit it
    try:
        cluster = StretchCluster.local(nodes=2, step=8)
    finally:
        os.environ.pop(AT_TAIL_ENV, None)
    with cluster:
        name = f"backlog {at_tail} {time.time_ns()}"
        client = job().execute_async(name, cluster=cluster)
        writer = client.writer("w1")
        sent: dict[str, int] = {}  # events routed to each node (by the table as it was)
        written = 0

        def write(i: int) -> None:
            nonlocal written
            b = data[i % len(data)]
            owners = np.asarray(cluster.table.owners)
            writer.write(b, query="w1", batch=i)
            nodes, n = np.unique(owners[key_groups_of(b.column("f0"), mp)], return_counts=True)
            for node, c in zip(nodes.tolist(), n.tolist()):
                sent[node] = sent.get(node, 0) + c
            written = i + 1

        def queued() -> dict[str, int]:
            return {n: sent.get(n, 0) - took for n, took in processed(cluster, name).items()}

        write(0)  # every instance reads rows before the backlog builds
        while sum(processed(cluster, name).values()) < data[0].num_rows:
            time.sleep(0.05)
        i = 1  # each node's pace while it is behind: over 1.5 s, its queue never empty meanwhile
        while min(queued().values()) < 1_000_000:
            write(i)
            i += 1
        before, t0 = processed(cluster, name), time.monotonic()
        time.sleep(1.5)
        after, t1 = processed(cluster, name), time.monotonic()
        pace = {n: (after[n] - before[n]) / (t1 - t0) for n in before}
        target = {n: backlog_s * pace[n] for n in pace}  # events queued: backlog_s of its work

        def behind() -> dict[str, float]:
            """Each source node's backlog: its queued events over its pace, in seconds."""
            return {n: q / pace[n] for n, q in queued().items() if n in pace}

        stop = threading.Event()

        def feed():  # fill, then keep each node's backlog at about backlog_s while the node joins
            nonlocal i
            while not stop.is_set():
                if min(q / target[n] for n, q in queued().items() if n in target) > 1.1:
                    time.sleep(0.02)
                    continue
                for _ in range(4):
                    write(i)
                    i += 1

        at_start = {}

        def hook(at, src, dst):
            if at == "step" and not at_start:  # the first step begins with the backlogs standing
                until = time.monotonic() + 60
                while min(behind().values()) < backlog_s and time.monotonic() < until:
                    time.sleep(0.05)
                at_start.update(behind())

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        cluster._step_hook = hook
        report = cluster.add_node()
        cluster._step_hook = None
        stop.set()
        feeder.join()
        expected = np.zeros(keys, dtype=np.int64)
        for j in range(written):
            expected += np.bincount(data[j % len(data)].column("f0").to_numpy(), minlength=keys)
        deadline = time.monotonic() + 600
        while (held := counts(client, keys)).sum() < expected.sum() and time.monotonic() < deadline:
            time.sleep(0.5)
        client.cancel()
        writer.close()
    sources = [n for n in at_start if n != "node-2"]
    return {
        "max_stall_ms": report.max_stall_ms,
        "move_p50_ms": median(list(report.step_ms)),
        "backlog_ms": min(at_start[n] for n in sources) * 1000,
        "rows_forwarded": report.rows_forwarded,
        "rows_precopied": report.rows_precopied,
        "precopy_max_ms": max(report.precopy_ms, default=0.0),
        "events": int(expected.sum()),
        "lost": int(np.clip(expected - held, 0, None).sum()),
        "duplicated": int(np.clip(held - expected, 0, None).sum()),
    }


def backlog(keys: int, repeats: int, backlog_s: float) -> dict:
    data = w1(2_000_000, keys, seed=5).to_batches(max_chunksize=BATCH)
    frontier, barrier = [], []
    for r in range(repeats):
        log(f"handoff under a backlog, repeat {r + 1} of {repeats} ...")
        frontier.append(run(False, data, keys, backlog_s))
        barrier.append(run(True, data, keys, backlog_s))
        log(f"  frontier {frontier[-1]}\n  barrier  {barrier[-1]}")
    return {
        "backlog_repeats": repeats,
        "max_stall_backlog_ms": round(median([r["max_stall_ms"] for r in frontier]), 1),
        "handoff_backlog_p50_ms": round(median([r["move_p50_ms"] for r in frontier]), 1),
        "backlog_ms": round(median([r["backlog_ms"] for r in frontier]), 1),
        "rows_forwarded": int(median([r["rows_forwarded"] for r in frontier])),
        "rows_precopied": int(median([r["rows_precopied"] for r in frontier])),
        "precopy_backlog_max_ms": round(median([r["precopy_max_ms"] for r in frontier]), 1),
        "max_stall_backlog_barrier_ms": round(median([r["max_stall_ms"] for r in barrier]), 1),
        "backlog_barrier_ms": round(median([r["backlog_ms"] for r in barrier]), 1),
        "stall_barrier_over_frontier": round(
            median([b["max_stall_ms"] / f["max_stall_ms"] for f, b in zip(frontier, barrier)]), 1
        ),
        "backlog_lost": sum(r["lost"] for r in frontier + barrier),
        "backlog_duplicated": sum(r["duplicated"] for r in frontier + barrier),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's options, for its own command line and cluster_scale.py's."""
    parser.add_argument("--backlog-repeats", type=int, default=3)
    parser.add_argument("--backlog-s", type=float, default=2.5, help="each source node's backlog, at least")
    parser.add_argument("--backlog-keys", type=int, default=100_000)


def from_arguments(args) -> dict:
    return backlog(args.backlog_keys, args.backlog_repeats, args.backlog_s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    add_arguments(parser)
    args = parser.parse_args()
    emit(from_arguments(args), args.json)


if __name__ == "__main__":
    main()
