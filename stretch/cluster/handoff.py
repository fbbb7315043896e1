"""Key groups moving between nodes with their state, in small steps (Megaphone's fluid migration).

A node change moves the fewest key groups (``routing.plan_add_node``/``plan_remove_node``), in
steps of a few key groups (at most the cluster's ``step``, and about ``STEP_BYTES`` of state), each
step one routing version: the old owner stops taking the step's key groups and stops them at the
readers' frontier of its keyed gates (not behind its backlog), copies their state out (Arrow IPC
key-group snapshot) with the rows of theirs it took and had not processed, and forgets them; the
new owner fetches the state and the rows straight from the old owner (``fetch``: they cross once,
node to node), loads the state into its live arena, appends the forwarded rows, and only then
takes writers' rows of them (cluster.node_handoff). Writers that meet a refusal reload the table and
send again, so a key waits at most for its own step, however much the old owner had queued. A job
that forwards through logs (cluster.forward_log) keeps per key order across the move: the new
owner holds its forward logs until the old owner sent what its release checkpoint committed.

With a checkpoint directory, a node that dies in the middle of a move is restored on the others
(cluster.failover), and the node change stops there (``NodeLost``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass

from stretch.cluster.directory import HANDOFF
from stretch.cluster.recovery import NodeLost
from stretch.cluster.routing import steps

STEP_BYTES = 4 << 20
"""About the state a handoff step moves: its key groups wait while it is copied, so a step of a
large state holds fewer key groups (at least one; a finer max parallelism makes finer steps)."""


@dataclass(frozen=True)
class HandoffReport:
    """What a node change did: ``max_stall_ms`` is the longest any key group refused rows (from
    its release by the old owner until the new owner took it)."""

    elapsed_ms: float
    key_groups_moved: int
    bytes_moved: int
    max_stall_ms: float
    version: int = 0
    steps: int = 0
    step_ms: tuple[float, ...] = ()  # each (source, target) move of each step, release to adoption
    rows_forwarded: int = 0  # rows the old owners had queued, which the new owners processed


class Handoff:
    """Moves key groups of ``cluster`` (a StretchCluster) between its nodes."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.in_flight: dict | None = None  # the move under way: a node that dies in it is restored
        self.progress: dict | None = None  # the node change under way: key groups to move, moved
        self.reports: list[dict] = []  # every completed node change's HandoffReport, in order

    def describe(self) -> dict:
        """What the UI shows: the change under way (and its current move), and those done."""
        move = self.in_flight
        return {
            "progress": self.progress,
            "in_flight": None if move is None else {k: move[k] for k in ("src", "dst", "key_groups")},
            "reports": self.reports[-50:],
        }

    def run(self, moves: dict[int, str]) -> HandoffReport:
        """Make ``moves`` (key group -> new owner), step by step."""
        c = self.cluster
        t0 = time.monotonic()
        parts = steps(moves, c.step, self._state_bytes_per_key_group(moves), STEP_BYTES)
        self.progress = {"key_groups": len(moves), "moved": 0, "started": time.time()}
        try:
            report = self._run(parts, t0)
        finally:
            self.progress = None
        self.reports.append({**asdict(report), "finished_at": time.time()})
        return report

    def _run(self, parts: list[dict[int, str]], t0: float) -> HandoffReport:
        c = self.cluster
        moved = size = forwarded = 0
        stalls: list[float] = []
        for step in parts:
            c.hook("step", "", "")
            old = c.table
            c.table = old.moved(step)
            if c.checkpoint_dir is not None:  # a restarted driver finds where each key group was
                moving = {kg: [old.owners[kg], dst] for kg, dst in step.items()}
                c.files.write(HANDOFF, {"version": c.table.version, "moves": moving})
            c.store.save(c.table)  # writers refused from now on find the new owners here
            pairs: dict[tuple[str, str], list[int]] = {}
            for kg, dst in step.items():
                pairs.setdefault((old.owners[kg], dst), []).append(kg)
            for index, ((src, dst), kgs) in enumerate(pairs.items()):
                s0 = time.monotonic()
                try:
                    shipped, rows = self._move(src, dst, kgs, c.table.version)
                    size += shipped
                    forwarded += rows
                except Exception as e:
                    dead = c.failover.dead_among(src, dst)
                    if not dead or c.checkpoint_dir is None:
                        raise
                    in_flight, self.in_flight = self.in_flight, None
                    started = {kg for done in list(pairs.values())[: index + 1] for kg in done}
                    pending = {kg: old.owners[kg] for kg in step if kg not in started}
                    recovered = c.failover.recover(dead, in_flight, pending)
                    (c.directory / HANDOFF).unlink(missing_ok=True)
                    c.failover.collect_garbage()
                    raise NodeLost(
                        f"node {' and '.join(dead)} died while key groups moved from {src} to {dst}: "
                        f"{recovered['key_groups']} key groups restored from the checkpoint directory "
                        f"(routing version {recovered['version']}); the node change stopped there"
                    ) from e
                stalls.append((time.monotonic() - s0) * 1000)
                moved += len(kgs)
                self.progress["moved"] = moved
        (c.directory / HANDOFF).unlink(missing_ok=True)
        c.failover.collect_garbage()  # checkpoints the release checkpoints superseded
        return HandoffReport(
            elapsed_ms=(time.monotonic() - t0) * 1000,
            key_groups_moved=moved,
            bytes_moved=size,
            max_stall_ms=max(stalls, default=0.0),
            version=c.table.version,
            steps=len(parts),
            step_ms=tuple(stalls),
            rows_forwarded=forwarded,
        )

    def _state_bytes_per_key_group(self, moves: dict[int, str]) -> dict[int, float]:
        """Each moving key group's share of its node's state (the nodes' jobs' state bytes over
        the key groups the node owns): what cuts a node change into steps of similar size."""
        c = self.cluster
        shares: dict[int, float] = {}
        for node in {c.table.owners[kg] for kg in moves}:
            status = c.connection.action(node, "status")
            total = sum(
                op["state_bytes"] for job in status["jobs"].values() for op in job.get("operators", ())
            )
            owned = status["key_groups"]
            for kg in owned:
                shares[kg] = total / len(owned)
        return shares

    def _move(self, src: str, dst: str, kgs: list[int], version: int) -> tuple[int, int]:
        """Move key groups ``kgs`` from node ``src`` to ``dst``; returns the state bytes shipped and
        the rows forwarded (those ``src`` had queued: ``dst`` processes them before any newer)."""
        c = self.cluster
        connection = c.connection
        self.in_flight = {"src": src, "dst": dst, "key_groups": kgs, "base": None}
        c.hook("release", src, dst)
        released = connection.action(src, "release", {"version": version, "key_groups": kgs, "to": dst})
        self.in_flight["base"] = released.get("base")
        c.hook("load", src, dst)
        size = 0
        origin = connection.locations()[src]
        for part in released["parts"]:
            command = {
                "op": "load",
                "job": part["job"],
                "operator": part["operator"],
                "description": part["description"],
            }
            fetch = {"from": origin, "ticket": f"snapshot:{part['ticket']}", "put": command}
            size += connection.action(dst, "fetch", fetch)["bytes"]
        for part in released.get("stage", ()):  # the stage transactions' results that cover them
            command = {"op": "stage_parts", "job": part["job"]}
            connection.action(
                dst, "fetch", {"from": origin, "ticket": f"stage:{part['ticket']}", "put": command}
            )
        c.hook("forward", src, dst)
        move = f"{version}:{src}"  # the adoption takes the rows forwarded for this move
        for part in released.get("forward", ()):  # rows src took and had not processed
            command = {"op": "forward", "job": part["job"], "operator": part["operator"], "move": move}
            connection.action(
                dst, "fetch", {"from": origin, "ticket": f"forward:{part['ticket']}", "put": command}
            )
        c.hook("adopt", src, dst)
        body = {
            "version": version,
            "key_groups": kgs,
            "marks": released["marks"],
            "base": released.get("base"),
            "move": move,
        }
        logged = any(c.jobs.forward_logs.values())
        if logged:  # it sends nothing of theirs before src sent what it committed of them
            connection.action(dst, "forwarding", {"hold": True})
        try:
            rows = connection.action(dst, "adopt", body).get("rows_forwarded", 0)
            self.in_flight = None
            if logged:
                c.hook("forwarded", src, dst)
                connection.action(src, "forwarded", {})
        finally:
            if logged:
                with contextlib.suppress(Exception):  # dst died: its restore lets go of every hold
                    connection.action(dst, "forwarding", {"hold": False})
        c.hook("adopted", src, dst)
        return size, rows
