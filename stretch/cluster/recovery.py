"""What lets any node restore any key group of a node that died: the checkpoint directory.

A cluster given ``checkpoint_dir`` (a directory every node can read, next to Spark's checkpoint
location on Spark) keeps, per node, under ``nodes/<node>/``:

- ``journal/<job>/<channel>/``: every row batch the node took for a checkpointed job, in the order
  it took them, before the job sees them (a channel log, ``runtime.channel_log``), each batch
  tagged with its Spark (query, micro-batch). Spark replays only a micro-batch it never
  committed, so what a node took must be kept by the cluster until a checkpoint covers it.
- ``checkpoints/<name>/``: a checkpoint of the key groups the node owns: per job and keyed
  operator one Arrow IPC file of key-group snapshots (``<job>/<operator>.arrow``, rows tagged by
  key group, so any node loads any key group of it), and ``_metadata.json`` (each state's layout
  and the dedup marks of every (channel, query) per key group), written last. A release
  checkpoint (a node giving key groups away) is taken at the readers' frontier of each keyed
  operator rather than after its backlog: it keeps too the rows the node had taken and not
  processed there (``<job>/<operator>.queued.arrow``, gate batches in order, with their key
  groups), which a restore takes before the journal's.
- ``manifest.json``, replaced atomically: how to restore each key group the node owns, its latest
  checkpoint with the journal offsets and output offsets it covers, and the key groups adopted
  since (each with the snapshot it came from and the journal offset from which its rows are here).

A key group restores from its base (a checkpoint, None: empty) plus the base's queued rows of it,
plus the journal's rows of it from the base's offsets on; its dedup marks from the base's marks
plus the journal's tags. A dead
node's output logs are cut back to what its latest checkpoint committed: the restored key groups
produce the rest again.

What no manifest of a current node names is garbage (``collect_garbage``, run by the driver
between node changes, checkpoints and restores): a release checkpoint once its adopters' and its
own node's next checkpoints cover its key groups, a dead or removed node's journal and manifest
once its key groups are restored elsewhere (the rows went on into their new owners' journals),
its checkpoints once every key group restored from them is covered by a later checkpoint.
Checkpoints and manifests are synced to disk before a manifest names them, so a deletion never
precedes the saved manifest that makes it safe.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa

from stretch.runtime.batch import KG_COLUMN
from stretch.runtime.channel_log import ChannelLog
from stretch.runtime.state_dir import job_dir_name, make_private_dir, write_private
from stretch.state.checkpoint_layout import MANIFEST, METADATA, node_dir, operator_file
from stretch.state.snapshot import SCHEMA as SNAPSHOT_SCHEMA
from stretch.state.snapshot import write_snapshot


class NodeLost(RuntimeError):
    """A node died during a node change: its key groups (and those it was handing over) were
    restored on the surviving nodes from the checkpoint directory, and the change stopped there."""


QUERY_KEY = b"stretch.cluster.query"
BATCH_KEY = b"stretch.cluster.batch"
STAGE_KEY = b"stretch.cluster.stage"
_TAGS = (QUERY_KEY, BATCH_KEY, STAGE_KEY)
STAGE_PARTS = "stage_parts.arrow"  # a job's stage transaction parts in a checkpoint
QUEUED = ".queued.arrow"  # after an operator's name: the rows a release checkpoint kept queued
NO_LIMIT = 1 << 62  # a journal keeps everything (its node's checkpoints say what it still needs)


def journal_dir(checkpoint_dir, node: str, job: str, channel: str) -> Path:
    return node_dir(checkpoint_dir, node) / "journal" / job_dir_name(job) / channel


def open_journal(checkpoint_dir, node: str, job: str, channel: str) -> ChannelLog:
    return ChannelLog(journal_dir(checkpoint_dir, node, job, channel), max_bytes=NO_LIMIT)


def tagged(
    batch: pa.RecordBatch, query: str | None, batch_id: int | None, stage: tuple | None = None
) -> pa.RecordBatch:
    """``batch`` with its (query, micro-batch) in its schema's metadata, as the journal keeps it;
    ``stage``: the name of the stage transaction it is a part of (cluster.stage_parts), so that a
    replay makes it a part again."""
    meta = {k: v for k, v in (batch.schema.metadata or {}).items() if k not in _TAGS}
    if query is not None:
        meta.update({QUERY_KEY: query.encode(), BATCH_KEY: str(batch_id).encode()})
    if stage is not None:
        meta[STAGE_KEY] = json.dumps(list(stage)).encode()
    return batch.replace_schema_metadata(meta or None)


def untagged(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A journaled batch as it was taken (its record kind kept, the journal's tags gone)."""
    meta = {k: v for k, v in (batch.schema.metadata or {}).items() if k not in _TAGS}
    return batch.replace_schema_metadata(meta or None)


