"""KeyedTable against plain-Python references: key index, fixed columns, running aggregates, var values.

Every test drives the table with many seeded random batches and compares the table with a dict
after each one. Lookups that could crash the process (a kernel reading outside the arena) run in a
forked child, so that a crash fails one test instead of killing the test run.
"""

from __future__ import annotations

import os
import pickle
import random
import signal

import numpy as np
import pyarrow as pa
import pytest

from stretch.state import _table_kernels as K
from stretch.state.arena import Arena
from stretch.state.key_codec import encode_key
from stretch.state.key_groups import key_groups_of, key_groups_of_keys
from stretch.state.keyed_table import KeyedTable, KeyMode

MAXP = 128


@pytest.fixture
def table(shm_prefix):
    arena = Arena.create(shm_prefix, MAXP)
    yield KeyedTable(arena)
    arena.close()


def _in_child(fn):
    """Run ``fn()`` in a forked child (sharing the arena mapping) and return its result.

    A crash of the child (e.g. SIGSEGV) becomes a test failure naming the signal.
    """
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 0
        try:
            os.close(rfd)
            try:
                payload = pickle.dumps(("ok", fn()))
            except BaseException as e:
                payload = pickle.dumps(("error", repr(e)))
            with os.fdopen(wfd, "wb") as f:
                f.write(payload)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        pytest.fail(f"the lookup crashed the process with {signal.Signals(sig).name}", pytrace=False)
    assert os.WEXITSTATUS(status) == 0 and data, "child failed without a result"
    kind, value = pickle.loads(data)
    if kind == "error":
        pytest.fail(f"the lookup raised {value}", pytrace=False)
    return value


class KeyRef:
    """Reference key index: per key group, key -> row, rows handed out in order of first sight."""

    def __init__(self):
        self.rows: list[dict] = [{} for _ in range(MAXP)]
        self.order: list[list] = [[] for _ in range(MAXP)]

    def locate(self, kgs, keys, insert=True) -> np.ndarray:
        out = np.empty(len(keys), dtype=np.int64)
        for i, (kg, key) in enumerate(zip(kgs.tolist(), keys)):
            d = self.rows[kg]
            row = d.get(key)
            if row is None:
                if insert:
                    row = d[key] = len(d)
                    self.order[kg].append(key)
                else:
                    row = -1
            out[i] = row
        return out


