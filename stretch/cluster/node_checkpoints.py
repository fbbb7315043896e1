"""A node's side of failures (a cluster with a checkpoint directory): its checkpoints, and the
key groups of a dead node restored here.

A checkpoint copies the key groups a node owns of every checkpointed job into the checkpoint
directory (with their dedup marks and the stage transaction parts that cover them), saves the
node's manifest and commits the outputs it covers (cluster.recovery has the files). A recovery
loads a dead node's key groups from the checkpoint its manifest names and takes again the rows
its journal holds of them since, through this node's own journal.
"""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pyarrow as pa
from pyarrow import flight

from stretch.cluster import broadcast_restore, recovery
from stretch.cluster.node_job import NodeJob, rows_of
from stretch.runtime.channel_log import ChannelLog
from stretch.state.keyed_table import KeyedTable
from stretch.state.snapshot import copy_key_groups, describe_arena, release_key_groups


class NodeCheckpoints:
    """Checkpoints and recoveries of ``node`` (a NodeServer)."""

    def __init__(self, node):
        self.node = node

    def durable(self) -> list[NodeJob]:
        """The checkpointed jobs still running here (a finished job's output is all committed)."""
        return [
            job
            for job in self.node.jobs.values()
            if job.checkpoint_dir is not None and job.coordinator.status.name == "RUNNING"
        ]

    # ---- checkpoints ----------------------------------------------------------------------------
    def checkpoint(self, name: str, kgs: list[int], queued: dict | None = None) -> dict:
        """Checkpoint key groups ``kgs`` of every checkpointed job (the caller holds the lock, so
        no row comes in meanwhile), then commit the outputs it covers. ``queued`` {job: {operator:
        gate batches}}: rows the jobs took and did not process, their key groups released at the
        frontier (``release_checkpoint``); the checkpoint keeps them with the state."""
        node = self.node
        durable = self.durable()
        operators, marks, journal, outputs, stage_parts = {}, {}, {}, {}, {}
        for job in durable:
            job.flush()  # with their key groups released, instances skip the rows queued
            for operator in job.keyed:
                table = KeyedTable(job.arena(operator))
                operators.setdefault(job.name, {})[operator] = (
                    copy_key_groups(table, kgs),
                    describe_arena(table.arena),
                )
            marks[job.name] = job.marks_of(kgs)
            stage_parts[job.name] = job.stage.records(kgs)  # their results are made: flushed
            journal[job.name] = job.journal_offsets()
            outputs[job.name] = {c: log.end_offset for c, _r, log in job.outputs()}
        directory = recovery.node_dir(node.checkpoint_dir, node.node_id) / "checkpoints"
        path = directory / name
        size = recovery.write_checkpoint(
            path,
            operators,
            marks,
            {"key_groups": kgs, "version": node.version, "node": node.node_id},
            stage_parts,
            queued,
        )
        points = self._save_broadcast(durable, path)
        owned = np.flatnonzero(node.owned).tolist()
        manifest = {
            "checkpoint": str(path),
            "key_groups": owned,
            "journal": journal,
            "outputs": outputs,
            "adopted": [],
        }
        recovery.save_manifest(node.checkpoint_dir, node.node_id, manifest)
        for job in durable:
            for channel, _runner, log in job.outputs():
                log.set_committed(outputs[job.name][channel])
            for channel, log in job.journals.items():  # whole segments before it go
                log.commit("checkpoint", journal[job.name][channel])
            for channel, log in job.broadcast_journals.items():
                log.commit("checkpoint", points[job.name]["journal"][channel])
        # periodic checkpoints replace each other; a release's stays while its adopter needs it
        for old in directory.glob("c*"):
            if old != path and name.startswith("c"):
                shutil.rmtree(old, ignore_errors=True)
        return {"path": str(path), "bytes": size, "key_groups": len(kgs)}

    def release_checkpoint(self, name: str, held: list[int], moving: list[int]) -> tuple[dict, dict]:
        """The checkpoint a node takes as it gives key groups ``moving`` away (of ``held``, all it
        owned; the caller holds the lock and stopped taking rows of ``moving``): at the readers'
        frontier, not after the backlog.

        Its outputs must commit at one offset covering exactly what the state covers, so every
        key group it holds stops at the frontier together (``NodeJob.freeze``: released there,
        the rows queued behind it kept in the checkpoint); the barrier that flushes the outputs
        then passes rows nobody processes. Afterwards the key groups it keeps are taken back and
        their queued rows appended again, before any newer row of theirs (writers wait for the
        lock). Returns the checkpoint's report and the queued rows of ``moving``, per job and
        operator: they go to the new owner with the state. A job that cannot stop at the
        frontier (``NodeJob.release``) is checkpointed after its backlog, as a periodic
        checkpoint is."""
        frozen = {job.name: job.freeze(held, moving) for job in self.durable()}
        queued = {name_: {op: b for op, (b, _k) in ops.items()} for name_, ops in frozen.items()}
        report = self.checkpoint(name, held, queued)
        kept = [kg for kg in held if kg not in set(moving)]
        forwarded: dict[str, dict[str, list]] = {}
        for job in self.durable():
            for operator, (batches, keepers) in frozen.get(job.name, {}).items():
                job.take_back([kg for kg in kept if kg not in keepers], [operator])
                job.append(operator, rows_of(batches, kept))
                forwarded.setdefault(job.name, {})[operator] = rows_of(batches, moving)
        return report, forwarded

    @staticmethod
    def _save_broadcast(durable: list[NodeJob], path) -> dict[str, dict]:
        """The broadcast point of each checkpointed job with broadcast state, saved next to a
        checkpoint (its rows processed: the caller flushed them), for a restarted driver."""
        points = {job.name: job.broadcast_point() for job in durable if job.broadcast_ops}
        if points:
            broadcast_restore.save_checkpoint(path, points)
        return points

    def act_checkpoint(self, body: bytes) -> dict:
        """Checkpoint the key groups this node owns (every checkpointed job's) into the cluster's
        checkpoint directory; rows wait meanwhile."""
        node = self.node
        msg = json.loads(body)
        if node.checkpoint_dir is None:
            raise flight.FlightServerError(f"node {node.node_id} has no checkpoint directory")
        with node.lock:
            if not self.durable():
                return {"path": None, "bytes": 0, "key_groups": 0}
            t0 = time.monotonic()
            owned = np.flatnonzero(node.owned).tolist() if node.owned is not None else []
            report = self.checkpoint(f"c{int(msg['id'])}", owned)
            return {**report, "duration_ms": (time.monotonic() - t0) * 1000}

    # ---- restoring a dead node's key groups -----------------------------------------------------
    def act_recover(self, body: bytes) -> dict:
        """Own key groups of a node that died: load their state from its checkpoint (the part's
        ``base``), take again the rows its journal holds of them since (``journal``: per job and
        channel, the offset to start from), with their (query, micro-batch) marks and the stage
        transaction parts that cover them, then own them.

        The rows go through this node's own journal, so the manifest can say: they restore from
        the same base and this node's journal from here."""
        node = self.node
        msg = json.loads(body)
        durable = self.durable()
        with node.lock:
            at = {job.name: job.journal_offsets() for job in durable}
            taken = 0
            restored = sorted({int(kg) for part in msg["parts"] for kg in part["key_groups"]})
            for job in node.running():  # released here once: processed again before their rows
                job.take_back(restored)
            for part in msg["parts"]:
                kgs = np.asarray(part["key_groups"], dtype=np.int64)
                base = part["base"]
                meta = recovery.read_metadata(base) if base else {"operators": {}, "marks": {}}
                for job in durable:
                    layouts = meta["operators"].get(job.name, {})
                    for operator in job.keyed:
                        table = KeyedTable(job.arena(operator))
                        release_key_groups(table, kgs)  # a half-done load
                        if operator in layouts:
                            batches = recovery.read_key_groups(base, job.name, operator, kgs)
                            node.load_into(job, operator, layouts[operator], batches)
                        table.set_away(kgs, False)  # before the replay: its rows may set timers
                        if base:  # the rows its release checkpoint kept queued come first
                            taken += job.append(operator, recovery.read_queued(base, job.name, operator, kgs))
                    for channel, query, by_kg in meta["marks"].get(job.name, []):
                        mark = job.mark(channel, query)
                        for kg in kgs.tolist():
                            mark[kg] = max(mark[kg], int(by_kg.get(str(kg), -1)))
                    parts = recovery.read_stage_parts(base, job.name, kgs) if base else None
                    if parts is not None:
                        job.stage.adopt(parts)
                    for channel, start in part["journal"].get(job.name, {}).items():
                        taken += self._replay(job, channel, part["node"], int(start), kgs)
            if durable:
                manifest = recovery.load_manifest(node.checkpoint_dir, node.node_id)
                for part in msg["parts"]:
                    entry = {"key_groups": list(part["key_groups"]), "base": part["base"], "journal": at}
                    manifest["adopted"].append(entry)
                recovery.save_manifest(node.checkpoint_dir, node.node_id, manifest)
            for part in msg["parts"]:
                node.owned[part["key_groups"]] = True
            for job in node.jobs.values():  # jobs without checkpoints too: their new keys are here
                node.place(job)
            node.version = msg["version"]
        return {"rows_replayed": taken}

    def _replay(self, job: NodeJob, channel: str, source: str, start: int, kgs: np.ndarray) -> int:
        """The rows of ``kgs`` that node ``source`` journaled of ``channel`` from ``start`` on, taken
        again, each stage transaction's rows as a part of it again."""
        node = self.node
        try:
            log = ChannelLog(
                recovery.journal_dir(node.checkpoint_dir, source, job.name, channel), create=False
            )
        except LookupError:
            return 0
        wanted = np.zeros(job.max_parallelism, dtype=bool)
        wanted[kgs] = True
        taken = 0
        try:
            for journaled in log.read(start, log.end_offset):
                stage = recovery.stage_of(journaled)
                query, batch_id = recovery.tag_of(journaled)
                batch = recovery.untagged(journaled)
                keys = job.inputs[channel].key_groups(batch, job.max_parallelism)
                keep = wanted[keys]
                if not keep.any():
                    continue
                rows = batch if keep.all() else batch.filter(pa.array(keep))
                hit = np.unique(keys[keep])
                if stage is not None:
                    job.stage.take(tuple(stage[:4]), stage[4], rows, hit.tolist())
                else:
                    job.take(channel, rows, query, batch_id)
                taken += rows.num_rows
                if query is not None:
                    mark = job.mark(channel, query)
                    mark[hit] = np.maximum(mark[hit], batch_id)
        finally:
            log.close()
        return taken

    def act_broadcast_replay(self, body: bytes) -> dict:
        """Take again the broadcast rows an old node's journal holds of a job from ``journal``
        (channel -> offset; from its first row if not given), each (query, batch) once: a
        restarted driver's new node, started from that node's broadcast point."""
        node = self.node
        msg = json.loads(body)
        taken = 0
        with node.lock:
            job = node.job(msg["job"])
            for channel in job.broadcast:
                directory = recovery.journal_dir(node.checkpoint_dir, msg["node"], job.name, channel)
                try:
                    log = ChannelLog(directory, create=False)
                except LookupError:
                    continue
                try:
                    start = max(int(msg["journal"].get(channel, 0)), log.start_offset)
                    for batch in log.read(start, log.end_offset):
                        query, batch_id = recovery.tag_of(batch)
                        rows = recovery.untagged(batch)
                        if query is not None and batch_id <= job.broadcast_marks.get((channel, query), -1):
                            continue
                        job.take(channel, rows, query, batch_id)
                        if query is not None:
                            job.broadcast_marks[(channel, query)] = batch_id
                        taken += rows.num_rows
                finally:
                    log.close()
        return {"rows_replayed": taken}