def tag_of(batch: pa.RecordBatch) -> tuple[str | None, int | None]:
    meta = batch.schema.metadata or {}
    if QUERY_KEY not in meta:
        return None, None
    return meta[QUERY_KEY].decode(), int(meta[BATCH_KEY])


def stage_of(batch: pa.RecordBatch) -> tuple | None:
    """The stage transaction (channel, query, micro-batch, partition, output) a journaled batch
    is a part of, if it is."""
    meta = batch.schema.metadata or {}
    return tuple(json.loads(meta[STAGE_KEY])) if STAGE_KEY in meta else None


# ---- snapshots ----------------------------------------------------------------------------------
def write_checkpoint(
    path: Path,
    operators: dict,
    marks: dict,
    extra: dict,
    stage_parts: dict | None = None,
    queued: dict | None = None,
) -> int:
    """A checkpoint directory: ``operators`` {job: {operator: (batches, description)}}, ``marks``
    {job: [[channel, query, {kg: batch}]]}, ``stage_parts`` {job: table of stage transaction parts
    (cluster.stage_parts)}, ``queued`` {job: {operator: gate batches the node had taken and not
    processed}}; ``_metadata.json`` last. Returns the bytes written."""
    if path.exists():  # a checkpoint of that name that never completed (its node died)
        shutil.rmtree(path)
    make_private_dir(path)
    size, layouts = 0, {}
    for job, by_operator in operators.items():
        make_private_dir(path / job_dir_name(job))
        for operator, (batches, description) in by_operator.items():
            size += write_snapshot(batches, operator_file(path, job, operator))
            layouts.setdefault(job, {})[operator] = description
    for job, by_operator in (queued or {}).items():
        for operator, batches in by_operator.items():
            if batches:
                make_private_dir(path / job_dir_name(job))
                size += _write_file(
                    path / job_dir_name(job) / f"{operator}{QUEUED}", pa.Table.from_batches(batches)
                )
    for job, table in (stage_parts or {}).items():
        if table.num_rows:
            make_private_dir(path / job_dir_name(job))
            size += _write_file(path / job_dir_name(job) / STAGE_PARTS, table)
    write_private(path / METADATA, json.dumps({"operators": layouts, "marks": marks, **extra}))
    sync_tree(path)
    return size


def _write_file(path: Path, table: pa.Table) -> int:
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as writer:
        writer.write_table(table)
    return table.nbytes


def sync_tree(path: Path) -> None:
    """Flush every file and directory under ``path`` (and ``path``'s entry in its parent) to
    disk: a manifest names a checkpoint, and another is deleted, only once it is there."""
    for directory, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            _fsync(Path(directory) / name)
        _fsync(Path(directory))
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_metadata(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / METADATA).read_text())


def read_key_groups(path: str | os.PathLike, job: str, operator: str, key_groups) -> list[pa.RecordBatch]:
    """The snapshot rows of ``key_groups`` of a job's operator in a checkpoint directory."""
    file = operator_file(path, job, operator)
    if not file.exists():
        return []
    with pa.memory_map(str(file)) as source:
        table = pa.ipc.open_file(source).read_all()
    wanted = np.zeros(max(int(max(key_groups, default=0)) + 1, 1), dtype=bool)
    wanted[list(key_groups)] = True
    column = table.column(0).to_numpy()
    keep = np.zeros(len(column), dtype=bool)
    inside = column < len(wanted)
    keep[inside] = wanted[column[inside]]
    return pa.Table.from_batches(table.filter(pa.array(keep)).to_batches(), SNAPSHOT_SCHEMA).to_batches()


def read_queued(path: str | os.PathLike, job: str, operator: str, key_groups) -> list[pa.RecordBatch]:
    """The rows of ``key_groups`` a release checkpoint kept of a job's operator, queued behind the
    frontier there (gate batches, in order)."""
    file = Path(path) / job_dir_name(job) / f"{operator}{QUEUED}"
    if not file.exists():
        return []
    with pa.OSFile(str(file)) as source:  # read into memory: the rows outlive the file
        table = pa.ipc.open_file(source).read_all()
    wanted = np.zeros(1 << 16, dtype=bool)
    wanted[list(key_groups)] = True
    keep = wanted[table.column(KG_COLUMN).to_numpy()]
    return table.filter(pa.array(keep)).to_batches() if keep.any() else []


def read_stage_parts(path: str | os.PathLike, job: str, key_groups) -> pa.Table | None:
    """The stage transaction parts a checkpoint keeps of a job that cover any of ``key_groups``."""
    file = Path(path) / job_dir_name(job) / STAGE_PARTS
    if not file.exists():
        return None
    with pa.OSFile(str(file)) as source:  # read into memory: the parts outlive the file
        table = pa.ipc.open_file(source).read_all()
    wanted = {int(kg) for kg in key_groups}
    keep = [bool(wanted.intersection(kgs)) for kgs in table.column("key_groups").to_pylist()]
    return table.filter(pa.array(keep, pa.bool_()))


