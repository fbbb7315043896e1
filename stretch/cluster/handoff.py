"""Key groups moving between nodes with their state, in small steps (Megaphone's fluid migration).

A node change moves the fewest key groups (``routing.plan_add_node``/``plan_remove_node``), in
steps of a few key groups (at most the cluster's ``step``, and about ``STEP_BYTES`` of state), each
step one routing version: the old owner stops taking the step's key groups and stops them at the
readers' frontier of its keyed gates (not behind its backlog), copies their state out (Arrow IPC
key-group snapshot) with the rows of theirs it took and had not processed, and forgets them; the
new owner fetches the state and the rows straight from the old owner (``fetch``: they cross once,
node to node), loads the state into its live arena, appends the forwarded rows, and only then
takes writers' rows of them (cluster.node_handoff). Writers that meet a refusal reload the table and
send again, so a key waits at most for its own step, however much the old owner had queued.

Without checkpoints, and unless a job forwards, each move is pre-copied first, as a live migration
of a virtual machine copies memory before it stops the machine: the old owner copies the state
and the queued rows out while it still takes writers' rows of the key groups, the new owner loads
them and works the rows off, and the release that follows ships only the rows taken meanwhile, so
a writer is refused for that rest, not for the backlog's copy (each move is then its own routing
version, as a writer's refusal must not come before the new owner is near ready). A move that
fails after its pre-copy and before its routing version is saved is abandoned (``_abandon``): the
old owner takes its key groups back, from the state the new owner reached, and lets go of its
gates; once the version is saved the move goes forward. A job
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
    rows_precopied: int = 0  # of those, the rows that went ahead with a pre-copy
    # each move's pre-copy, before its release: its key groups' rows were taken, and waited
    precopy_ms: tuple[float, ...] = ()


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
        moved = size = forwarded = ahead = 0
        stalls: list[float] = []
        precopies: list[float] = []
        precopy = c.checkpoint_dir is None and not any(c.jobs.forward_logs.values())
        for step in parts:
            c.hook("step", "", "")
            if precopy:
                for (src, dst), kgs in _pairs(step, c.table).items():
                    p0 = time.monotonic()
                    pre = self._precopy(src, dst, kgs)
                    precopies.append((time.monotonic() - p0) * 1000)
                    self._route_precopied(src, dst, kgs, pre)
                    s0 = time.monotonic()
                    shipped, rows = self._move(src, dst, kgs, c.table.version, pre)
                    stalls.append((time.monotonic() - s0) * 1000)
                    size, forwarded, moved = size + shipped, forwarded + rows, moved + len(kgs)
                    ahead += 0 if pre is None else pre["rows"]
                    self.progress["moved"] = moved
                continue
            old = self._route(step)
            pairs = _pairs(step, old)
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
            rows_precopied=ahead,
            precopy_ms=tuple(precopies),
        )

    def _route(self, step: dict[int, str]):
        """The next routing version, with ``step`` moved, saved: writers refused from now on find
        the new owners there. Returns the table before it."""
        c = self.cluster
        old = c.table
        c.table = old.moved(step)
        if c.checkpoint_dir is not None:  # a restarted driver finds where each key group was
            moving = {kg: [old.owners[kg], dst] for kg, dst in step.items()}
            c.files.write(HANDOFF, {"version": c.table.version, "moves": moving})
        c.store.save(c.table)
        return old

    def _route_precopied(self, src: str, dst: str, kgs: list[int], pre: dict | None) -> None:
        """The routing version that makes a pre-copied move real. Saving it is the point of no
        return: a failure before (the driver's, or its store's) abandons the pre-copy, after it the
        release and the adoption go forward."""
        c = self.cluster
        old = c.table
        try:
            c.hook("precopied", src, dst)
            self._route({kg: dst for kg in kgs})
        except BaseException as e:
            try:
                saved = c.store.load()
            except Exception:
                saved = None  # not readable: not saved either
            if saved is not None and saved.version > old.version:
                raise  # saved: writers may send there already, the move must be made
            c.table = old
            if pre is not None:
                self._abandon(src, dst, kgs, pre, e)
            raise

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

    def _precopy(self, src: str, dst: str, kgs: list[int]) -> dict | None:
        """Copy ``kgs`` from ``src`` to ``dst`` ahead of their release (``src`` still takes their
        rows): the state and the rows queued, loaded and appended on ``dst``, which processes them
        and refuses writers' rows of them until the adoption. None if ``src`` cannot (the release
        does it all); else its id, the state bytes and the rows it shipped."""
        connection = self.cluster.connection
        try:
            pre = connection.action(src, "precopy", {"key_groups": kgs})
        except BaseException as e:  # src may have pre-copied them all the same
            self._abandon(src, dst, kgs, {"id": None, "move": "", "operators": {}}, e)
            raise
        if pre["id"] is None:
            return None
        move = f"pre{pre['id']}:{src}"
        operators: dict[str, list[str]] = {}
        for part in pre["parts"]:
            operators.setdefault(part["job"], []).append(part["operator"])
        done = {"id": pre["id"], "move": move, "operators": operators}
        try:
            size = self._fetch_state(src, dst, pre["parts"])
            self._fetch_rows(src, dst, pre["forward"], move)
            body = {"key_groups": kgs, "move": move, "operators": operators}
            rows = connection.action(dst, "preadopt", body)["rows_forwarded"]
        except BaseException as e:
            self._abandon(src, dst, kgs, done, e)
            raise
        return {**done, "bytes": size, "rows": rows}

    def _abandon(self, src: str, dst: str, kgs: list[int], pre: dict, failure: BaseException) -> None:
        """Undo the pre-copy ``pre`` of a move that will not be made (``failure`` came before its
        routing version was saved), so that ``src`` does not pin its gates and hold the key groups
        away for good: ``dst`` gives back what it pre-adopted (the state it reached and the rows it
        had not processed, fetched straight to ``src``) or drops what it had not, and ``src`` takes
        the key groups back, those rows (else its own copy of what it pre-copied) and the rows it
        took since going in first. A ``dst`` that is gone or refuses leaves ``src`` its own copy."""
        connection = self.cluster.connection
        back, returned = f"un{pre['move']}", []
        if pre["move"]:
            try:
                body = {"key_groups": kgs, "move": pre["move"], "operators": pre["operators"]}
                given = connection.action(dst, "unpreadopt", body)
                self._fetch_state(dst, src, given["parts"])
                self._fetch_rows(dst, src, given["forward"], back)
                returned = given["returned"]
            except Exception:
                returned = []  # what src loaded of it is dropped: src goes on from its own copy
        try:
            body = {"id": pre["id"], "key_groups": kgs, "move": back, "returned": returned}
            connection.action(src, "unprecopy", body)
        except Exception as e:  # src is gone (its key groups with it) or broken: the failure says so
            note = getattr(failure, "add_note", None)  # Python 3.11+
            if note is not None:
                note(f"and {src} could not take back key groups {kgs[:8]} of the abandoned move: {e!r}")

    def _fetch_state(self, src: str, dst: str, parts: list[dict]) -> int:
        """``dst`` loads the key groups' state ``src`` parked (``parts``); the bytes."""
        connection = self.cluster.connection
        origin = connection.locations()[src]
        size = 0
        for part in parts:
            command = {
                "op": "load",
                "job": part["job"],
                "operator": part["operator"],
                "description": part["description"],
            }
            fetch = {"from": origin, "ticket": f"snapshot:{part['ticket']}", "put": command}
            size += connection.action(dst, "fetch", fetch)["bytes"]
        return size

    def _fetch_rows(self, src: str, dst: str, forward: list[dict], move: str) -> None:
        """``dst`` takes the queued rows ``src`` parked (``forward``), for ``move``'s adoption."""
        connection = self.cluster.connection
        origin = connection.locations()[src]
        for part in forward:
            command = {"op": "forward", "job": part["job"], "operator": part["operator"], "move": move}
            connection.action(
                dst, "fetch", {"from": origin, "ticket": f"forward:{part['ticket']}", "put": command}
            )

    def _move(
        self, src: str, dst: str, kgs: list[int], version: int, pre: dict | None = None
    ) -> tuple[int, int]:
        """Move key groups ``kgs`` from node ``src`` to ``dst`` (after their pre-copy ``pre``, if
        one); returns the state bytes shipped and the rows forwarded (those ``src`` had queued:
        ``dst`` processes them before any newer)."""
        c = self.cluster
        connection = c.connection
        self.in_flight = {"src": src, "dst": dst, "key_groups": kgs, "base": None}
        c.hook("release", src, dst)
        body = {"version": version, "key_groups": kgs, "to": dst}
        if pre is not None:
            body["precopy"] = pre["id"]
        released = connection.action(src, "release", body)
        self.in_flight["base"] = released.get("base")
        c.hook("load", src, dst)
        size = self._fetch_state(src, dst, released["parts"])
        origin = connection.locations()[src]
        for part in released.get("stage", ()):  # the stage transactions' results that cover them
            command = {"op": "stage_parts", "job": part["job"]}
            connection.action(
                dst, "fetch", {"from": origin, "ticket": f"stage:{part['ticket']}", "put": command}
            )
        c.hook("forward", src, dst)
        move = f"{version}:{src}"  # the adoption takes the rows forwarded for this move
        self._fetch_rows(src, dst, released.get("forward", ()), move)
        c.hook("adopt", src, dst)
        body = {
            "version": version,
            "key_groups": kgs,
            "marks": released["marks"],
            "base": released.get("base"),
            "move": move,
            "precopy": None if pre is None else pre["move"],  # made: nothing of it is undone
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
        if pre is not None:
            size, rows = size + pre["bytes"], rows + pre["rows"]
        return size, rows


def _pairs(step: dict[int, str], table) -> dict[tuple[str, str], list[int]]:
    """The moves of ``step`` (key group -> new owner), by (old owner in ``table``, new owner)."""
    pairs: dict[tuple[str, str], list[int]] = {}
    for kg, dst in step.items():
        pairs.setdefault((table.owners[kg], dst), []).append(kg)
    return pairs
