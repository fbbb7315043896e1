"""Key-group snapshots: state and timers written from one arena restore equal into a fresh one."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from stretch.common.typeinfo import Types
from stretch.datastream.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from stretch.state.arena import Arena
from stretch.state.backend import KeyedStateBackend
from stretch.state.key_groups import key_groups_of
from stretch.state.keyed_table import KeyedTable, KeyMode
from stretch.state.queryable import read_state
from stretch.state.snapshot import (
    copy_key_groups,
    describe_arena,
    load_key_groups,
    prepare_arena,
    release_key_groups,
    restore_key_groups,
    snapshot_key_groups,
)
from stretch.state.timers import EVENT, TimerStore

MAXP = 64


def _fill(arena: Arena, key_kind: str, rng: random.Random) -> dict:
    """Random value, list and map states plus timers; returns the plain-Python model of them."""
    table = KeyedTable(arena)
    backend = KeyedStateBackend(table)
    count = backend.state(ValueStateDescriptor("count", Types.LONG()))
    names = backend.state(ListStateDescriptor("names", Types.STRING()))
    tags = backend.state(MapStateDescriptor("tags", Types.STRING(), Types.LONG()))
    timers = TimerStore(table)
    model: dict = {}
    for _ in range(20):
        raw = [rng.randrange(500) for _ in range(300)]
        keys = list(dict.fromkeys(raw if key_kind == "int" else [f"user-{k}" for k in raw]))
        arr = np.array(keys, np.int64) if key_kind == "int" else pa.array(keys, pa.string())
        kgs = key_groups_of(arr, MAXP)
        rows = table.rows(kgs, arr, KeyMode.INT64 if key_kind == "int" else KeyMode.UTF8)
        backend.begin(kgs, rows, keys)
        for slot, k in enumerate(keys):
            backend.current = slot
            m = model.setdefault(k, {"count": 0, "names": [], "tags": {}, "timers": set()})
            m["count"] += 1
            count.update(m["count"])
            name = rng.choice(["a", "bb", "日本", ""])
            names.add(name)
            m["names"].append(name)
            tags.put(name, m["count"])
            m["tags"][name] = m["count"]
        backend.end()
        stamps = [rng.randrange(10**6) for _ in keys]
        timers.apply(EVENT, kgs, rows, [[(ts, True)] for ts in stamps])
        for k, ts in zip(keys, stamps):
            model[k]["timers"].add(ts)
    return model


def _rows_of(table: KeyedTable) -> dict:
    state = read_state(table)
    return {r["key"]: (r["count"], r["names"], r["tags"]) for r in state.to_pylist()}


def _timers(table: KeyedTable) -> list:
    """Every pending event-time timer (popping them all)."""
    return sorted(TimerStore(table).pop_due(EVENT, np.arange(MAXP), 10**9)[0].tolist())


@pytest.mark.parametrize("key_kind", ["int", "str"])
def test_restored_arena_equals_the_snapshotted_one(shm_prefix, tmp_path, key_kind):
    source = Arena.create(shm_prefix, MAXP)
    target = Arena.create(shm_prefix, MAXP)
    try:
        model = _fill(source, key_kind, random.Random(7))
        table = KeyedTable(source)
        # two "instances" own alternate halves of the key groups; each writes its own file
        sizes = [
            snapshot_key_groups(table, range(0, MAXP, 2), tmp_path / "even.arrow"),
            snapshot_key_groups(table, range(1, MAXP, 2), tmp_path / "odd.arrow"),
        ]
        assert all(s > 0 for s in sizes)
        expected_rows, expected_timers = _rows_of(table), _timers(table)
        prepare_arena(target, describe_arena(source))
        restored = restore_key_groups(target, tmp_path / "even.arrow") + restore_key_groups(
            target, tmp_path / "odd.arrow"
        )
        assert restored == int(np.count_nonzero(table.headers[:, 1]))
        copy = KeyedTable(target)
        got = _rows_of(copy)
        assert got == expected_rows
        assert {k: v[0] for k, v in got.items()} == {k: m["count"] for k, m in model.items()}
        assert {k: v[1] for k, v in got.items()} == {k: m["names"] for k, m in model.items()}
        assert _timers(copy) == expected_timers == sorted(t for m in model.values() for t in m["timers"])
        # the restored state keeps working: new keys and more values go in as usual
        _fill(target, key_kind, random.Random(8))
        assert len(read_state(copy)) >= len(model)
    finally:
        source.close()
        target.close()


def test_key_groups_move_between_two_live_arenas(shm_prefix):
    """A node hands key groups to another: copied out, released at the source, loaded into a target
    that holds other key groups; together the two hold exactly what the source held, timers too."""
    source = Arena.create(shm_prefix, MAXP)
    target = Arena.create(shm_prefix, MAXP)
    try:
        model = _fill(source, "str", random.Random(3))
        src = KeyedTable(source)
        before_rows = _rows_of(src)
        moving = list(range(0, MAXP, 3))
        # the target is live: it already holds the key groups it owns (none of the moving ones)
        prepare_arena(target, describe_arena(source))
        staying = [kg for kg in range(MAXP) if kg not in moving]
        load_key_groups(target, [])  # nothing: nothing changes
        batches = copy_key_groups(src, moving)
        release_key_groups(src, moving)
        assert not src.headers[moving, 1].any()  # the source forgot them
        loaded = load_key_groups(target, batches)
        assert loaded == sum(1 for b in batches for w in b.column(1).to_pylist() if w < 0)
        dst = KeyedTable(target)
        moved_rows, kept_rows = _rows_of(dst), _rows_of(src)
        assert not set(moved_rows) & set(kept_rows)
        assert {**moved_rows, **kept_rows} == before_rows
        assert kept_rows.keys() == {
            k for k in before_rows if key_groups_of(pa.array([k]), MAXP)[0] in staying
        }
        with pytest.raises(ValueError, match="already holds keys"):
            load_key_groups(target, batches)  # loading over keys would corrupt them
        assert sorted(_timers(dst) + _timers(src)) == sorted(t for m in model.values() for t in m["timers"])
    finally:
        source.close()
        target.close()


def test_key_groups_stay_away_while_they_load_and_after_they_are_released(shm_prefix):
    """A node marks the key groups it does not hold as away, so that its instances' timers, windows
    and checkpoints, and queryable reads, leave them alone: a load keeps them away (the node says
    when they are here: at adoption), a release leaves them away."""
    source = Arena.create(shm_prefix, MAXP)
    target = Arena.create(shm_prefix, MAXP)
    try:
        model = _fill(source, "int", random.Random(11))
        src, dst = KeyedTable(source), KeyedTable(target)
        prepare_arena(target, describe_arena(source))
        moving = np.arange(1, MAXP, 4, dtype=np.int64)
        everything = np.arange(MAXP, dtype=np.int64)
        dst.set_away(moving, True)  # the target does not own them yet
        src.set_away(moving, True)  # the source stops firing them at its barrier
        batches = copy_key_groups(src, moving)
        release_key_groups(src, moving)
        load_key_groups(target, batches)
        assert set(dst.here(everything).tolist()) == set(everything.tolist()) - set(moving.tolist())
        assert set(src.here(everything).tolist()) == set(everything.tolist()) - set(moving.tolist())
        assert not read_state(dst).num_rows  # loading: not to be read yet
        assert sorted(TimerStore(dst).pop_due(EVENT, dst.here(everything), 10**9)[0].tolist()) == []
        dst.set_away(moving, False)  # adopted
        state = pa.concat_tables([read_state(dst), read_state(src)])
        counts = dict(zip(state.column("key").to_pylist(), state.column("count").to_pylist()))
        assert counts == {k: m["count"] for k, m in model.items()}
        moved = {k for k in model if key_groups_of(pa.array([k]), MAXP)[0] in set(moving.tolist())}
        assert sorted(_timers(dst)) == sorted(t for k in moved for t in model[k]["timers"])
    finally:
        source.close()
        target.close()


def test_a_move_leaves_queryable_readers_a_settled_version_while_instances_write(shm_prefix):
    """The instances of both nodes mark every key group they own as being written around each
    batch (an odd seqlock version), also the ones moving: a copy taken, released or loaded inside
    such a write must not leave a version odd for good, or queryable reads would never settle."""
    source = Arena.create(shm_prefix, MAXP)
    target = Arena.create(shm_prefix, MAXP)
    try:
        model = _fill(source, "int", random.Random(5))
        src, dst = KeyedTable(source), KeyedTable(target)
        prepare_arena(target, describe_arena(source))
        moving = np.arange(0, MAXP, 2, dtype=np.int64)
        everything = np.arange(MAXP, dtype=np.int64)
        src.begin_write(everything)  # the source's instance is inside a batch of other key groups
        batches = copy_key_groups(src, moving)
        release_key_groups(src, moving)
        dst.begin_write(everything)  # and so is the target's, while the key groups load
        load_key_groups(target, batches)
        dst.end_write(everything)
        src.end_write(everything)
        assert not (src.headers[:, 0] % 2).any() and not (dst.headers[:, 0] % 2).any()
        state = pa.concat_tables([read_state(dst), read_state(src)])  # retries only while odd
        counts = dict(zip(state.column("key").to_pylist(), state.column("count").to_pylist()))
        assert counts == {k: m["count"] for k, m in model.items()}
    finally:
        source.close()
        target.close()
