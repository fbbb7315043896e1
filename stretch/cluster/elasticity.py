"""Node elasticity: the cluster adds a node when every instance on its nodes stays saturated,
and removes one when they stay idle, with the engine's own policies.

Inside a node, a job's live rescale is copy-free and comes first; a node change copies key
groups, so it is for when a node as a whole is full. Every ``interval_ms`` the controller
measures each node (the busy fraction of its least busy instance over all its jobs' keyed
operators: a node is saturated only when every instance is) and hands the policy an
``OperatorLoad`` whose parallelism is the number of nodes and whose busy fractions are the
nodes'; the policy answers with a node count, and the controller adds or removes one node at a
time (the most recently added goes first). Its node changes are in ``changes``; one that a
node's death cut short (the cluster restored the node's key groups, with a checkpoint directory)
is in ``lost``, and the controller goes on.
"""

from __future__ import annotations

import threading
import time

from pyarrow import flight

from stretch.cluster.recovery import NodeLost
from stretch.elasticity import OperatorLoad, ThresholdPolicy


class NodeElasticity:
    def __init__(self, cluster, policy=None, min_nodes: int = 1, max_nodes: int = 4, interval_ms: int = 1000):
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {min_nodes} and {max_nodes}")
        self.cluster = cluster
        self.policy = policy if policy is not None else ThresholdPolicy()
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.interval = interval_ms / 1000
        self.changes: list[tuple[str, str, object]] = []  # ("add" | "remove", node, HandoffReport)
        self.error: BaseException | None = None
        self.lost: list[BaseException] = []  # node changes a node's death cut short (NodeLost)
        self._stop = threading.Event()
        self._previous: dict[
            str, tuple[dict, int, float]
        ] = {}  # node -> (busy_ns per instance, records, when)
        self._thread = threading.Thread(target=self._run, name="stretch-node-elasticity", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                try:
                    self._round()
                except NodeLost as e:  # restored from the checkpoint directory: measure afresh
                    self.lost.append(e)
                    self._previous.clear()
                except flight.FlightUnavailableError:
                    if self.cluster.checkpoint_dir is None:
                        raise
                    self._previous.clear()  # a node died: the cluster restores it meanwhile
        except BaseException as e:  # the cluster closed under it, or a node change failed
            if not self._stop.is_set() and not self.cluster.closed:
                self.error = e

    def _round(self) -> None:
        load = self.measure()
        if load is None:
            return
        wanted = load.clamp(self.policy.decide(load))
        if wanted > load.parallelism:
            report = self.cluster.add_node()
            self.changes.append(("add", self.cluster.nodes[-1], report))
        elif wanted < load.parallelism:
            node = self.cluster.nodes[-1]
            self.changes.append(("remove", node, self.cluster.remove_node(node)))
        if wanted != load.parallelism:
            self._previous.clear()  # measure the new set of nodes afresh

    def measure(self) -> OperatorLoad | None:
        """The nodes' load over the last interval (None on the first look at a set of nodes)."""
        now = time.monotonic()
        busy, records, backlog = [], 0.0, 0
        complete = True
        for node, status in self.cluster.status().items():
            counters, total = {}, 0
            for job in status["jobs"].values():
                for op in job.get("operators", []):
                    backlog += op.get("gate_depth", 0)
                    total += op.get("records_in", 0)
                    for inst in op.get("instances", []):
                        counters[(job.get("name"), op["name"], inst["index"])] = inst["busy_ns"]
            before = self._previous.get(node)
            self._previous[node] = (counters, total, now)
            if before is None:
                complete = False
                continue
            seconds = max(now - before[2], 1e-9)
            fractions = [(ns - before[0].get(k, ns)) / 1e9 / seconds for k, ns in counters.items()]
            busy.append(min(fractions, default=0.0))
            records += (total - before[1]) / seconds
        n = len(self.cluster.nodes)
        if not complete or not busy:
            return None
        return OperatorLoad(
            operator="nodes",
            parallelism=n,
            busy=tuple(busy),
            throughput=records,
            backlog=backlog,
            backlog_growth=0,
            min_parallelism=self.min_nodes,
            max_parallelism=self.max_nodes,
        )
