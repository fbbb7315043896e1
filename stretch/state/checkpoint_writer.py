"""Write an operator's state into a job's checkpoints, for the job to restore from: the State
Processor API's write side, to fix a job's state or to bootstrap it.

The new checkpoint is a copy of an existing one (the latest complete, by default) with one keyed
operator's state replaced by a table of the shape ``read_checkpoint`` gives (a ``key`` column and
one column per declared state; ``key_group`` is optional and checked): sources, outputs and the
other operators are the base checkpoint's, so a restore goes on from there with the written state.
It gets the next id, so ``execute(name, restore=True)`` takes it. Value, list and map states can
be written; the operator's timers are dropped (as in Flink's bootstrap, a key's timers are
registered again by its next record). One machine's checkpoints only, of a job not running.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from stretch.common.typeinfo import TypeInformation
from stretch.contracts.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from stretch.state.arena import Arena
from stretch.state.backend import KeyedStateBackend
from stretch.state.checkpoint_finder import find_operator
from stretch.state.checkpoint_layout import FINISHED, METADATA
from stretch.state.codecs import storage_entry
from stretch.state.key_groups import key_groups_of_keys
from stretch.state.keyed_table import KeyedTable, KeyMode, key_array, stored_mode_of
from stretch.state.snapshot import copy_key_groups, prepare_arena, write_snapshot
from stretch.state.ttl import TTL_PREFIX

_ROOM = 64 << 20  # arena bytes for a key group's structures beyond 16x its rows' size


def write_checkpoint(path, operator: str, table: pa.Table, checkpoint: int | None = None) -> int:
    """Write ``table`` as ``operator``'s whole state into a new checkpoint (a copy of checkpoint
    ``checkpoint`` of the job at ``path``, the latest complete by default); returns its id."""
    found = find_operator(path, operator, checkpoint)
    base = Path(found.checkpoints[0])
    meta = json.loads((base / METADATA).read_text())
    if len(found.checkpoints) != 1 or "node" in meta:
        raise ValueError("writing into a cluster's checkpoints is not supported: only a job's on one machine")
    root = base.parent
    if (root / FINISHED).exists():
        raise ValueError(f"the job at {root} finished: it cannot restore, so nothing is written there")
    _refuse_if_running(root.parent)
    entry = meta["operators"][operator]
    description = {"key_mode": entry["key_mode"], "registry": entry["registry"]}
    batches = _snapshot(table, description, int(meta["max_parallelism"]), operator)
    new_id = max(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit()) + 1
    target = root / f"{new_id:010d}"
    target.mkdir(mode=0o700)
    mine = set(entry["files"])
    for f in base.iterdir():  # the other operators' files, as they are (hard links where possible)
        if f.name not in mine and f.name != METADATA:
            try:
                os.link(f, target / f.name)
            except OSError:
                (target / f.name).write_bytes(f.read_bytes())
    name = f"{entry['stage']}-written.arrow"
    write_snapshot(batches, target / name)
    os.chmod(target / name, 0o600)
    size = sum(f.stat().st_size for f in target.glob("*.arrow"))
    operators = {**meta["operators"], operator: {**entry, "files": [name]}}
    written = {**meta, "id": new_id, "completed_at": time.time(), "bytes": size, "operators": operators}
    written["written_from"] = found.checkpoint_id
    _write_private(target / METADATA, json.dumps(written))  # last: the checkpoint is complete
    return new_id


def _refuse_if_running(job_dir: Path) -> None:
    """A running job holds its directory's lock (runtime.state_dir.JobDir) and takes checkpoints
    of its own: writing one beside them would race them."""
    lock = job_dir / "lock"
    if not lock.exists():
        return
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"the job at {job_dir} is running: stop it before writing its checkpoint") from None
    finally:
        os.close(fd)


def _snapshot(
    table: pa.Table, description: dict, max_parallelism: int, operator: str
) -> list[pa.RecordBatch]:
    """The key-group snapshot of ``table`` as the operator's state (``description``: its key
    type and declared states), one key group at a time."""
    if "key" not in table.column_names:
        raise ValueError(f"the table for {operator!r} needs a 'key' column (as read_checkpoint gives)")
    keys = table.column("key").to_pylist()
    if len(set(map(repr, keys))) != len(keys):
        raise ValueError(f"the table for {operator!r} holds a key more than once")
    kgs = key_groups_of_keys(keys, max_parallelism)
    if "key_group" in table.column_names:
        given = np.asarray(table.column("key_group").to_numpy(zero_copy_only=False), dtype=np.int64)
        wrong = np.flatnonzero(given != kgs)
        if wrong.size:
            i = int(wrong[0])
            raise ValueError(
                f"key {keys[i]!r} is in key group {int(kgs[i])} at max parallelism {max_parallelism}, "
                f"not {int(given[i])}: the column key_group must be the keys' own (or left out)"
            )
    descriptors = _descriptors(description, table.column_names, operator)
    mode = KeyMode(description["key_mode"]) if description["key_mode"] else _mode_of(keys)
    description = {**description, "key_mode": int(mode)}
    batches: list[pa.RecordBatch] = []
    for kg in np.unique(kgs).tolist():
        at = np.flatnonzero(kgs == kg)
        part = table.take(pa.array(at))
        arena = Arena.in_memory(max_parallelism, _ROOM + 16 * part.nbytes)
        try:
            prepare_arena(arena, description)
            _fill(KeyedTable(arena), part, [keys[i] for i in at], kgs[at], mode, descriptors)
            batches += copy_key_groups(KeyedTable(arena), [kg])
        finally:
            arena.close()
    return batches


def _descriptors(description: dict, columns: list[str], operator: str) -> dict:
    """The declared states the table has columns for, as descriptors that declare them exactly;
    any other column, or a state of another kind, is refused (its keys would lack it)."""
    out = {}
    entries = [e for e in description["registry"] if not e["name"].startswith("__")]  # not timers
    names = {entry["name"] for entry in description["registry"]}
    for entry in entries:
        name = entry["name"]
        descriptor = None
        t = TypeInformation.from_json(entry["type"]) if entry.get("type") else None
        with contextlib.suppress(Exception):
            if entry["kind"] == "value":
                descriptor = ValueStateDescriptor(name, t)
            elif entry["kind"] == "list":
                descriptor = ListStateDescriptor(name, t.get_element_type())
            elif entry["kind"] == "map":
                descriptor = MapStateDescriptor(name, t.get_key_type(), t.get_value_type())
        if descriptor is None or storage_entry(descriptor) != entry:
            raise ValueError(
                f"state {name!r} of {operator!r} ({entry['kind']}) cannot be written: value, list and map "
                "states can"
            )
        if TTL_PREFIX + name in names:
            raise ValueError(f"state {name!r} of {operator!r} has a time-to-live: it cannot be written")
        if name in columns:  # a state the table leaves out stays unset
            out[name] = descriptor
    unknown = [c for c in columns if c not in out and c not in ("key", "key_group")]
    if unknown:
        declared = ", ".join(e["name"] for e in entries) or "none yet: take the checkpoint after its open()"
        raise ValueError(f"columns {unknown} are no state of {operator!r} (its states: {declared})")
    return out


def _fill(table: KeyedTable, part: pa.Table, keys: list, kgs: np.ndarray, mode: KeyMode, descriptors) -> None:
    backend = KeyedStateBackend(table)
    states = {name: backend.state(d) for name, d in descriptors.items()}
    kgs = np.ascontiguousarray(kgs, dtype=np.uint16)
    rows = table.rows(kgs, key_array(keys, mode), mode)
    backend.begin(kgs, rows, keys)
    try:
        columns = {name: part.column(name).to_pylist() for name in states}
        for slot in range(len(keys)):
            backend.current = slot
            for name, state in states.items():
                value = columns[name][slot]
                state.clear()
                if value is None:
                    continue
                kind = descriptors[name].kind
                if kind == "value":
                    state.update(value)
                elif kind == "list":
                    state.update(list(value))
                else:
                    state.put_all(dict(value))
    finally:
        backend.end()


def _mode_of(keys: list) -> KeyMode:
    """The key mode of an operator that held no key yet: as its first keys would set it."""
    modes = {stored_mode_of(k) for k in keys}
    return modes.pop() if len(modes) == 1 else KeyMode.CANONICAL


def _write_private(path: Path, text: str) -> None:
    """Owner-only and atomic: a reader sees no metadata or the whole of it."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)
