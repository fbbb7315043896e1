"""Key groups reserve memory for the rows they take, not for their whole capacity, and never write
a row before it is reserved (a full /dev/shm must be an error at the reservation, not a bus error
at the write).

A ledger records every range the arena reserves; after fused passes, record lookups, fixed and
variable-length columns, string keys and a snapshot restore, every live byte must lie in it. Memory
per key is measured on a key count that fills each key group's capacity to only 55 %: reserving
whole capacities would hold about 1.8x the rows in use there.
"""

from __future__ import annotations

import mmap

import numpy as np
import pyarrow as pa
import pytest

from stretch import _shm
from stretch.state import _table_kernels as K
from stretch.state.arena import Arena
from stretch.state.key_groups import key_groups_of
from stretch.state.keyed_table import MAX_LOAD, KeyedTable, KeyMode
from stretch.state.snapshot import copy_key_groups, load_key_groups, prepare_arena

MAXP = 8
KEYS = 9000 * MAXP  # 9000 a key group: a capacity of 16384 rows, 55 % full
PAGE = mmap.PAGESIZE
ROLLING = {
    "name": "rolling sum",
    "kind": "rolling",
    "storage": "words",
    "fields": [{"name": "f1", "float": False, "acc": True}],
    "type": None,
}


@pytest.fixture
def ledger(monkeypatch):
    """Every (offset, length) any segment reserves, by segment name."""
    reserved: dict[str, list[tuple[int, int]]] = {}
    reserve = _shm.Segment.reserve

    def recording(segment, offset, length, what=""):
        reserve(segment, offset, length, what)
        reserved.setdefault(segment.name, []).append((offset, length))

    monkeypatch.setattr(_shm.Segment, "reserve", recording)
    return reserved


@pytest.fixture
def arenas(shm_prefix):
    made: list[Arena] = []

    def make() -> KeyedTable:
        made.append(Arena.create(shm_prefix, MAXP))
        return KeyedTable(made[-1])

    yield make
    for arena in made:
        arena.close()


def _keys(n: int, seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n).astype(np.int64) * 7919


def _fused_sum(table: KeyedTable, keys: np.ndarray, batch: int = 4096) -> None:
    """The rolling sum's fused pass, as the aggregate operator drives it (grow and resume)."""
    arena = table.arena
    sid = arena.register_state(ROLLING)
    table.claim_mode(KeyMode.INT64)
    owners = np.zeros(MAXP, np.int16)
    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        kgs = key_groups_of(part, MAXP)
        vals = np.ones((1, len(part)), np.int64)
        progress = np.zeros(3, np.int64)
        while True:
            K.rolling_aggregate_i64(
                arena.a64, arena.a32, arena.a8, arena.views[np.dtype(np.float64)][0], arena.dir_w,
                arena.state_base_w(sid), kgs, part, owners, 0, 0, vals, np.zeros(1, np.bool_),
                np.ones(1, np.bool_), np.empty(len(part), np.int64), np.empty_like(vals), progress,
                MAX_LOAD,
            )  # fmt: skip
            if progress[2] < 0:
                break
            table.grow_for(int(progress[2]), sid, 8)


def _two_value_states(table: KeyedTable, keys, batch: int = 4096) -> None:
    """A KeyedProcessFunction's two ValueStates (int64 and float64): rows found or inserted a
    batch at a time, then each column written."""
    arena = table.arena
    sids = [
        arena.register_state({"name": n, "kind": "value", "storage": d, "type": None})
        for n, d in (("count", "int64"), ("sum", "float64"))
    ]
    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        kgs = key_groups_of(part, MAXP)
        mode = KeyMode.UTF8 if pa.types.is_string(pa.array(part[:1]).type) else KeyMode.INT64
        rows = table.rows(kgs, part, mode)
        ones = np.ones(len(part), np.uint8)
        table.scatter(sids[0], np.int64, kgs, rows, np.arange(len(part), dtype=np.int64), ones)
        table.scatter(sids[1], np.float64, kgs, rows, np.full(len(part), 0.5), ones)


def _bytes_per_key(table: KeyedTable, keys: int) -> float:
    """Memory the key groups' structures hold, per key (the directory of key-group headers, a
    fixed cost of the arena, left out)."""
    arena = table.arena
    return (arena.resident_bytes() - Arena.directory_bytes(MAXP)) / keys


def _assert_live_bytes_reserved(table: KeyedTable, reserved: list[tuple[int, int]]) -> None:
    pages = set()
    for off, length in reserved:  # posix_fallocate reserves the pages the range touches
        pages.update(range(off // PAGE, -(-(off + length) // PAGE)))
    for off, length in table.live_ranges():
        if length > 0:
            missing = set(range(off // PAGE, -(-(off + length) // PAGE))) - pages
            assert not missing, f"live bytes [{off}, {off + length}) in {len(missing)} unreserved pages"


def test_the_rolling_sum_holds_memory_for_its_rows_not_its_capacity(arenas):
    table = arenas()
    _fused_sum(table, _keys(KEYS))
    per_key = _bytes_per_key(table, KEYS)
    # 8 key + 8 sum + 1 validity bytes a row, reserved up to 1/16 (or 1024 rows) past the rows
    # taken, and 4-byte index slots at most half full: 32.3 here; whole capacities held 45.5
    assert per_key <= 34, f"{per_key:.1f} bytes per key"


def test_two_value_states_hold_memory_for_their_rows_not_their_capacity(arenas):
    table = arenas()
    _two_value_states(table, _keys(KEYS))
    per_key = _bytes_per_key(table, KEYS)
    # 8 key + 2 x (8 + 1) bytes a row, reserved a batch's rows ahead, and index slots at most 70 %
    # full: 34.8 here; whole capacities held 54.6
    assert per_key <= 38, f"{per_key:.1f} bytes per key"


def test_every_row_written_was_reserved_first(arenas, ledger):
    ints = arenas()
    _fused_sum(ints, _keys(KEYS))
    more = _keys(KEYS // 2, seed=3) + 1  # other keys into the same key groups, by record lookups
    _two_value_states(ints, more)
    var = ints.arena.register_state({"name": "v", "kind": "value", "storage": "var", "type": None})
    kgs = key_groups_of(more, MAXP)
    rows = ints.rows(kgs, more, KeyMode.INT64, insert=False)
    ints.write_var(var, kgs, rows, [b"x" * (i % 40) for i in range(len(rows))])
    _assert_live_bytes_reserved(ints, ledger[ints.arena.name])

    strings = arenas()
    _two_value_states(strings, pa.array([f"key {k}" for k in _keys(KEYS // 2).tolist()]))
    _assert_live_bytes_reserved(strings, ledger[strings.arena.name])

    restored = arenas()  # a snapshot restored reserves its rows, then grows on from there
    prepare_arena(restored.arena, {"key_mode": ints.arena.key_mode(), "registry": ints.arena.registry()})
    load_key_groups(restored.arena, copy_key_groups(ints, range(MAXP)))
    assert [restored.keys_of(kg) for kg in range(MAXP)] == [ints.keys_of(kg) for kg in range(MAXP)]
    _assert_live_bytes_reserved(restored, ledger[restored.arena.name])
    _fused_sum(restored, _keys(KEYS, seed=4) + 2)
    _two_value_states(restored, _keys(KEYS // 4, seed=5) + 3)
    _assert_live_bytes_reserved(restored, ledger[restored.arena.name])
