"""Which checkpoint to read, and where one keyed operator's key groups are in it.

A path names a job's checkpoints on one machine (``checkpoint_dir(job)``, or the job's directory
holding it), one checkpoint of them, or a cluster's checkpoint directory. On one machine the
latest complete checkpoint is read unless another is asked for. On a cluster each node keeps only
its latest checkpoint, and each key group is read from the checkpoint its owner's manifest says
it restores from (as the cluster restores it), so every key group is taken once. Whatever cannot
be read says so in one line; what is read in its place (an incomplete checkpoint skipped) warns.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

from stretch.state.checkpoint_layout import (
    CHECKPOINTS,
    FINISHED,
    MANIFEST,
    METADATA,
    NODES,
    RUN_START,
    operator_file,
)
from stretch.state.checkpoint_reader import OperatorCheckpoint, SnapshotPart


class CheckpointNotFound(FileNotFoundError):
    """No (complete) checkpoint where one was asked for."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "no checkpoint"


class IncompleteCheckpoint(UserWarning):
    """A checkpoint newer than the one read was never completed (its job died or stopped while
    taking it, or it is being taken): it was skipped."""


def find_operator(
    path, operator: str, checkpoint: int | None = None, job: str | None = None
) -> OperatorCheckpoint:
    """The key groups of ``operator`` in the checkpoint at ``path`` (see the module's docstring)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise CheckpointNotFound(
            f"no checkpoint at {root}: no such directory (a job run on this machine keeps its "
            "checkpoints in stretch.state.checkpoint_dir(job_name))"
        )
    if (root / NODES).is_dir():
        return _cluster(root, operator, checkpoint, job)
    if (root / METADATA).is_file():
        meta = _metadata(root)
        if "node" in meta:  # one node's checkpoint in a cluster's directory
            return _from_nodes(root, {root: None}, operator, job, {root: meta})
        if checkpoint is not None and checkpoint != meta["id"]:
            raise CheckpointNotFound(f"{root} is checkpoint {meta['id']}, not {checkpoint}")
        return _operator(root, meta, operator, job)
    if (root / CHECKPOINTS).is_dir():
        root = root / CHECKPOINTS
    if not any((root / name).exists() for name in (RUN_START, FINISHED)) and not _numbered(root):
        raise CheckpointNotFound(
            f"no checkpoint at {root}: expected a job's checkpoint directory "
            "(stretch.state.checkpoint_dir(job_name)), one checkpoint of it, or a cluster's checkpoint_dir"
        )
    return _job(root, operator, checkpoint, job)


# ---- one machine ------------------------------------------------------------------------------
def _numbered(root: Path) -> dict[int, Path]:
    return {int(p.name): p for p in root.iterdir() if p.is_dir() and p.name.isdigit()}


def _job(root: Path, operator: str, checkpoint: int | None, job: str | None) -> OperatorCheckpoint:
    numbered = _numbered(root)
    done = sorted(i for i, p in numbered.items() if (p / METADATA).is_file())
    if checkpoint is None:
        if not done:
            raise CheckpointNotFound(f"no completed checkpoint at {root}{_why_none(root, numbered)}")
        chosen = done[-1]
        for skipped in sorted(i for i in numbered if i > chosen and i not in done):
            warnings.warn(
                f"checkpoint {skipped} at {root} is incomplete (its job died or stopped while taking it, "
                f"or it is being taken): reading checkpoint {chosen}",
                IncompleteCheckpoint,
                stacklevel=4,
            )
    else:
        chosen = int(checkpoint)
        if chosen in numbered and chosen not in done:
            raise CheckpointNotFound(
                f"checkpoint {chosen} at {root} is incomplete (its job died or stopped while taking it); "
                f"completed: {_listing(done)}"
            )
        if chosen not in done:
            raise CheckpointNotFound(f"no checkpoint {chosen} at {root} (completed: {_listing(done)})")
    directory = numbered[chosen]
    return _operator(directory, _metadata(directory), operator, job)


def _why_none(root: Path, numbered: dict[int, Path]) -> str:
    if numbered:
        return f" ({_listing(sorted(numbered))} incomplete: its job died or stopped while taking them)"
    if (root / FINISHED).exists():
        return " (its job finished before completing one)"
    return " (its run died or stopped before completing one)"


def _operator(directory: Path, meta: dict, operator: str, job: str | None) -> OperatorCheckpoint:
    if job is not None and meta.get("job") not in (None, job):
        raise LookupError(f"checkpoint {meta['id']} at {directory} is of job {meta['job']!r}, not {job!r}")
    operators = meta.get("operators", {})
    if operator not in operators:
        raise LookupError(
            f"no keyed operator {operator!r} in checkpoint {meta['id']} at {directory} "
            f"(keyed operators there: {_listing(sorted(operators))})"
        )
    entry = operators[operator]
    description = {"key_mode": entry["key_mode"], "registry": entry["registry"]}
    parts = tuple(SnapshotPart(str(directory / name), description) for name in entry["files"])
    return OperatorCheckpoint(operator, meta.get("job"), int(meta["id"]), (str(directory),), parts)


# ---- a cluster ----------------------------------------------------------------------------------
def _cluster(root: Path, operator: str, checkpoint: int | None, job: str | None) -> OperatorCheckpoint:
    """Each key group from the checkpoint its owner's manifest names; where two manifests claim one
    (a dead node's, not yet collected), from the checkpoint of the later routing version."""
    claims: dict[int, Path | None] = {}
    rank: dict[int, tuple] = {}
    meta_of: dict[Path, dict] = {}
    for manifest_file in sorted((root / NODES).glob(f"*/{MANIFEST}")):
        manifest = json.loads(manifest_file.read_text())
        owned: dict[int, Path | None] = {}
        for kgs, base in [
            (manifest["key_groups"], manifest["checkpoint"]),
            *((e["key_groups"], e["base"]) for e in manifest["adopted"]),  # later ones win
        ]:
            for kg in kgs:
                owned[int(kg)] = _by_name(root, base)
        for kg, base in owned.items():
            if base is not None and base not in meta_of:
                meta_of[base] = _metadata(base) if (base / METADATA).is_file() else {}
            key = (meta_of[base].get("version", -1), _number(base) or -1) if base else (-2, -1)
            if kg not in claims or key > rank[kg]:
                claims[kg], rank[kg] = base, key
    if not claims:
        raise CheckpointNotFound(f"no completed checkpoint at {root}: no node has saved a manifest there")
    bases = {b for b in claims.values() if b is not None}
    if checkpoint is not None and {_number(b) for b in bases} != {int(checkpoint)}:
        have = _listing(sorted({b.name for b in bases}))
        raise CheckpointNotFound(
            f"no checkpoint {checkpoint} at {root}: each node keeps only its latest, and they are {have}"
        )
    _warn_about(root, claims)
    by_base: dict[Path, list[int] | None] = {}
    for kg, base in sorted(claims.items()):
        if base is not None:
            by_base.setdefault(base, []).append(kg)
    return _from_nodes(root, by_base, operator, job, meta_of)


def _from_nodes(
    root: Path, by_base: dict[Path, list[int] | None], operator: str, job: str | None, meta_of: dict
) -> OperatorCheckpoint:
    """The parts of node checkpoints ``by_base`` (directory -> the key groups to take from it,
    None: all it holds) that hold ``operator`` of ``job``."""
    jobs: dict[str, set[str]] = {}
    for base in by_base:
        for name, operators in meta_of[base].get("operators", {}).items():
            jobs.setdefault(name, set()).update(operators)
    having = sorted(name for name, operators in jobs.items() if operator in operators)
    if job is None and len(having) > 1:
        raise LookupError(
            f"keyed operator {operator!r} is in jobs {_listing(having)} at {root}: give the job"
        )
    chosen = job if job is not None else (having[0] if having else None)
    if chosen is None or operator not in jobs.get(chosen, set()):
        there = "; ".join(f"job {n!r}: {_listing(sorted(ops))}" for n, ops in sorted(jobs.items())) or "none"
        where = f" of job {job!r}" if job is not None else ""
        raise LookupError(f"no keyed operator {operator!r}{where} at {root} (keyed operators there: {there})")
    parts = []
    for base, kgs in sorted(by_base.items()):
        entry = meta_of[base].get("operators", {}).get(chosen, {}).get(operator)
        if entry is None:
            warnings.warn(
                f"checkpoint {base} holds no state of job {chosen!r} (taken after the job ended on its "
                "node): its key groups are left out",
                IncompleteCheckpoint,
                stacklevel=5,
            )
            continue
        description = {"key_mode": entry["key_mode"], "registry": entry["registry"]}
        kept = None if kgs is None else tuple(kgs)
        parts.append(SnapshotPart(str(operator_file(base, chosen, operator)), description, kept))
    numbers = [n for n in map(_number, by_base) if n is not None]
    return OperatorCheckpoint(
        operator, chosen, max(numbers, default=None), tuple(str(b) for b in sorted(by_base)), tuple(parts)
    )


def _warn_about(root: Path, claims: dict[int, Path | None]) -> None:
    """What a cluster read leaves out, or takes from an older checkpoint, one line each."""
    empty = [kg for kg, base in sorted(claims.items()) if base is None]
    if empty:
        warnings.warn(
            f"key groups {_ranges(empty)} at {root} restore from no checkpoint (adopted before any): read as empty",
            IncompleteCheckpoint,
            stacklevel=5,
        )
    missing = sorted(set(range(max(claims) + 1)) - set(claims))
    if missing:
        warnings.warn(
            f"key groups {_ranges(missing)} at {root} are in no node's manifest (a node change was under way): "
            "left out",
            IncompleteCheckpoint,
            stacklevel=5,
        )
    read = {b for b in claims.values() if b is not None}
    newest = max((n for n in map(_number, read) if n is not None), default=None)
    started = [
        p
        for p in sorted((root / NODES).glob(f"*/{CHECKPOINTS}/c*"))
        if p not in read and (_number(p) or 0) > (newest or 0) and not (p / METADATA).is_file()
    ]
    for p in started:
        warnings.warn(
            f"checkpoint {p.name} of node {p.parent.parent.name} at {root} is incomplete (the node died or "
            "stopped while taking it): its key groups are read from its latest complete one",
            IncompleteCheckpoint,
            stacklevel=5,
        )
    behind = sorted({b.parent.parent.name for b in read if _number(b) is not None and _number(b) != newest})
    if behind:
        warnings.warn(
            f"cluster checkpoint c{newest} at {root} is incomplete: node(s) {_listing(behind)} did not take it, "
            "so their key groups are read from their latest complete one",
            IncompleteCheckpoint,
            stacklevel=5,
        )


def _by_name(root: Path, base: str | None) -> Path | None:
    """A checkpoint a manifest names, found by name under ``root`` (a node may see the directory
    mounted elsewhere): ``.../nodes/<node>/checkpoints/<name>``."""
    if not base:
        return None
    path = Path(base)
    return root / NODES / path.parent.parent.name / CHECKPOINTS / path.name


def _number(path: Path | None) -> int | None:
    """The id of a cluster checkpoint ``c<id>`` (a handoff's checkpoint has none)."""
    m = re.fullmatch(r"c(\d+)", path.name) if path is not None else None
    return int(m.group(1)) if m else None


# ---- helpers ----------------------------------------------------------------------------------
def _metadata(directory: Path) -> dict:
    return json.loads((directory / METADATA).read_text())


def _listing(items) -> str:
    items = [str(i) for i in items]
    return ", ".join(items) if items else "none"


def _ranges(kgs: list[int]) -> str:
    """Key groups as ranges: ``0-3, 7``."""
    out, start = [], None
    for i, kg in enumerate(kgs):
        if start is None:
            start = kg
        if i + 1 == len(kgs) or kgs[i + 1] != kg + 1:
            out.append(str(start) if start == kg else f"{start}-{kg}")
            start = None
    return ", ".join(out)
