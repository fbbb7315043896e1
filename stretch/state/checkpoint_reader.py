"""A keyed operator's state in a checkpoint, read as Arrow: the table a running job's state gives.

Each key group is loaded from its snapshot into an arena of this process's memory (not /dev/shm)
and read there exactly as live state is read (``queryable.read_key_group``), so a checkpoint and
a running job give the same columns for the same state: key group, key, one per declared state
(value, list, map, a window's or a rolling aggregate's). One key group is loaded at a time, so
memory holds one key group's state beside the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from stretch.state import _table_kernels as K
from stretch.state.arena import PAGE, Arena
from stretch.state.keyed_table import KeyedTable
from stretch.state.queryable import concat_states, read_key_group, read_state
from stretch.state.snapshot import load_key_groups, prepare_arena


@dataclass(frozen=True)
class SnapshotPart:
    """An operator's key groups in one snapshot file (``stretch.state.snapshot``'s layout)."""

    path: str
    description: dict  # the key type and declared states (snapshot.describe_arena)
    key_groups: tuple[int, ...] | None = None  # None: every key group the file holds


@dataclass(frozen=True)
class OperatorCheckpoint:
    """Where one keyed operator's state is in one checkpoint (``open_checkpoint``); picklable, so
    that readers in other processes (Spark's executors) read exactly the key groups found here."""

    operator: str
    job: str | None
    checkpoint_id: int | None  # on a cluster: the newest node checkpoint read (``c<id>``)
    checkpoints: tuple[str, ...]  # the checkpoint directories read
    parts: tuple[SnapshotPart, ...]

    def key_groups(self) -> list[int]:
        """The key groups that hold keys, ascending."""
        return sorted(kg for part in self.parts for kg in _Snapshot(part).key_groups())

    def read(self, key_groups=None) -> pa.Table:
        """One row per key: key group, key, one column per declared state (``key_groups``: only
        those), ordered by key group as a running job's state reads are."""
        wanted = None if key_groups is None else {int(kg) for kg in key_groups}
        found = []
        for part in self.parts:
            snapshot = _Snapshot(part)
            found += [(kg, snapshot) for kg in snapshot.key_groups() if wanted is None or kg in wanted]
        tables = [snapshot.read(kg) for kg, snapshot in sorted(found, key=lambda f: f[0])]
        return concat_states(tables) if tables else self._empty()

    def schema(self) -> pa.Schema:
        """The rows' schema, as the first key group with keys has it (as a running job's)."""
        for part in self.parts:
            snapshot = _Snapshot(part)
            for kg in snapshot.key_groups():
                return snapshot.read(kg).schema
        return self._empty().schema

    def _empty(self) -> pa.Table:
        description = self.parts[0].description if self.parts else {"key_mode": 0, "registry": []}
        arena = Arena.in_memory(1, PAGE)
        try:
            prepare_arena(arena, description)
            return read_state(KeyedTable(arena), [])
        finally:
            arena.close()


class _Snapshot:
    """One snapshot file, memory-mapped, and the key groups of it a part takes."""

    def __init__(self, part: SnapshotPart):
        self.part = part
        with pa.memory_map(part.path) as source:
            self.table = pa.ipc.open_file(source).read_all()
        self.kgs = self.table.column(0).to_numpy()

    def key_groups(self) -> list[int]:
        held = np.unique(self.kgs).tolist()
        if self.part.key_groups is None:
            return held
        return sorted(set(held) & set(self.part.key_groups))

    def read(self, kg: int) -> pa.Table:
        """Key group ``kg``'s state, loaded into an arena of its own and read as live state is."""
        rows = self.table.take(np.flatnonzero(self.kgs == kg))
        caps = rows.column(2).to_numpy()
        words = rows.column(1).to_numpy()
        header = np.frombuffer(rows.column(3)[int(np.flatnonzero(words < 0)[0])].as_buffer(), np.int64)
        pages = [(int(c) + PAGE - 1) // PAGE * PAGE for c, w in zip(caps, words) if w >= 0]
        reserve = sum(pages) + int(header[K.H_INDEX_CAP]) * 4 + 2 * PAGE
        arena = Arena.in_memory(kg + 1, reserve)
        try:
            prepare_arena(arena, self.part.description)
            load_key_groups(arena, rows.to_batches())
            return read_key_group(KeyedTable(arena), kg)
        finally:
            arena.close()
