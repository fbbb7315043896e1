"""The driver's side of failures, with a checkpoint directory: periodic checkpoints of every node,
nodes that die restored on the others, a driver that died resumed by the next, and the garbage of
the checkpoint directory collected.

Nodes journal what they take and checkpoint their key groups into the directory (the files are
cluster.recovery's); a node that dies, at any point of a handoff too, has its key groups restored
on the surviving nodes from its latest checkpoint and journal; a driver started on the directories
of one that died starts as many fresh nodes and restores every key group on them.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import threading
import time

from stretch.cluster import broadcast_restore, recovery
from stretch.cluster.client import node_log_dir
from stretch.cluster.directory import HANDOFF
from stretch.cluster.forward_log import close_split, send_dead_log
from stretch.cluster.recovery import NodeLost
from stretch.cluster.routing import RoutingTable, plan_failover


class Failover:
    """Checkpoints and restores the nodes of ``cluster`` (a StretchCluster)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.recoveries: list[dict] = []  # one per node failure: which nodes, key groups, rows replayed
        self.errors: list[BaseException] = []  # the supervisor's, kept for the caller to see
        self._checkpoint_id = 0
        self._supervisor: threading.Thread | None = None

    # ---- checkpoints ----------------------------------------------------------------------------
    def checkpoint(self) -> dict[str, dict]:
        """Every node checkpoints its key groups of the checkpointed jobs now (see
        StretchCluster.checkpoint)."""
        c = self.cluster
        if c.checkpoint_dir is None:
            raise ValueError(
                "the cluster has no checkpoint directory (StretchCluster.local(checkpoint_dir=...))"
            )
        with c.changing():
            reports = self._checkpoint_all()
            self.collect_garbage()
            return reports

    def _checkpoint_all(self) -> dict[str, dict]:
        """Every node checkpoints now (the caller holds the change lock)."""
        c = self.cluster
        self._checkpoint_id += 1
        return {n: c.connection.action(n, "checkpoint", {"id": self._checkpoint_id}) for n in c.nodes}

    def collect_garbage(self) -> None:
        """Delete from the checkpoint directory what no manifest of a current node names (see
        recovery.collect_garbage); the caller holds the change lock, so none changes meanwhile."""
        c = self.cluster
        if c.checkpoint_dir is not None:
            nodes = [*c.nodes, *(c.table.nodes if c.table is not None else [])]
            recovery.collect_garbage(c.checkpoint_dir, nodes, lambda path: c.hook("collect", path, ""))

    # ---- the supervisor -------------------------------------------------------------------------
    def supervise(self) -> None:
        """Start the thread that restores nodes that die and takes the periodic checkpoints."""
        if self._supervisor is None:
            self._supervisor = threading.Thread(
                target=self._watch, name="stretch-cluster-supervisor", daemon=True
            )
            self._supervisor.start()

    def join(self, timeout: float) -> None:
        if self._supervisor is not None:
            self._supervisor.join(timeout)

    def _watch(self) -> None:
        c = self.cluster
        last = time.monotonic()
        while not c.stopping.wait(0.05):
            try:
                dead = [n for n in c.nodes if not c.launcher.alive(n)]
                if dead:
                    with c.changing():
                        dead = [n for n in dead if n in c.nodes]
                        if dead:
                            self.recover(dead)
                            self.collect_garbage()
                interval = c.jobs.interval
                if interval and time.monotonic() - last >= interval:
                    last = time.monotonic()
                    self.checkpoint()
            except Exception as e:  # kept for the caller to see; the thread goes on
                if c.stopping.is_set():
                    continue
                if self.dead_among(*c.nodes, wait=2.0):
                    continue  # a node died under the checkpoint: the next round restores it
                self.errors.append(e)

    def dead_among(self, *nodes: str, wait: float = 10.0) -> list[str]:
        """Which of ``nodes`` died (a call to one failed: give a killed process time to end)."""
        c = self.cluster
        deadline = time.monotonic() + wait
        while True:
            dead = [n for n in nodes if n in c.nodes and not c.launcher.alive(n)]
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    # ---- restoring nodes that died --------------------------------------------------------------
    def recover(
        self,
        dead: list[str],
        in_flight: dict | None = None,
        pending: dict | None = None,
        survivors: list[str] | None = None,
        origins: dict[int, str] | None = None,
    ) -> dict:
        """Restore the key groups of nodes that died on the surviving nodes (the caller holds the
        change lock): a new routing version without them; each key group from the checkpoint and
        journal its manifest names (``in_flight``: a move under way, whose key groups restore
        from the old owner unless the new one adopted them; ``pending``: key group -> old owner,
        moves of the step not begun, which go back to their old owner; ``origins``: key group ->
        node, those a node died restoring); the dead nodes' outputs cut back to their latest
        checkpoint. A node that dies restoring is restored in turn."""
        c = self.cluster
        checkpoints = c.checkpoint_dir
        if checkpoints is None:
            raise NodeLost(
                f"nodes {dead} died and the cluster has no checkpoint directory to restore them from"
            )
        t0 = time.monotonic()
        for node in dead:
            c.membership.forget(node)
        table = c.table
        if pending:  # the same version: these key groups never left their old owner
            table = RoutingTable(
                table.version, tuple(pending.get(kg, o) for kg, o in enumerate(table.owners))
            )
        origin: dict[int, str] = {}  # key group -> the node whose checkpoint and journal restore it
        for node in dead:
            for kg in table.key_groups_of(node):
                origin[kg] = node
        if in_flight is not None:
            src, dst, base = in_flight["src"], in_flight["dst"], in_flight.get("base")
            for kg in in_flight["key_groups"]:
                adopted = base is not None and recovery.adopted_from(checkpoints, dst, kg, base)
                origin[kg] = dst if adopted else src
        origin.update(origins or {})  # key groups a node died restoring: from where they came
        moves = plan_failover(table, dead, survivors)
        if moves or pending:
            c.table = table.moved(moves)
            c.store.save(c.table)
        parts: dict[str, dict[tuple, dict]] = {}
        manifests = {n: recovery.load_manifest(checkpoints, n) for n in set(origin.values())}
        for kg, node in sorted(origin.items()):
            base, journal = recovery.source_of(checkpoints, node, kg, manifests[node])
            key = (node, base, json.dumps(journal, sort_keys=True))
            part = parts.setdefault(c.table.owners[kg], {}).setdefault(
                key, {"node": node, "base": base, "journal": journal, "key_groups": []}
            )
            part["key_groups"].append(kg)
        entries = c.files.jobs()
        for node in dead:
            outputs = recovery.load_manifest(checkpoints, node)["outputs"]
            for job, channels_ in c.jobs.outputs.items():
                for channel in channels_:
                    log = node_log_dir(entries.get(job, {}), job, node, channel)
                    offset = outputs.get(job, {}).get(channel)
                    recovery.cut_output(log, offset if offset is not None else 1 << 62)
        held = self._hold_forwarding(True)  # the restored key groups' records go after the dead log's
        try:
            replayed, failed, unfinished = 0, [], {}
            for target, by_source in parts.items():
                body = {"version": c.table.version, "parts": list(by_source.values())}
                c.hook("recover", ",".join(dead), target)
                try:
                    replayed += c.connection.action(target, "recover", body)["rows_replayed"]
                except Exception:
                    if not self.dead_among(target):
                        raise
                    failed.append(target)  # it died restoring: what it had not adopted restores as before
                    adopted = recovery.load_manifest(checkpoints, target)["adopted"]
                    for part in by_source.values():
                        for kg in part["key_groups"]:
                            if not any(kg in e["key_groups"] and e["base"] == part["base"] for e in adopted):
                                unfinished[kg] = part["node"]
            forwarded = self._send_dead_logs([n for n in dead if n not in failed])
            report = {
                "nodes": list(dead),
                "key_groups": len(origin),
                "rows_replayed": replayed,
                "batches_forwarded": forwarded,
                "version": c.table.version,
                "elapsed_ms": (time.monotonic() - t0) * 1000,
            }
            self.recoveries.append(report)
            if failed:
                self.recover(failed, origins=unfinished)
        finally:
            if held:
                self._hold_forwarding(False)
        if held:
            self._close_dead_splits([n for n in dead if n not in failed])
        return report

    def _hold_forwarding(self, held: bool) -> bool:
        """Hold (or let go on) the forward logs of every live node (cluster.forward_log); whether
        any job forwards through logs."""
        c = self.cluster
        if not any(c.jobs.forward_logs.values()):
            return False
        for node in list(c.nodes):
            with contextlib.suppress(Exception):  # dead too: the supervisor's next round restores it
                c.connection.action(node, "forwarding", {"hold": held})
        return True

    def _close_dead_splits(self, dead: list[str]) -> None:
        """With event time, a dead node's forward splits end once what its key groups produced
        after its checkpoint came again from their new owners: a checkpoint of every node now
        commits it (their restore processed first), and their forwarders send it."""
        c = self.cluster
        timed = {job: [ch for ch, t in logs.items() if t] for job, logs in c.jobs.forward_logs.items()}
        if not dead or not any(timed.values()):
            return
        self._checkpoint_all()
        for node in list(c.nodes):
            c.connection.action(node, "forwarded", {})
        for job, channels_ in timed.items():
            for channel in channels_:
                for node in dead:
                    close_split(c.reach(job), job, channel, node)

    def _send_dead_logs(self, dead: list[str]) -> int:
        """Send what the forward logs of dead nodes committed (cut back to their latest checkpoint),
        now that their key groups are restored: the receivers drop what they took before."""
        c = self.cluster
        entries = c.files.jobs()
        sent = 0
        for job, channels_ in c.jobs.forward_logs.items():
            entry = entries.get(job, {})
            for node in dead:
                for channel in channels_:
                    directory = node_log_dir(entry, job, node, channel)
                    start = entry.get("starts", {}).get(node, {}).get(channel, 0)
                    sent += send_dead_log(c.reach(job), job, channel, node, directory, start)
        return sent

    # ---- a driver that died, resumed ------------------------------------------------------------
    def resume(self, stored: RoutingTable, jobs: dict[str, bytes]) -> None:
        """A driver restarted on a cluster whose previous driver died (its nodes died with it):
        as many new nodes as the stored table has, the checkpointed jobs again, and every key group
        restored from the checkpoint directory as if every old node had died, a handoff that was
        under way included (``handoff.json``)."""
        c = self.cluster
        c.table = stored
        old = stored.nodes
        entries = c.files.jobs()
        c.membership.number_after(n for e in entries.values() for n in e.get("nodes", []))
        fresh = [c.membership.new_id() for _ in old]
        for node_id in fresh:
            c.start_node(node_id, {})
            c.connection.action(
                node_id,
                "own",
                {"version": stored.version, "key_groups": [], "max_parallelism": c.max_parallelism},
            )
        try:
            previous = list(c.connection.members().nodes)
        except LookupError:
            previous = list(old)
        for name, blob in jobs.items():
            c.jobs.resumed(name, blob, entries[name])
            if entries[name].get("broadcast"):
                starts = self._resume_broadcast(name, blob, previous, fresh)
            else:
                starts = {node_id: c.jobs.start(node_id, blob) for node_id in fresh}
            c.jobs.ran_on(name, starts)
        c.membership.publish(fresh)  # broadcast rows come now: after the old ones replayed
        try:
            self._restore_all(stored, old, fresh)
        except BaseException:  # nothing ran on the fresh nodes: readers must not look for them
            c.jobs.unrecord(fresh)
            raise

    def _restore_all(self, stored: RoutingTable, old: list[str], fresh: list[str]) -> None:
        """Every key group of the stored table (and of a handoff under way) onto the fresh nodes."""
        c = self.cluster
        pending = None
        step = c.files.read(HANDOFF)
        if step is not None and step["version"] == stored.version:
            pending = {int(kg): src for kg, (src, _dst) in step["moves"].items()}
            for kg, (src, dst) in step["moves"].items():
                name = f"h{step['version']}-{src}-{dst}"  # its release checkpoint (node._act_release)
                base = str(recovery.node_dir(c.checkpoint_dir, src) / "checkpoints" / name)
                if recovery.adopted_from(c.checkpoint_dir, dst, int(kg), base):
                    del pending[int(kg)]  # the new owner had it: it restores from there
        # a node being removed owns nothing in the stored table after its last step began, but the
        # key groups of that step it had not handed over are still its own: it is dead too
        dead = list(dict.fromkeys([*old, *(pending or {}).values()]))
        self.recover(dead, None, pending, survivors=fresh)
        (c.directory / HANDOFF).unlink(missing_ok=True)
        self.collect_garbage()
        c.started = True
        self.supervise()

    def _resume_broadcast(
        self, name: str, blob: bytes, previous: list[str], fresh: list[str]
    ) -> dict[str, dict[str, int]]:
        """Start a checkpointed job with broadcast state on a restarted driver's new nodes from an
        old member's latest broadcast point, and replay that member's broadcast journal since (see
        cluster.broadcast_restore): before the key groups are restored, so their replayed rows see
        the broadcast state the old nodes had at their end."""
        c = self.cluster
        point = broadcast_restore.restore_point(c.checkpoint_dir, previous, name)
        body = {"spec": blob, "states": point["states"], "marks": point["marks"], "members": 0}
        replay = {"job": name, "node": point["node"], "journal": point["journal"]}
        starts = {}
        for node_id in fresh:
            starts[node_id] = c.connection.action(node_id, "join", pickle.dumps(body))
            c.connection.action(node_id, "broadcast_replay", replay)
        return starts
