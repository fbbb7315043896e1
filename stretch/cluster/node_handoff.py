"""A node's side of a key-group handoff: giving key groups away at the readers' frontier of its
jobs' keyed gates, with the rows of theirs it took and had not processed, and adopting key groups
that come with such rows.

Giving away (``release``): the node stops taking rows of the key groups (writers are refused and
send them to the new owner, which refuses them until it adopts). Each keyed operator releases them
at its frontier (``Coordinator.release``): within milliseconds no instance processes them, their
state is final, and the rows of theirs queued behind the frontier come back, however long the
backlog. The node copies their state out, forgets it, and parks both for the new owner: the state
(``snapshot:``), and the queued rows (``forward:``, gate batches in gate order).

Adopting (``adopt``): the new owner loaded the state (a ``load`` put) and was given the queued rows
(a ``forward`` put); under its lock it processes the key groups again, appends the forwarded rows
to their operators' gates, and only then takes writers' rows of them: the forwarded rows run before
anything newer, per key in the order the old owner took them.

Pre-copy (``precopy``, for jobs without checkpoints that do not forward), as a live migration of a
virtual machine copies its memory before it stops it: the node stops the key groups at the
frontier and copies their state and queued rows out *while it still takes writers' rows of them*
(they wait, unprocessed, behind the frontier); the new owner loads both and works off those rows
(``preadopt``). The release then copies only the rows taken meanwhile: writers are refused for that
short rest, not for the whole backlog.

A pre-copied move the driver gives up before its routing version is saved is undone
(``unpreadopt``, ``unprecopy``): the new owner stops the key groups it pre-adopted and gives back
the state they reached with the rows it had not processed, or drops what it loaded if it processed
none; the old owner takes them back, those rows (else its own copy of the state and of the rows it
pre-copied) and the rows it held since going in first, and lets go of its gates.

With checkpointed jobs the old owner first takes a release checkpoint, at the frontier too
(``NodeCheckpoints.release_checkpoint``): it keeps the forwarded rows with the state, and it is
where the key groups restore from until the new owner's adoption is in its manifest (which names
it as the base): the forwarded rows are not journaled again, so each restores exactly once, from
that checkpoint, whichever node dies at whichever point.

Where rows of the key groups may still be on their way to a keyed gate (a source task feeds it: a
key selector function, a broadcast operator's keyed input), the operator works them off instead
(a barrier through its gate, placed at its tail), as does one whose input ended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from stretch.cluster import recovery
from stretch.cluster.node_job import NodeJob, at_tail, barrier
from stretch.state.keyed_table import KeyedTable
from stretch.state.snapshot import copy_key_groups, describe_arena, release_key_groups


@dataclass
class Precopy:
    """What a pre-copy took out of the node, kept until its release: if the move is abandoned
    (``unprecopy``), the node takes the key groups back from this copy of their state and rows."""

    key_groups: list[int]
    held: set[tuple[str, str]] = field(default_factory=set)  # (job, operator)s whose release it holds
    state: dict[tuple[str, str], tuple[dict, list]] = field(default_factory=dict)  # description, batches
    rows: dict[tuple[str, str], list[pa.RecordBatch]] = field(default_factory=dict)  # queued, in order
    tickets: list[str] = field(default_factory=list)  # parked for the new owner, perhaps never fetched


class NodeHandoff:
    """Key groups leaving and joining ``node`` (a NodeServer)."""

    def __init__(self, node):
        self.node = node
        self.outgoing: dict[str, pa.Table] = {}  # ticket -> forwarded rows awaiting their do_get
        # pre-copy id -> what it took, and whose release it holds until the release takes the rest
        self.precopies: dict[str, Precopy] = {}
        self.precopying: np.ndarray | None = None  # bool per key group: stage rows of theirs refused
        # move -> {(job, operator): forwarded rows}, awaiting the adoption of that move
        self.incoming: dict[str, dict[tuple[str, str], list[pa.RecordBatch]]] = {}
        # pre-copied move -> the (job, operator)s that processed its rows here: undone by ``unpreadopt``
        self.preadopted: dict[str, set[tuple[str, str]]] = {}

    # ---- giving key groups away ------------------------------------------------------------------
    def precopy(self, body: bytes) -> dict:
        """Copy key groups ``key_groups`` out ahead of their ``release``: stop them at each keyed
        operator's frontier while the node still takes writers' rows of them, park their state
        (``snapshot:``) and the rows queued behind the frontier (``forward:``), and forget the
        state here. Returns the pre-copy's ``id`` for the release, or ``{"id": None}`` when the
        release must do it all (a job with checkpoints, or that forwards: their moves keep one cut).

        Stage transaction rows of these key groups are refused from now on: a transaction's results
        come whole from one owner."""
        node = self.node
        msg = json.loads(body)
        kgs = sorted({int(kg) for kg in msg["key_groups"]})
        with node.lock:
            jobs = node.running()
            if at_tail() or node.checkpoints.durable() or any(job.forwards for job in jobs):
                return {"id": None}
            if self.precopying is None:
                self.precopying = np.zeros(node.max_parallelism, dtype=bool)
            self.precopying[kgs] = True
            for job in jobs:
                job.stage.settle(kgs)
        pre, parts, forward = node.ticket(), [], []
        record = self.precopies[pre] = Precopy(kgs)
        moving = np.asarray(kgs, dtype=np.int64)
        try:
            for job in jobs:
                for operator in job.keyed:
                    rows = job.release(operator, kgs, hold=True)
                    if rows is None:  # the release stops it (after a barrier)
                        continue
                    key = (job.name, operator)
                    record.held.add(key)
                    record.rows[key] = rows
                    KeyedTable(job.arena(operator)).set_away(kgs, True)
                    part = self._park_state(job, operator, moving)
                    record.state[key] = (part["description"], self.node.parked[part["ticket"]])
                    parked = self._park_rows(job, operator, rows)
                    record.tickets += [part["ticket"], *(p["ticket"] for p in parked)]
                    parts.append(part)
                    forward.extend(parked)
        except BaseException:  # what it held so far is processed here again
            self._take_back(self.precopies.pop(pre), {}, set())
            raise
        return {"id": pre, "parts": parts, "forward": forward}

    def unprecopy(self, body: bytes) -> dict:
        """Take back key groups ``key_groups`` whose pre-copy (``id``; else the one of these key
        groups) the driver abandoned before it made the move: they are processed here again, from
        the state and with the rows the new owner gave back (its ``unpreadopt``, forwarded here for
        move ``move``) for the operators it ``returned``, else from this node's own copy; then the
        rows taken since the pre-copy, before any newer. Lets go of the gates it pinned, and takes
        stage rows of theirs again."""
        msg = json.loads(body)
        pre = msg.get("id")
        if pre is None:
            wanted = {int(kg) for kg in msg["key_groups"]}
            pre = next((p for p, r in self.precopies.items() if wanted & set(r.key_groups)), None)
        record = self.precopies.pop(pre, None) if pre is not None else None
        given = self.incoming.pop(msg.get("move", ""), {})
        if record is None:
            return {"ok": True, "taken_back": False}
        returned = {(job, operator) for job, operator in msg.get("returned", ())}
        rows = self._take_back(record, given, returned)
        return {"ok": True, "taken_back": True, "rows": rows}

    def _take_back(self, record: Precopy, given: dict, returned: set) -> int:
        """Process the key groups of a pre-copy here again (see ``unprecopy``); the rows appended.
        Under the node's lock: no writer's row of theirs goes in between the ones appended here."""
        node, kgs, appended = self.node, record.key_groups, 0
        moving = np.asarray(kgs, dtype=np.int64)
        for ticket in record.tickets:  # what the new owner never fetched
            node.parked.pop(ticket, None)
            self.outgoing.pop(ticket, None)
        with node.lock:
            for job in node.running():
                for operator in job.keyed:
                    key = (job.name, operator)
                    if key not in record.held:
                        continue
                    rest = job.release_rest(operator, kgs)  # lets go of the gate
                    table = KeyedTable(job.arena(operator))
                    if key in returned:  # loaded from the new owner, with the rows it had left
                        first = given.get(key, [])
                    else:
                        if key in record.state:  # copied out (else still here)
                            release_key_groups(table, moving)  # whatever of theirs was loaded since
                            description, batches = record.state[key]
                            node.load_into(job, operator, description, batches)
                        first = record.rows[key]
                    table.set_away(kgs, False)
                    job.take_back(kgs, [operator])
                    appended += job.append(operator, [*first, *rest])
            if self.precopying is not None:
                self.precopying[kgs] = False
        return appended

    def release(self, body: bytes) -> dict:
        """Give up key groups ``key_groups`` to node ``to``: refuse their rows from now on, stop
        them at each keyed operator's frontier, copy their state out for a ``do_get``
        (``snapshot:<ticket>``) with the rows of theirs queued behind it (``forward:<ticket>``),
        and forget it here. After a ``precopy`` (its ``id``: ``precopy``), only what it left.

        With checkpointed jobs the node first takes a release checkpoint of everything it held,
        these key groups included (its outputs commit there): from that moment until the new owner
        adopts them, it is where they restore from, whichever of the two nodes dies. It is named
        by version, node and new owner (``h<version>-<node>-<to>``): a node giving key groups to two
        nodes in one step must not overwrite the first release's checkpoint, which the first new
        owner restores from."""
        node = self.node
        msg = json.loads(body)
        kgs = sorted({int(kg) for kg in msg["key_groups"]})
        held = self.precopies.pop(msg["precopy"]).held if msg.get("precopy") else set()
        with node.lock:  # no write is under way: each either came before this or will be refused
            owned = np.flatnonzero(node.owned).tolist()
            node.owned[kgs] = False
            if self.precopying is not None:
                self.precopying[kgs] = False
            node.version = msg["version"]
            jobs = node.running()
            durable = node.checkpoints.durable()
            for job in jobs:  # a stage transaction's rows are not cut: its results come whole
                job.stage.settle(None if job in durable else kgs)
            for job in jobs:
                if job not in durable:
                    linger(node, job, kgs)
            base, forwarded = None, {}
            if durable:  # writes wait meanwhile: the checkpoint, its journal offsets and marks agree
                for job in durable:  # timers leave them alone from here
                    _set_away(job, kgs, True)
                name = "-".join(filter(None, [f"h{msg['version']}", node.node_id, msg.get("to")]))
                report, forwarded = node.checkpoints.release_checkpoint(name, owned, kgs)
                base = report["path"]
        parts, marks, stage, forward = [], {}, [], []
        moving = np.asarray(kgs, dtype=np.int64)
        for job in jobs:
            mine = {op for name, op in held if name == job.name}
            try:
                queued = forwarded.get(job.name, {}) if job in durable else self._stop(job, kgs, mine)
            finally:
                unlinger(node, job)
            for operator in job.keyed:
                if operator not in mine:
                    parts.append(self._park_state(job, operator, moving))
                forward.extend(self._park_rows(job, operator, queued.get(operator)))
            marks[job.name] = job.marks_of(kgs)
            records = job.stage.records(kgs)  # their parts completed: settled before the release
            if records.num_rows:
                ticket = node.ticket()
                node.parked_stage[ticket] = records
                stage.append({"job": job.name, "ticket": ticket})
            job.stage.forget(node.owned)
        return {"parts": parts, "marks": marks, "base": base, "stage": stage, "forward": forward}

    def _park_state(self, job: NodeJob, operator: str, moving: np.ndarray) -> dict:
        """Copy the state of key groups ``moving`` of ``operator`` out for a ``do_get`` and forget
        it here; the part the new owner fetches."""
        table = KeyedTable(job.arena(operator))
        batches = copy_key_groups(table, moving)
        description = describe_arena(table.arena)
        release_key_groups(table, moving)
        ticket = self.node.ticket()
        self.node.parked[ticket] = batches
        part = {"job": job.name, "operator": operator, "ticket": ticket, "description": description}
        return {**part, "bytes": sum(b.nbytes for b in batches)}

    def _park_rows(self, job: NodeJob, operator: str, rows) -> list[dict]:
        """Queued rows of ``operator`` for a ``do_get`` (none: nothing to fetch)."""
        if not rows:
            return []
        ticket = self.node.ticket()
        self.outgoing[ticket] = pa.Table.from_batches(rows)
        count = sum(b.num_rows for b in rows)
        return [{"job": job.name, "operator": operator, "ticket": ticket, "rows": count}]

    def _stop(self, job: NodeJob, kgs: list[int], held=()) -> dict[str, list[pa.RecordBatch]]:
        """Stop ``kgs`` in each keyed operator of a job without checkpoints: at its frontier, the
        rows queued behind it returned; else (``NodeJob.release`` says when) after a barrier.
        Operators whose release a pre-copy ``held`` return the rows queued since.

        A job that re-keys stops them operator after operator, inputs first: once the operator
        forwarding into a channel stopped them here, the channel's moving key groups stop
        lingering (``linger``), and only then does the operator it feeds stop them, so every row
        it took of them is queued before its frontier."""
        queued, behind = {}, []
        for operator in job.keyed:
            if operator in held:
                batches = job.release_rest(operator, kgs)
            else:
                batches = None if at_tail() else job.release(operator, kgs)
            if batches is None:
                behind.append(operator)
                if job.forwards:
                    barrier(job, [operator])
            else:
                queued[operator] = batches
            unlinger(self.node, job, operator)
        _set_away(job, kgs, True)  # timers and windows leave them alone once stopped
        if behind and not job.forwards:
            barrier(job, behind)
        return queued

    def forwarded(self, ticket: str) -> pa.Table | None:
        """The rows a release parked under ``ticket`` (once: the new owner takes them)."""
        return self.outgoing.pop(ticket, None)

    # ---- adopting key groups ----------------------------------------------------------------------
    def take_forwarded(self, cmd: dict, batches: list[pa.RecordBatch]) -> None:
        """Rows the old owner of key groups had queued, for the adoption of move ``move``."""
        rows = self.incoming.setdefault(cmd["move"], {}).setdefault((cmd["job"], cmd["operator"]), [])
        rows.extend(batches)

    def preadopt(self, body: bytes) -> dict:
        """Process key groups ``key_groups`` of the operators a pre-copy moved (``operators``: job ->
        names; their state is loaded), and the rows forwarded with it (move ``move``), while writers'
        rows of theirs are still refused here (until ``adopt``, whose rows follow these)."""
        node = self.node
        msg = json.loads(body)
        kgs = sorted({int(kg) for kg in msg["key_groups"]})
        forwarded = self.incoming.pop(msg["move"], {})
        taken = 0
        done = self.preadopted.setdefault(msg["move"], set())
        with node.lock:
            for job in node.running():
                for operator in msg["operators"].get(job.name, []):
                    KeyedTable(job.arena(operator)).set_away(kgs, False)
                    job.take_back(kgs, [operator])
                    taken += job.append(operator, forwarded.get((job.name, operator), []))
                    done.add((job.name, operator))
        return {"ok": True, "rows_forwarded": taken}

    def unpreadopt(self, body: bytes) -> dict:
        """Undo the pre-copy of key groups ``key_groups`` (move ``move``, operators ``operators``:
        job -> names) that the driver abandoned: their rows were never taken here from writers.
        Operators that processed its rows (``preadopt``) stop the key groups at their frontier and
        park the state they reached with the rows they had not processed, for the old owner
        (``returned``: it goes on from there, and nothing they processed is processed twice); the
        others drop the state loaded here and the rows forwarded."""
        node = self.node
        msg = json.loads(body)
        kgs = sorted({int(kg) for kg in msg["key_groups"]})
        moving = np.asarray(kgs, dtype=np.int64)
        self.incoming.pop(msg["move"], None)
        done = self.preadopted.pop(msg["move"], set())
        parts, forward, returned = [], [], []
        for job in node.running():
            for operator in msg["operators"].get(job.name, []):
                table = KeyedTable(job.arena(operator))
                if (job.name, operator) not in done:
                    table.set_away(kgs, True)
                    release_key_groups(table, moving)
                    continue
                rows = None if at_tail() else job.release(operator, kgs)
                if rows is None:  # the release cannot stop them there: processed to the gate's tail
                    barrier(job, [operator])
                table.set_away(kgs, True)
                parts.append(self._park_state(job, operator, moving))
                forward.extend(self._park_rows(job, operator, rows))
                returned.append([job.name, operator])
        return {"parts": parts, "forward": forward, "returned": returned}

    def adopt(self, body: bytes) -> dict:
        """Own key groups whose state was loaded: the rows forwarded with them go into the job
        first, then writers' rows of them are taken. With checkpointed jobs, the manifest says
        first where they restore from (the old owner's release checkpoint, which keeps the
        forwarded rows too, and this node's journal from here on)."""
        node = self.node
        msg = json.loads(body)
        kgs = sorted({int(kg) for kg in msg["key_groups"]})
        forwarded = self.incoming.pop(msg.get("move", ""), {})
        self.preadopted.pop(msg.get("precopy", ""), None)  # the move is made: nothing to undo
        with node.lock:
            for job_name, entries in msg.get("marks", {}).items():
                job = node.job(job_name)
                for channel, query, by_kg in entries:
                    mark = job.mark(channel, query)
                    for kg, batch in by_kg.items():
                        mark[int(kg)] = max(mark[int(kg)], batch)
            durable = node.checkpoints.durable()
            if durable and msg.get("base"):
                manifest = recovery.load_manifest(node.checkpoint_dir, node.node_id)
                journal = {job.name: job.journal_offsets() for job in durable}
                entry = {"key_groups": kgs, "base": msg["base"], "journal": journal}
                manifest["adopted"].append(entry)
                recovery.save_manifest(node.checkpoint_dir, node.node_id, manifest)
            taken = 0
            for job in node.running():
                _set_away(job, kgs, False)  # loaded whole: the instances may fire their timers
                job.take_back(kgs)  # if this node gave them away once: processed here again
                for operator in job.keyed:
                    taken += job.append(operator, forwarded.get((job.name, operator), []))
            node.owned[kgs] = True
            node.version = msg["version"]
            for job in node.running():  # spares it adopted are replaced, for its next release
                job.align(node.owned)
        return {"ok": True, "rows_forwarded": taken}


def linger(node, job: NodeJob, kgs) -> None:
    """Let each forward channel of ``job`` (cluster.rekey_plans) still take rows of ``kgs``, which
    leave the node, until the operator forwarding into it stopped them here (``unlinger``).

    Its instances may be sending into them, here or to another node giving key groups away at
    once; refused, they would wait for the new owner, which adopts only once this release (which
    waits for them to pass its frontier) is done."""
    for channel in job.forwards:
        moving = np.zeros(job.max_parallelism, dtype=bool)
        moving[list(kgs)] = True
        node.lingering[(job.name, channel)] = moving


def unlinger(node, job: NodeJob, operator: str | None = None) -> None:
    """The forward channels of ``job`` fed by ``operator`` (every one: None) take only rows of
    key groups the node owns again."""
    with node.lock:
        for channel, source in job.forwards.items():
            if operator is None or source == operator:
                node.lingering.pop((job.name, channel), None)


def _set_away(job: NodeJob, kgs, away: bool) -> None:
    for operator in job.keyed:
        KeyedTable(job.arena(operator)).set_away(kgs, away)
