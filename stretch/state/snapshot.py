"""Key-group snapshots: an operator's state (timers included) as Arrow IPC, restorable anywhere.

A key group's structures are addressed by byte offsets held in its header, and every structure
addresses its contents relative to itself, so a key group is relocatable: a snapshot stores the
header and the live bytes of each structure it points to; a restore allocates each structure
afresh in the target arena and rewrites the header's offsets. Snapshots hold key groups, not
instances, so a checkpoint taken at one parallelism restores at any other.

The hash index of a key group's keys is not stored: it is rebuilt from the keys on restore, so a
snapshot holds little more than the keys and their state (a node change ships only that).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from stretch.state import _table_kernels as K
from stretch.state.arena import Arena
from stretch.state.keyed_table import KeyedTable, KeyMode, per_key_words, row_width

_BATCH_BYTES = 64 << 20
SCHEMA = pa.schema(
    [
        ("key_group", pa.int32()),
        ("word", pa.int32()),  # the header word holding this block's offset; -1: the header itself
        ("capacity", pa.int64()),  # bytes to allocate on restore (the block's size in the arena)
        ("data", pa.large_binary()),  # the block's live bytes
    ]
)


def _blocks(table: KeyedTable, kg: int, registry: list[dict]):
    """(header word, capacity bytes, live bytes) of every structure of key group `kg`."""
    h = table.headers[kg]
    n = int(h[K.H_NKEYS])
    byte_keys = table.mode() not in (None, KeyMode.INT64)
    width = 16 if byte_keys else 8
    yield K.H_KEYS_OFF, int(h[K.H_KEYS_CAP]) * width, n * width
    if byte_keys:
        yield K.H_KHASH_OFF, int(h[K.H_KEYS_CAP]) * 8, n * 8
        yield K.H_KHEAP_OFF, int(h[K.H_KHEAP_CAP]), int(h[K.H_KHEAP_USED])
    for sid, entry in enumerate(registry):
        base = K.STATE_BASE + sid * K.STATE_WORDS
        c = h[base : base + K.STATE_WORDS]
        cap = int(c[K.S_DATA_CAP])
        if entry["storage"] == "heap":  # timer heaps: (timestamp, row) pairs
            yield base + K.S_DATA_OFF, cap * 16, int(c[K.S_HEAP_USED]) * 16
            continue
        w = row_width(entry)
        yield base + K.S_DATA_OFF, cap * w, min(n, cap) * w
        yield base + K.S_VALID_OFF, cap, min(n, cap)
        yield base + K.S_HEAP_OFF, int(c[K.S_HEAP_CAP]), int(c[K.S_HEAP_USED])


def copy_key_groups(table: KeyedTable, key_groups) -> list[pa.RecordBatch]:
    """The given key groups' structures, copied out of the arena into Arrow batches.

    The caller owns these key groups and does not write them meanwhile (an instance at a barrier);
    once this returns it may go on, and the batches be written at leisure (``write_snapshot``).
    Batches are cut at about 64 MiB.
    """
    a8 = table.arena.a8
    registry = table.arena.registry()
    batches: list[pa.RecordBatch] = []
    rows: list[tuple] = []
    pending = 0
    for kg in map(int, key_groups):
        if not table.headers[kg, K.H_NKEYS]:
            continue
        header = table.headers[kg].copy()
        rows.append((kg, -1, K.KG_WORDS * 8, header))
        for word, cap, live in _blocks(table, kg, registry):
            off = int(header[word])
            header[word] = 0  # set again on restore, where the block is allocated
            if off and cap:
                rows.append((kg, word, cap, a8[off : off + live]))
                pending += live
        if pending >= _BATCH_BYTES:
            batches.append(_batch(rows))
            rows, pending = [], 0
    if rows:
        batches.append(_batch(rows))
    return batches


def write_snapshot(batches: list[pa.RecordBatch], path: Path) -> int:
    """Write copied key groups to an Arrow IPC file, atomically; returns its size in bytes."""
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, SCHEMA) as writer:
        for batch in batches:
            writer.write_batch(batch)
    tmp.replace(path)
    return path.stat().st_size


def snapshot_key_groups(table: KeyedTable, key_groups, path: Path) -> int:
    """Copy and write in one go (see copy_key_groups and write_snapshot)."""
    return write_snapshot(copy_key_groups(table, key_groups), path)


def _batch(rows: list[tuple]) -> pa.RecordBatch:
    kgs, words, caps, data = zip(*rows)
    return pa.record_batch(
        [
            pa.array(kgs, pa.int32()),
            pa.array(words, pa.int32()),
            pa.array(caps, pa.int64()),
            pa.array([memoryview(d).cast("B") for d in data], pa.large_binary()),
        ],
        schema=SCHEMA,
    )


def restore_key_groups(arena: Arena, path: Path) -> int:
    """Load a snapshot file into a fresh arena (its key groups must be empty); returns key groups."""
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_file(source).read_all()
    return load_key_groups(arena, table.to_batches())


def load_key_groups(arena: Arena, batches) -> int:
    """Load copied key groups (``copy_key_groups``' batches) into an arena whose copies of these
    key groups are empty; the arena may be live, as long as nobody touches these key groups
    meanwhile (a node that receives key groups from another). Returns the key groups loaded."""
    headers = arena.headers
    per_key = per_key_words(arena.registry())
    restored = 0
    loaded: list[int] = []
    indexed: set[int] = set()  # key groups whose snapshot holds their index (older snapshots)
    for batch in batches:
        kgs = batch.column(0).to_numpy()
        words = batch.column(1).to_numpy()
        caps = batch.column(2).to_numpy()
        data = batch.column(3)
        for i in range(batch.num_rows):
            kg, word = int(kgs[i]), int(words[i])
            raw = data[i].as_buffer()
            if word < 0:
                if headers[kg, K.H_NKEYS]:
                    raise ValueError(f"key group {kg} already holds keys here: it cannot be loaded over them")
                header = np.frombuffer(raw, dtype=np.int64).copy()
                header[K.H_INDEX_OFF] = 0
                # all but the version word: it is this arena's seqlock for queryable readers, and a
                # live instance may be inside a write of every key group it owns right now; over-
                # writing it could leave it odd for good (a reader would never see it settle); and
                # the away word stays this arena's: the loading node says when it is here
                header[K.H_AWAY] = headers[kg, K.H_AWAY]
                # blocks with an entry per key are reserved up to the keys they hold (see below)
                header[K.H_UNRESERVED] = header[K.H_KEYS_CAP] - header[K.H_NKEYS]
                headers[kg, K.H_VERSION + 1 :] = header[K.H_VERSION + 1 :]
                restored += 1
                loaded.append(kg)
                continue
            off = arena.alloc(int(caps[i]), len(raw) if word in per_key else None)
            arena.a8[off : off + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            headers[kg, word] = off
            if word == K.H_INDEX_OFF:
                indexed.add(kg)
    for kg in loaded:
        if kg not in indexed:
            _rebuild_index(arena, kg)
    return restored


def _rebuild_index(arena: Arena, kg: int) -> None:
    cap = int(arena.headers[kg, K.H_INDEX_CAP])
    off = arena.alloc(cap * 4)
    arena.a8[off : off + cap * 4] = 0
    h = arena.headers[kg]
    w = arena.dir_w + kg * K.KG_WORDS
    rehash = K.rehash_bytes if h[K.H_KHASH_OFF] else K.rehash_i64
    rehash(arena.a64, arena.a32, w, off, cap)
    h[K.H_INDEX_OFF] = off


def release_key_groups(table: KeyedTable, key_groups) -> None:
    """Forget key groups that moved to another node: their pages go back to the OS and their
    headers are emptied. The caller owns them and nobody writes them meanwhile."""
    arena, registry = table.arena, table.arena.registry()
    for kg in map(int, key_groups):
        header = table.headers[kg]
        for word, cap, _live in _blocks(table, kg, registry):
            arena.free(int(header[word]), cap)
        away = table.headers[kg, K.H_AWAY]
        table.headers[kg, K.H_VERSION + 1 :] = 0  # the version and away words stay (see load_key_groups)
        table.headers[kg, K.H_AWAY] = away


def describe_arena(arena: Arena) -> dict:
    """What a restore needs besides the key groups: the key type and the declared states."""
    return {"key_mode": arena.key_mode(), "registry": arena.registry()}


def prepare_arena(arena: Arena, description: dict) -> None:
    """Declare a snapshot's key type and states (in their ids' order) in a fresh arena."""
    if description["key_mode"]:
        arena.claim_key_mode(description["key_mode"])
    for entry in description["registry"]:
        arena.register_state(entry)
