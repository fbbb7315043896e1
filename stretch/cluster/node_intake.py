"""What a node does with the rows a writer sends it, however they came (a Flight exchange or put,
or a shared-memory segment): the node must see every row before its job does.

- A keyed channel's rows are refused whole (``NOT_OWNER``) if any row's key group is not owned
  and ready here; a (query, micro-batch) a key group took before is dropped there, remembered per
  key group so that the mark moves with the key group.
- A broadcast channel's rows are taken whole, each (query, micro-batch) once per node, and refused
  (``NOT_MEMBER``) from a writer of an older membership than the one the node was fenced for.
- A stage transaction's rows (``op: stage``, the one-query Spark stage) are checked as keyed rows,
  the fresh ones taken as a part of the transaction, and the answer carries the results of every
  part of it that covers the rows' key groups (cluster.stage_parts), once they are ready.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from pyarrow import flight

from stretch.cluster.node_job import NodeJob
from stretch.cluster.protocol import NOT_MEMBER, NOT_OWNER

OK = {"ok": True}


class NodeIntake:
    """Rows into the jobs of ``node`` (a NodeServer)."""

    def __init__(self, node):
        self.node = node

    def take(self, cmd: dict, batches: list[pa.RecordBatch]) -> tuple[dict, list[bytes]]:
        """A writer's rows (``cmd``: op, job, channel, query, batch, ...); the reply and, for a
        stage transaction, its results."""
        # One batch: a key group's rows of a (query, batch) are taken or dropped all together.
        combined = pa.Table.from_batches(batches).combine_chunks().to_batches() if batches else []
        if not combined or not combined[0].num_rows:
            return ({"parts": []} if cmd["op"] == "stage" else OK), []
        batch = combined[0]
        node = self.node
        with node.lock:
            job = node.job(cmd["job"])
            if cmd["op"] == "write" and cmd["channel"] in job.broadcast:
                self._broadcast(job, cmd, batch)
                return OK, []
            kgs = self._owned_key_groups(job, cmd["channel"], batch, cmd["op"] == "stage")
            if "wm" in cmd:  # the writer's watermark before these rows: they are judged by it here too
                job.event_time.observe(cmd["channel"], cmd["wm"])
            if cmd["op"] == "stage":
                parts = self._stage(job, cmd, batch, kgs)
            else:
                self._keyed(job, cmd, batch, kgs)
                return OK, []
        return job.stage.answer(parts)  # outside the lock: other writers go on meanwhile

    def _owned_key_groups(
        self, job: NodeJob, channel: str, batch: pa.RecordBatch, stage: bool = False
    ) -> np.ndarray:
        """The rows' key groups, all owned and ready here, else the whole part is refused (a
        ``stage`` transaction's also if a pre-copy copies them out: its results come whole)."""
        node = self.node
        route = job.inputs.get(channel)
        if route is None:
            raise flight.FlightServerError(
                f"job {job.name!r} has no input channel {channel!r} (inputs: {sorted(job.inputs)})"
            )
        kgs = route.key_groups(batch, job.max_parallelism)
        owned = node.owned if node.owned is not None else np.zeros(job.max_parallelism, bool)
        lingering = node.lingering.get((job.name, channel))
        if lingering is not None:  # a forward into key groups on their way out (NodeHandoff.release)
            owned = owned | lingering
        precopying = node.handoff.precopying
        if stage and precopying is not None:
            owned = owned & ~precopying
        foreign = np.unique(kgs[~owned[kgs]])
        if foreign.size:
            raise flight.FlightServerError(
                f"{NOT_OWNER} version={node.version}: node {node.node_id} does not own key groups "
                f"{foreign[:8].tolist()}{'...' if foreign.size > 8 else ''}; reload the routing table"
            )
        return kgs

    @staticmethod
    def _keyed(job: NodeJob, cmd: dict, batch: pa.RecordBatch, kgs: np.ndarray) -> None:
        query, batch_id = cmd.get("query"), cmd.get("batch")
        if query is None:
            job.take(cmd["channel"], batch, None, None)
            return
        mark = job.mark(cmd["channel"], query)
        fresh = mark[kgs] < batch_id
        rows = batch if fresh.all() else batch.filter(pa.array(fresh))
        if rows.num_rows:
            job.take(cmd["channel"], rows, query, batch_id)
            mark[np.unique(kgs[fresh])] = batch_id

    @staticmethod
    def _stage(job: NodeJob, cmd: dict, batch: pa.RecordBatch, kgs: np.ndarray) -> list:
        """Rows of a stage transaction: the fresh ones taken as a new part; the parts of the
        transaction that cover the rows' key groups (taken here, or where their key groups were)."""
        channel, query, batch_id, partition = (
            cmd["channel"],
            cmd["query"],
            int(cmd["batch"]),
            int(cmd["partition"]),
        )
        name = (channel, query, batch_id, partition)
        mark = job.mark(channel, f"{query}#{partition}")
        fresh = mark[kgs] < batch_id
        if fresh.any():
            rows = batch if fresh.all() else batch.filter(pa.array(fresh))
            taken = np.unique(kgs[fresh])
            job.stage.take(name, cmd["output"], rows, taken.tolist())
            mark[taken] = batch_id
        wanted = np.unique(kgs).tolist()
        parts = job.stage.covering(name, wanted)
        missing = set(wanted).difference(*(p.key_groups for p in parts))
        if missing:
            raise RuntimeError(
                f"stage transaction {name} of job {job.name!r}: key groups {sorted(missing)[:8]} took its "
                "rows before, and the results they caused are no longer kept (only a query's latest two "
                "micro-batches are)"
            )
        return parts

    def _broadcast(self, job: NodeJob, cmd: dict, batch: pa.RecordBatch) -> None:
        """Rows of a broadcast channel: every node takes them all, each (query, batch) at most once
        per node; refused (``NOT_MEMBER``) if the writer's membership is older than this node's
        (a node joined, copying this one's broadcast state: the writer must send it the rows too)."""
        node = self.node
        given = cmd.get("members")
        if given is None or given < node.members:
            raise flight.FlightServerError(
                f"{NOT_MEMBER} members={node.members}: node {node.node_id} takes broadcast rows of "
                f"membership {node.members} on only (the writer's is {given}); reload the members"
            )
        query, batch_id = cmd.get("query"), cmd.get("batch")
        if query is not None and batch_id <= job.broadcast_marks.get((cmd["channel"], query), -1):
            return
        job.take(cmd["channel"], batch, query, batch_id)
        if query is not None:
            job.broadcast_marks[(cmd["channel"], query)] = batch_id