def _draw_batches(universe: list, n_batches: int, batch_size: int, seed: int):
    """Batches that introduce the universe's keys in order, mixed with repeats of earlier keys."""
    rng = random.Random(seed)
    per_batch = -(-len(universe) // n_batches)
    for b in range(n_batches):
        fresh = universe[b * per_batch : (b + 1) * per_batch]
        seen = universe[: b * per_batch]
        old = [rng.choice(seen) for _ in range(batch_size - len(fresh))] if seen else []
        dups = [rng.choice(fresh) for _ in range(len(fresh) // 10)] if fresh else []
        batch = fresh + old + dups
        rng.shuffle(batch)
        yield batch


def _check_keys(table: KeyedTable, ref: KeyRef, decode=lambda k: k) -> None:
    for kg in range(MAXP):
        assert table.n_keys(kg) == len(ref.order[kg]), f"key group {kg}"
        assert table.keys_of(kg) == [decode(k) for k in ref.order[kg]], f"key group {kg}"
        keys = table.key_array(kg)  # the same keys as one Arrow array, or None where stored canonically
        if table.mode() is KeyMode.CANONICAL:
            assert keys is None
        else:
            keys.validate(full=True)
            assert keys.to_pylist() == [decode(k) for k in ref.order[kg]], f"key group {kg}"


# ---- key index ----------------------------------------------------------------------------


def test_int64_keys_with_growth_match_a_dict(table):
    rng = np.random.default_rng(1)
    special = [0, -1, 1, 2**63 - 1, -(2**63), 2**32, -(2**31)]
    universe = np.unique(rng.integers(-(2**63), 2**63 - 1, size=200_200, dtype=np.int64))
    universe = [*special, *(int(k) for k in universe if int(k) not in special)][:200_000]
    random.Random(2).shuffle(universe)
    ref = KeyRef()
    for b, batch in enumerate(_draw_batches(universe, 20, 16_000, seed=3)):
        arr = np.array(batch, dtype=np.int64)
        kgs = key_groups_of(arr, MAXP)
        keys = arr if b % 2 else pa.array(arr)  # numpy and Arrow key columns
        rows = table.rows(kgs, keys, KeyMode.INT64)
        np.testing.assert_array_equal(rows, ref.locate(kgs, batch), err_msg=f"batch {b}")
    assert sum(table.n_keys(kg) for kg in range(MAXP)) == 200_000
    _check_keys(table, ref)
    # Rows are stable: looking every key up again (without inserting) gives the same rows.
    arr = np.array(universe, dtype=np.int64)
    kgs = key_groups_of(arr, MAXP)
    np.testing.assert_array_equal(
        table.rows(kgs, arr, KeyMode.INT64, insert=False), ref.locate(kgs, universe)
    )


def test_narrow_int_key_columns_are_widened(table):
    keys = pa.array([5, -7, 5, 300], pa.int32())
    kgs = key_groups_of(keys, MAXP)
    rows = table.rows(kgs, keys, KeyMode.INT64)
    wide = pa.array([5, -7, 5, 300], pa.int64())
    np.testing.assert_array_equal(table.rows(key_groups_of(wide, MAXP), wide, KeyMode.INT64), rows)
    assert rows[0] == rows[2]


def _string_universe(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    special = ["", " ", "a", "ab", "abc", "é", "日本語", "\u0000", "k" * 700, "k" * 701, "emoji 🎉"]
    alphabet = "abcdefghijklmnopqrstuvwxyzäöü€日本"
    out = dict.fromkeys(special)
    i = 0
    while len(out) < n:
        length = rng.choice((1, 3, 8, 12, 20, 60)) if i % 1000 else rng.randrange(100, 900)
        out.setdefault("".join(rng.choice(alphabet) for _ in range(length)) + str(i))
        i += 1
    keys = list(out)
    rng.shuffle(keys)
    return keys


def test_string_keys_with_growth_match_a_dict(table):
    universe = _string_universe(200_000, seed=4)
    ref = KeyRef()
    for b, batch in enumerate(_draw_batches(universe, 20, 16_000, seed=5)):
        arr = pa.array(batch, pa.large_string() if b % 2 else pa.string())
        kgs = key_groups_of(arr, MAXP)
        rows = table.rows(kgs, arr, KeyMode.UTF8)
        np.testing.assert_array_equal(rows, ref.locate(kgs, batch), err_msg=f"batch {b}")
    _check_keys(table, ref)
    arr = pa.array(universe)
    kgs = key_groups_of(arr, MAXP)
    np.testing.assert_array_equal(table.rows(kgs, arr, KeyMode.UTF8, insert=False), ref.locate(kgs, universe))


def test_binary_keys_match_a_dict(table):
    rng = random.Random(6)
    universe = list(
        dict.fromkeys(
            [b"", b"\x00", b"\x00\x00", b"\xff" * 33]
            + [rng.randbytes(rng.choice((1, 2, 7, 8, 9, 31, 200))) for _ in range(30_000)]
        )
    )
    ref = KeyRef()
    for b, batch in enumerate(_draw_batches(universe, 6, 8_000, seed=7)):
        arr = pa.array(batch, pa.binary() if b % 2 else pa.large_binary())
        kgs = key_groups_of(arr, MAXP)
        rows = table.rows(kgs, arr, KeyMode.BINARY)
        np.testing.assert_array_equal(rows, ref.locate(kgs, batch), err_msg=f"batch {b}")
    _check_keys(table, ref)


def test_canonical_keys_match_a_dict(table):
    rng = random.Random(8)
    universe = list(
        dict.fromkeys(
            [
                None,
                (),
                (1,),
                (1, "a"),
                ("a", 1),
                2**70,
                -(2**65),
                1.5,
                0.0,
                -2.5e300,
                "s",
                b"b",
                (None, (2.0, b"")),
            ]
            + [(rng.randrange(100), f"u{rng.randrange(300)}") for _ in range(3000)]
            + [rng.uniform(-1e6, 1e6) for _ in range(2000)]
            + [rng.randrange(-(2**40), 2**40) for _ in range(2000)]
        )
    )
    encoded = {k: encode_key(k) for k in universe}
    ref = KeyRef()
    for b, batch in enumerate(_draw_batches(universe, 5, 4000, seed=9)):
        arr = pa.array([encoded[k] for k in batch], pa.large_binary())
        kgs = key_groups_of_keys(batch, MAXP)
        rows = table.rows(kgs, arr, KeyMode.CANONICAL)
        np.testing.assert_array_equal(
            rows, ref.locate(kgs, [encoded[k] for k in batch]), err_msg=f"batch {b}"
        )
    by_bytes = {v: k for k, v in encoded.items()}
    _check_keys(table, ref, decode=by_bytes.__getitem__)
    # Keys equal in Python are one key: True is 1, -0.0 is 0.0.
    same = [1, True, 0.0, -0.0]
    arr = pa.array([encode_key(k) for k in same], pa.large_binary())
    rows = table.rows(key_groups_of_keys(same, MAXP), arr, KeyMode.CANONICAL)
    assert rows[0] == rows[1] and rows[2] == rows[3]


def test_lookup_without_insert_gives_minus_one_for_absent_keys(table):
    rng = np.random.default_rng(10)
    present = np.unique(rng.integers(-(10**12), 10**12, size=20_000))
    table.rows(key_groups_of(present, MAXP), present, KeyMode.INT64)
    assert all(table.n_keys(kg) > 0 for kg in range(MAXP))  # every key group has a populated index
    absent = np.setdiff1d(rng.integers(-(10**12), 10**12, size=5_000), present)
    query = rng.permutation(np.concatenate([present[:5_000], absent]))
    ref = KeyRef()
    ref.locate(key_groups_of(present, MAXP), present.tolist())
    kgs = key_groups_of(query, MAXP)
    rows = _in_child(lambda: table.rows(kgs, query, KeyMode.INT64, insert=False))
    np.testing.assert_array_equal(rows, ref.locate(kgs, query.tolist(), insert=False))
    assert (rows == -1).sum() == len(absent)
    assert sum(table.n_keys(kg) for kg in range(MAXP)) == len(present), "lookups inserted nothing"


@pytest.mark.parametrize("mode", [KeyMode.INT64, KeyMode.UTF8], ids=["int64", "utf8"])
def test_lookup_without_insert_in_key_groups_that_never_held_a_key(table, mode):
    """Absent keys of key groups without any key yet (e.g. a fresh operator) are -1, not a crash."""
    if mode is KeyMode.INT64:
        keys = np.arange(1, 200, dtype=np.int64)
        first = keys[:3]
    else:
        keys = pa.array([f"key{i}" for i in range(1, 200)])
        first = keys.slice(0, 3)
    first_rows = table.rows(key_groups_of(first, MAXP), first, mode)  # a few key groups get an index
    kgs = key_groups_of(keys, MAXP)
    assert len(set(kgs.tolist())) > 3, "some key groups queried never held a key"
    rows = _in_child(lambda: table.rows(kgs, keys, mode, insert=False))
    np.testing.assert_array_equal(rows[:3], first_rows)
    assert (rows[3:] == -1).all()


def test_string_lookup_without_insert_gives_minus_one_for_absent_keys(table):
    present = pa.array([f"s{i}" for i in range(0, 20_000, 2)])
    table.rows(key_groups_of(present, MAXP), present, KeyMode.UTF8)
    assert all(table.n_keys(kg) > 0 for kg in range(MAXP))
    query = pa.array([f"s{i}" for i in range(0, 4000)] + ["", "s", "s00"])
    ref = KeyRef()
    ref.locate(key_groups_of(present, MAXP), present.to_pylist())
    kgs = key_groups_of(query, MAXP)
    rows = _in_child(lambda: table.rows(kgs, query, KeyMode.UTF8, insert=False))
    np.testing.assert_array_equal(rows, ref.locate(kgs, query.to_pylist(), insert=False))
    assert (rows == -1).sum() == 2000 + 3


def test_one_key_type_per_operator(table):
    keys = np.array([1, 2, 3], dtype=np.int64)
    table.rows(key_groups_of(keys, MAXP), keys, KeyMode.INT64)
    s = pa.array(["a"])
    with pytest.raises(TypeError, match="int64"):
        table.rows(key_groups_of(s, MAXP), s, KeyMode.UTF8)


# ---- fixed-width columns ------------------------------------------------------------------


def _int_keys(table, keys, insert=True):
    arr = np.asarray(keys, dtype=np.int64)
    kgs = key_groups_of(arr, MAXP)
    return kgs, table.rows(kgs, arr, KeyMode.INT64, insert)


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.int32, np.float32, np.int16, np.int8, np.uint8])
def test_gather_scatter_with_validity(table, dtype):
    rng = np.random.default_rng(11)
    sid = table.arena.register_state(
        {"name": "v", "kind": "value", "storage": np.dtype(dtype).name, "type": None}
    )
    ref: dict[int, object] = {}
    n_keys = 0
    for b in range(12):
        n_keys += 500  # new keys every batch: the key table and then the column grow
        all_keys = np.arange(n_keys, dtype=np.int64) * 7919
        kgs, rows = _int_keys(table, all_keys)
        pick = rng.choice(n_keys, size=300, replace=False)
        if np.dtype(dtype).kind == "f":
            values = rng.normal(0, 1e6, size=300).astype(dtype)
        else:
            info = np.iinfo(dtype)
            values = rng.integers(info.min, info.max, size=300, endpoint=True, dtype=dtype)
        valid = (rng.random(300) < 0.8).astype(np.uint8)
        table.scatter(sid, dtype, kgs[pick], rows[pick], values, valid)
        for k, v, ok in zip(pick.tolist(), values.tolist(), valid.tolist()):
            ref[k] = v if ok else None
        out, got_valid = table.gather(sid, dtype, kgs, rows)
        assert out.dtype == np.dtype(dtype)
        expected_valid = np.array([ref.get(k) is not None for k in range(n_keys)], dtype=np.uint8)
        np.testing.assert_array_equal(got_valid, expected_valid, err_msg=f"batch {b}")
        idx = np.flatnonzero(expected_valid)
        expected = np.array([ref[k] for k in idx.tolist()], dtype=dtype)
        np.testing.assert_array_equal(out[idx], expected, err_msg=f"batch {b}")


@pytest.mark.parametrize("dtype", [np.int64, np.float64])
@pytest.mark.parametrize(
    ("op", "fold"), [(0, lambda a, v: a + v), (1, min), (2, max)], ids=["sum", "min", "max"]
)
def test_rolling_records_match_a_python_fold(table, dtype, op, fold):
    """The record fold used by rolling sum/min/max (one accumulated field per key here)."""
    rng = np.random.default_rng(12 + op)
    is_float = dtype is np.float64
    entry = {
        "name": "rolling",
        "kind": "record",
        "storage": "words",
        "type": None,
        "fields": [{"name": "v", "float": is_float, "acc": True}],
    }
    sid = table.arena.register_state(entry)
    acc: dict[int, object] = {}
    universe = rng.choice(10**9, size=6000, replace=False)
    for b in range(10):
        keys = rng.choice(universe[: 600 * (b + 1)], size=4000)  # repeats within and across batches
        kgs, rows = _int_keys(table, keys)
        if dtype is np.int64:
            values = rng.integers(-(10**9), 10**9, size=4000, dtype=np.int64)
        else:
            values = rng.normal(0, 1e3, size=4000)
        table.ensure_columns(sid, np.unique(kgs), 8)
        vals = values.view(np.int64).reshape(1, -1).copy()
        res = np.empty_like(vals)
        a = table.arena
        K.rolling_records(
            a.a64,
            a.a8,
            a.views[np.dtype(np.float64)][0],
            a.state_base_w(sid),
            kgs,
            rows,
            vals,
            np.array([is_float]),
            np.array([True]),
            op,
            res,
        )
        out = res[0].view(dtype)
        expected = []
        for k, v in zip(keys.tolist(), values.tolist()):
            acc[k] = v if k not in acc else fold(acc[k], v)
            expected.append(acc[k])
        np.testing.assert_array_equal(out, np.array(expected, dtype=dtype), err_msg=f"batch {b}")
    keys = np.array(sorted(acc), dtype=np.int64)
    kgs, rows = _int_keys(table, keys, insert=False)
    final, valid = table.gather(sid, np.dtype(np.int64), kgs, rows)  # a one-word record
    assert valid.all()
    np.testing.assert_array_equal(final.view(dtype), np.array([acc[k] for k in keys.tolist()], dtype=dtype))


# ---- variable-length values ---------------------------------------------------------------


def _register_var(table, name="var") -> int:
    return table.arena.register_state({"name": name, "kind": "value", "storage": "var", "type": None})


def _read_all(table, sid, kgs, rows) -> list:
    return [None if v is None else bytes(v) for v in table.read_var(sid, kgs, rows)]


def _heap_words(table, sid) -> np.ndarray:
    return table._state_words(sid)[:, [K.S_HEAP_OFF, K.S_HEAP_USED, K.S_HEAP_CAP, K.S_HEAP_GARBAGE]].copy()


def test_var_values_with_clear_rewrite_growth_and_appends_match_a_dict(table):
    rng = random.Random(13)
    sid = _register_var(table)
    n_keys = 1500
    all_keys = np.arange(n_keys, dtype=np.int64) * 104729 - 5000
    ref: dict[int, bytes | None] = {}
    relocations = 0
    before = _heap_words(table, sid)
    for b in range(60):
        kgs, rows = _int_keys(table, all_keys)
        pick = rng.sample(range(n_keys), 400)  # distinct keys per write, as the backend writes
        payloads, appends = [], []
        for k in pick:
            op = rng.random()
            if op < 0.1:
                payloads.append(None)  # clear
                appends.append(rng.random() < 0.5)
            elif op < 0.5:
                payloads.append(rng.randbytes(rng.randrange(1, 60)))
                appends.append(True)
            else:
                big = rng.random() < 0.1
                payloads.append(rng.randbytes(rng.randrange(1000, 4000) if big else rng.randrange(0, 300)))
                appends.append(False)
        idx = np.array(pick)
        table.write_var(sid, kgs[idx], rows[idx], payloads, np.array(appends, dtype=np.bool_))
        for k, p, app in zip(pick, payloads, appends):
            if p is None:
                ref[k] = None
            elif app and ref.get(k):
                ref[k] = ref[k] + p
            else:
                ref[k] = p
        got = _read_all(table, sid, kgs, rows)
        for k in range(n_keys):
            assert got[k] == ref.get(k), f"batch {b}, key {all_keys[k]}"
        after = _heap_words(table, sid)
        relocations += int((after[:, 0] != before[:, 0]).sum())
        before = after
    assert relocations > MAXP, "the churn moved (and compacted) heaps many times"


def test_var_rewrite_in_place_and_growth(table):
    sid = _register_var(table)
    kgs, rows = _int_keys(table, [42])
    kg = int(kgs[0])
    table.write_var(sid, kgs, rows, [b"a" * 100])
    used = int(table._state_words(sid)[kg, K.S_HEAP_USED])
    table.write_var(sid, kgs, rows, [b"b" * 50])
    assert _read_all(table, sid, kgs, rows) == [b"b" * 50]
    table.write_var(sid, kgs, rows, [b"c" * 128])
    assert _read_all(table, sid, kgs, rows) == [b"c" * 128]
    assert int(table._state_words(sid)[kg, K.S_HEAP_USED]) == used, (
        "128 bytes fit the value's 128-byte allocation, which a shorter value did not shrink: "
        "rewrite in place instead of abandoning it (and counting only 64 bytes of it as garbage)"
    )
    table.write_var(sid, kgs, rows, [b""])
    assert _read_all(table, sid, kgs, rows) == [b""], "an empty value is a value, not None"
    table.write_var(sid, kgs, rows, [b"d" * 10_000])  # beyond the allocation and the 4 KiB heap
    assert _read_all(table, sid, kgs, rows) == [b"d" * 10_000]
    table.write_var(sid, kgs, rows, [None])
    assert _read_all(table, sid, kgs, rows) == [None]


def test_var_appends_accumulate_across_allocation_boundaries(table):
    sid = _register_var(table)
    keys = [1, 2, 3]
    kgs, rows = _int_keys(table, keys)
    expected = {k: b"" for k in keys}
    table.write_var(sid, kgs[:1], rows[:1], [b""])  # key 1 starts empty, 2 and 3 unset
    for i in range(700):
        chunk = bytes([i % 251]) * (1 + i % 13)
        table.write_var(sid, kgs, rows, [chunk, chunk, chunk], np.ones(3, dtype=np.bool_))
        for k in keys:
            expected[k] += chunk
        if i % 97 == 0:
            assert _read_all(table, sid, kgs, rows) == [expected[k] for k in keys]
    assert _read_all(table, sid, kgs, rows) == [expected[k] for k in keys]
    # A plain write after appends replaces the whole value.
    table.write_var(sid, kgs, rows, [b"x", None, b"yz"], np.zeros(3, dtype=np.bool_))
    assert _read_all(table, sid, kgs, rows) == [b"x", None, b"yz"]


def test_unset_var_values_read_as_none(table):
    sid = _register_var(table)
    kgs, rows = _int_keys(table, range(100))
    assert _read_all(table, sid, kgs, rows) == [None] * 100
    table.write_var(sid, kgs[:1], rows[:1], [b"v"])
    more_kgs, more_rows = _int_keys(table, range(100, 5000))  # rows beyond the column's capacity
    assert _read_all(table, sid, more_kgs, more_rows) == [None] * 4900


def test_resident_bytes_track_live_data_after_heavy_churn(table):
    rng = random.Random(14)
    sid = _register_var(table)
    n_keys = 2000
    kgs, rows = _int_keys(table, np.arange(n_keys) * 31)
    table.write_var(sid, kgs, rows, [b"\0"] * n_keys)
    baseline = table.arena.resident_bytes()
    written = 0
    for _ in range(80):
        payloads = [rng.randbytes(rng.randrange(200, 1200)) for _ in range(n_keys)]
        written += sum(map(len, payloads))
        table.write_var(sid, kgs, rows, payloads)
    live = sum(map(len, payloads))
    assert _read_all(table, sid, kgs, rows) == payloads
    grown = table.arena.resident_bytes() - baseline
    assert written > 60 * live
    assert grown <= 8 * live + (4 << 20), (
        f"{grown} resident bytes for {live} live bytes after writing {written} bytes"
    )


def test_a_read_a_write_tore_is_retried_even_when_it_failed(table):
    """A seqlock read that a writer tore may raise (the data changed under it): it is retried like
    one that returned; a read that fails with no write meanwhile raises its own error."""
    kgs = np.array([5], dtype=np.int64)
    calls = []

    def torn_once():
        calls.append(1)
        if len(calls) == 1:  # a writer comes and goes while the first attempt reads
            table.begin_write(kgs)
            table.end_write(kgs)
            raise ValueError("operands could not be broadcast together")
        return "read"

    assert table.stable_read(5, torn_once) == "read" and len(calls) == 2

    def broken():
        raise KeyError("not a torn read")

    with pytest.raises(KeyError):
        table.stable_read(5, broken)