# ---- the manifest -------------------------------------------------------------------------------
def load_manifest(checkpoint_dir, node: str) -> dict:
    path = node_dir(checkpoint_dir, node) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {"checkpoint": None, "key_groups": [], "journal": {}, "outputs": {}, "adopted": []}


def save_manifest(checkpoint_dir, node: str, manifest: dict) -> None:
    """Replace a node's manifest atomically and durably (synced, then renamed, then the rename
    synced): what it no longer names may be deleted as soon as this returns."""
    directory = node_dir(checkpoint_dir, node)
    make_private_dir(directory)
    path = directory / MANIFEST
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps(manifest).encode())
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync(directory)


def source_of(checkpoint_dir, node: str, key_group: int, manifest: dict | None = None) -> tuple:
    """Where key group ``key_group`` of node ``node`` restores from: (base checkpoint or None,
    {job: {channel: journal offset}}), the latest adoption of it, else the node's checkpoint."""
    manifest = manifest if manifest is not None else load_manifest(checkpoint_dir, node)
    for entry in reversed(manifest["adopted"]):
        if key_group in entry["key_groups"]:
            return entry["base"], entry["journal"]
    return manifest["checkpoint"], manifest["journal"]


def adopted_from(checkpoint_dir, node: str, key_group: int, base: str) -> bool:
    """Whether ``node`` adopted ``key_group`` from ``base`` (a handoff reached its last step)."""
    manifest = load_manifest(checkpoint_dir, node)
    return any(key_group in e["key_groups"] and e["base"] == base for e in manifest["adopted"])


def cut_output(log_dir: Path, offset: int) -> None:
    """A dead node's output log ends where its latest checkpoint committed it: what came after is
    produced again by the node that restores its key groups."""
    try:
        log = ChannelLog(log_dir, create=False)
    except LookupError:
        return
    try:
        log.truncate(offset)
        log.set_committed(None)
        log.end()
    finally:
        log.close()


# ---- garbage collection -------------------------------------------------------------------------
def referenced(checkpoint_dir, nodes) -> set[tuple[str, str]]:
    """The checkpoints the manifests of ``nodes`` name (each its own latest and the bases of the
    key groups it adopted since), as (node, checkpoint name): all a restore of any of their key
    groups may read. By name, not path: a node may see the directory mounted elsewhere."""
    keep = set()
    for node in nodes:
        manifest = load_manifest(checkpoint_dir, node)
        keep.add(manifest["checkpoint"])
        keep.update(entry["base"] for entry in manifest["adopted"])
    return {checkpoint_name(path) for path in keep if path}


def checkpoint_name(path: str | os.PathLike) -> tuple[str, str]:
    """(node, name) of a checkpoint directory ``.../nodes/<node>/checkpoints/<name>``."""
    path = Path(path)
    return path.parent.parent.name, path.name


def collect_garbage(checkpoint_dir, nodes, before_delete=None) -> list[str]:
    """Delete what no restore can read any more; returns the paths deleted.

    ``nodes``: the cluster's current nodes (the routing table's and any joining). The caller makes
    sure no node change, checkpoint or restore runs meanwhile, so their saved manifests say all
    that is needed: every checkpoint they name stays (a release checkpoint a node adopted from, a
    dead node's checkpoint its key groups were restored from), and so do their journals. Of any
    other node (it died and was restored, or was removed) only the checkpoints named stay; its
    journal went on into its key groups' new owners' journals when they adopted them.

    Crash-safe: only what no saved manifest names is deleted, so a driver or node killed in the
    middle leaves at most unnamed leftovers, which the next collection deletes.
    ``before_delete(path)`` is called before each deletion (tests)."""
    root = Path(checkpoint_dir) / "nodes"
    if not root.is_dir():
        return []
    current = set(nodes)
    keep = referenced(checkpoint_dir, current)
    removed: list[str] = []

    def remove(path: Path) -> None:
        if before_delete is not None:
            before_delete(str(path))
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(str(path))

    for directory in sorted(root.iterdir()):
        if not directory.is_dir():
            continue
        checkpoints = directory / "checkpoints"
        named = False
        for checkpoint in sorted(checkpoints.iterdir()) if checkpoints.is_dir() else []:
            if checkpoint_name(checkpoint) in keep:
                named = True
            else:
                remove(checkpoint)
        if directory.name in current:
            continue
        if not named:
            remove(directory)
            continue
        for rest in sorted(directory.iterdir()):  # its journal and manifest: read by no one now
            if rest != checkpoints:
                remove(rest)
    return removed
