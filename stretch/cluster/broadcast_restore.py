"""Where a restarted driver's new nodes get a checkpointed job's broadcast state from.

A node that dies needs none of this: the nodes restoring its key groups hold the broadcast state
already. But a driver that dies takes every node with it, so the checkpoint directory keeps, per
node and job, what its broadcast state was at a point and every broadcast row it took since:

- ``nodes/<node>/checkpoints/<name>/broadcast.pickle``: each job's broadcast states, its broadcast
  (query, batch) marks and its broadcast journals' offsets, at that checkpoint;
- ``nodes/<node>/broadcast/<job>.start``: the states and marks a joining node's job started from
  (a node that started with the cluster starts from nothing);
- ``nodes/<node>/journal/<job>/<channel>/``: the broadcast rows it took, as for keyed channels
  (but replayed whole, not by key group).

A restarted driver starts the job on every new node from one old member's latest such point and
replays that member's broadcast journal from there: every member took every broadcast row, so any
one of them will do (the first of the membership with a directory).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from stretch.cluster import recovery
from stretch.runtime.state_dir import job_dir_name, make_private_dir, write_private

CHECKPOINT_FILE = "broadcast.pickle"


def save_checkpoint(path: Path, jobs: dict[str, dict]) -> None:
    """Next to a checkpoint's key groups: ``jobs`` {job: {states, marks, journal}}, synced."""
    _save(path / CHECKPOINT_FILE, jobs)


def save_start(checkpoint_dir, node: str, job: str, states: dict[str, bytes], marks: list) -> None:
    """The broadcast state a joining node's job starts from (before it takes any row)."""
    directory = recovery.node_dir(checkpoint_dir, node) / "broadcast"
    make_private_dir(directory)
    _save(directory / f"{job_dir_name(job)}.start", {"states": states, "marks": marks})


def restore_point(checkpoint_dir, nodes: list[str], job: str) -> dict:
    """{node, states, marks, journal} to start ``job`` from: the first of ``nodes`` (the old
    membership) with a directory, at its latest checkpoint holding the job, else at its start."""
    for node in nodes:
        if not recovery.node_dir(checkpoint_dir, node).is_dir():
            continue
        checkpoint = recovery.load_manifest(checkpoint_dir, node).get("checkpoint")
        saved = _load(Path(checkpoint) / CHECKPOINT_FILE) if checkpoint else None
        if saved is not None and job in saved:
            return {"node": node, **saved[job]}
        start = _load(recovery.node_dir(checkpoint_dir, node) / "broadcast" / f"{job_dir_name(job)}.start")
        start = start if start is not None else {"states": {}, "marks": []}
        return {"node": node, **start, "journal": {}}  # its journals from their first row
    raise LookupError(f"no node of {nodes} left anything of job {job!r} in {checkpoint_dir}")


def _save(path: Path, value) -> None:
    write_private(path, pickle.dumps(value))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load(path: Path):
    try:
        return pickle.loads(path.read_bytes())
    except FileNotFoundError:
        return None
