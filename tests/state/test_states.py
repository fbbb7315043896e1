"""PyFlink keyed states over shared-memory tables, driven batch by batch like an operator instance does.

Each test feeds seeded random batches of keys through ``KeyedStateBackend`` (one ``begin`` per batch
with one entry per distinct key, ``current`` set per record, ``end`` to write back), applies random
operations to the states and the same operations to a plain dict model, checks every read against
the model as it happens, and after every batch reads every key back in a fresh batch.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pyarrow as pa
import pytest

from stretch.common.typeinfo import Types, type_expr
from stretch.datastream.functions import AggregateFunction, ReduceFunction
from stretch.datastream.state import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from stretch.state.arena import Arena
from stretch.state.backend import KeyedStateBackend
from stretch.state.key_groups import key_groups_of
from stretch.state.keyed_table import KeyedTable, KeyMode
from stretch.state.states import StateTypeError

MAXP = 128


class Driver:
    """Runs batches through a backend the way a keyed operator does."""

    def __init__(self, arena: Arena, key_kind: str = "int"):
        self.table = KeyedTable(arena)
        self.backend = KeyedStateBackend(self.table)
        self.key_kind = key_kind
        self.seen: dict = {}

    def _locate(self, keys: list):
        if self.key_kind == "int":
            arr = np.array(keys, dtype=np.int64)
            mode = KeyMode.INT64
        else:
            arr = pa.array(keys, pa.string())
            mode = KeyMode.UTF8
        kgs = key_groups_of(arr, MAXP)
        return kgs, self.table.rows(kgs, arr, mode)

    @contextlib.contextmanager
    def batch(self, keys: list):
        """Begin a batch of these records' keys; yields key -> slot; ends (writes back) on exit."""
        distinct = list(dict.fromkeys(keys))
        kgs, rows = self._locate(distinct)
        self.backend.begin(kgs, rows, distinct)
        self.seen.update(dict.fromkeys(distinct))
        yield {k: i for i, k in enumerate(distinct)}
        self.backend.end()

    def each(self, keys: list):
        """Run a batch, yielding each record's key with ``current`` set to it."""
        with self.batch(keys) as slot:
            for k in keys:
                self.backend.current = slot[k]
                assert self.backend.current_key() == k
                yield k

    def verify(self, check, extra_keys=()) -> None:
        """Read every key seen so far (and some never seen) in a fresh batch: ``check(key)``."""
        keys = list(self.seen) + [k for k in extra_keys if k not in self.seen]
        with self.batch(keys) as slot:
            for k in keys:
                self.backend.current = slot[k]
                check(k)


@pytest.fixture
def arena(shm_prefix):
    a = Arena.create(shm_prefix, MAXP)
    yield a
    a.close()


def _key_batches(rng: random.Random, n_batches: int, size: int, pool: int):
    for b in range(n_batches):
        hi = min(pool, 40 + b * pool // n_batches)  # the key population grows over the batches
        yield [rng.randrange(-hi, hi) * 7919 for _ in range(size)]


# ---- ValueState ---------------------------------------------------------------------------


def _rand_str(rng: random.Random) -> str:
    return "".join(rng.choice("ab€日 \u00e9xyz") for _ in range(rng.choice((0, 1, 3, 10, 40, 300))))


VALUE_TYPES = {
    "long": (Types.LONG(), lambda r: r.choice((0, -1, 2**63 - 1, -(2**63), r.randrange(-(2**63), 2**63)))),
    "double": (Types.DOUBLE(), lambda r: r.choice((0.0, -1.5, float("inf"), r.uniform(-1e300, 1e300)))),
    "boolean": (Types.BOOLEAN(), lambda r: r.random() < 0.5),
    "string": (Types.STRING(), _rand_str),
    "pickled": (
        Types.PICKLED_BYTE_ARRAY(),
        lambda r: (r.randrange(100), _rand_str(r), [r.random()] * r.randrange(3)),
    ),
}


@pytest.mark.parametrize("type_name", list(VALUE_TYPES))
def test_value_state_matches_a_dict(arena, type_name):
    type_info, gen = VALUE_TYPES[type_name]
    rng = random.Random(list(VALUE_TYPES).index(type_name))
    d = Driver(arena)
    st = d.backend.state(ValueStateDescriptor("v", type_info))
    model: dict = {}
    for keys in _key_batches(rng, 30, 200, 300):
        for k in d.each(keys):
            op = rng.random()
            if op < 0.45:
                v = gen(rng)
                st.update(v)
                model[k] = v
            elif op < 0.55:
                st.clear()
                model.pop(k, None)
            elif op < 0.6:
                st.update(None)
                model.pop(k, None)
            else:
                assert st.value() == model.get(k)
        d.verify(lambda k: _eq(st.value(), model.get(k), k), extra_keys=[10**12])


def _eq(got, expected, key) -> None:
    assert got == expected, f"key {key!r}: state has {got!r}, model has {expected!r}"
    assert type(got) is type(expected), f"key {key!r}: {type(got)} vs {type(expected)}"


# ---- ListState ----------------------------------------------------------------------------

LIST_TYPES = {
    "int": (Types.INT(), lambda r: r.choice((0, -1, 2**31 - 1, -(2**31), r.randrange(-1000, 1000)))),
    "string": (Types.STRING(), _rand_str),
}


@pytest.mark.parametrize("type_name", list(LIST_TYPES))
def test_list_state_appends_across_batches_without_loading(arena, type_name):
    """Batches that only add: the stored lists grow by appends, never read back by the batch."""
    elem_type, gen = LIST_TYPES[type_name]
    rng = random.Random(20 + len(type_name))
    d = Driver(arena)
    st = d.backend.state(ListStateDescriptor("l", elem_type))
    model: dict = {}
    for keys in _key_batches(rng, 25, 200, 200):
        for k in d.each(keys):
            if rng.random() < 0.7:
                v = gen(rng)
                st.add(v)
                model.setdefault(k, []).append(v)
            else:
                vs = [gen(rng) for _ in range(rng.randrange(0, 4))]
                st.add_all(vs)
                model.setdefault(k, []).extend(vs)
        d.verify(lambda k: _eq(st.get(), model.get(k, []), k))


@pytest.mark.parametrize("type_name", list(LIST_TYPES))
def test_list_state_matches_a_dict(arena, type_name):
    elem_type, gen = LIST_TYPES[type_name]
    rng = random.Random(30 + len(type_name))
    d = Driver(arena)
    st = d.backend.state(ListStateDescriptor("l", elem_type))
    model: dict = {}
    for keys in _key_batches(rng, 30, 200, 150):
        for k in d.each(keys):
            op = rng.random()
            lst = model.setdefault(k, [])
            if op < 0.4:
                v = gen(rng)
                st.add(v)
                lst.append(v)
            elif op < 0.55:
                vs = [gen(rng) for _ in range(rng.randrange(0, 5))]
                st.add_all(vs)
                lst.extend(vs)
            elif op < 0.65:
                vs = [gen(rng) for _ in range(rng.randrange(0, 5))]
                st.update(vs)
                model[k] = list(vs)
            elif op < 0.7:
                st.clear()
                model[k] = []
            else:
                assert st.get() == lst, f"key {k}"
                assert list(st) == lst
        d.verify(lambda k: _eq(st.get(), model.get(k, []), k))


@pytest.mark.parametrize("replace", ["update", "clear"])
def test_list_state_update_after_add_in_one_batch_replaces_the_list(arena, replace):
    d = Driver(arena)
    st = d.backend.state(ListStateDescriptor("l", Types.INT()))
    for _ in d.each([1]):
        st.add_all([1, 2])
    for _ in d.each([1]):
        st.add(3)  # not loaded: kept as a pending append
        if replace == "update":
            st.update([9])
        else:
            st.clear()
        assert st.get() == ([9] if replace == "update" else [])
    d.verify(lambda k: _eq(st.get(), [9] if replace == "update" else [], k))


# ---- MapState -----------------------------------------------------------------------------


def test_map_state_matches_a_dict(arena):
    rng = random.Random(40)
    d = Driver(arena)
    st = d.backend.state(MapStateDescriptor("m", Types.STRING(), Types.LONG()))
    model: dict = {}
    names = [f"f{i}" for i in range(12)] + ["", "é"]

    def check(k):
        m = model.get(k, {})
        assert dict(st.items()) == m, f"key {k}"
        assert sorted(st.keys()) == sorted(m)
        assert sorted(st.values()) == sorted(m.values())
        assert st.is_empty() == (not m)
        for name in names[:4]:
            assert st.contains(name) == (name in m)
            assert (name in st) == (name in m)
            assert st.get(name) == m.get(name)

    for keys in _key_batches(rng, 30, 200, 150):
        for k in d.each(keys):
            m = model.setdefault(k, {})
            op = rng.random()
            name = rng.choice(names)
            if op < 0.35:
                v = rng.randrange(-(2**63), 2**63)
                if rng.random() < 0.5:
                    st.put(name, v)
                else:
                    st[name] = v
                m[name] = v
            elif op < 0.45:
                more = {rng.choice(names): rng.randrange(1000) for _ in range(rng.randrange(0, 4))}
                st.put_all(more)
                m.update(more)
            elif op < 0.6:
                if rng.random() < 0.5:
                    st.remove(name)  # absent names are fine
                    m.pop(name, None)
                elif name in m:
                    del st[name]
                    del m[name]
            elif op < 0.65:
                st.clear()
                m.clear()
            else:
                check(k)
                assert st[name] == m.get(name)
                assert sorted(iter(st)) == sorted(m)
        d.verify(check, extra_keys=[10**12])


# ---- ReducingState and AggregatingState ---------------------------------------------------


class MaxLen(ReduceFunction):
    def reduce(self, a, b):
        return a if len(a) >= len(b) else b


@pytest.mark.parametrize(
    ("type_info", "fn", "gen"),
    [
        (Types.LONG(), lambda a, b: a + b, lambda r: r.randrange(-(10**12), 10**12)),
        (Types.STRING(), MaxLen(), _rand_str),
    ],
    ids=["sum-long", "reduce-function-string"],
)
def test_reducing_state_matches_a_dict(arena, type_info, fn, gen):
    rng = random.Random(50)
    reduce = fn.reduce if isinstance(fn, ReduceFunction) else fn
    d = Driver(arena)
    st = d.backend.state(ReducingStateDescriptor("r", fn, type_info))
    model: dict = {}
    for keys in _key_batches(rng, 30, 200, 200):
        for k in d.each(keys):
            op = rng.random()
            if op < 0.6:
                v = gen(rng)
                st.add(v)
                model[k] = v if k not in model else reduce(model[k], v)
            elif op < 0.68:
                st.clear()
                model.pop(k, None)
            else:
                assert st.get() == model.get(k)
        d.verify(lambda k: _eq(st.get(), model.get(k), k))


class Average(AggregateFunction):
    def create_accumulator(self):
        return (0, 0)

    def add(self, value, accumulator):
        return (accumulator[0] + value, accumulator[1] + 1)

    def get_result(self, accumulator):
        return accumulator[0] / accumulator[1]


def test_aggregating_state_matches_a_dict(arena):
    rng = random.Random(60)
    agg = Average()
    d = Driver(arena)
    st = d.backend.state(AggregatingStateDescriptor("a", agg, Types.TUPLE([Types.LONG(), Types.LONG()])))
    model: dict = {}
    for keys in _key_batches(rng, 30, 200, 200):
        for k in d.each(keys):
            op = rng.random()
            if op < 0.6:
                v = rng.randrange(-1000, 1000)
                st.add(v)
                model[k] = agg.add(v, model.get(k, agg.create_accumulator()))
            elif op < 0.68:
                st.clear()
                model.pop(k, None)
            else:
                assert st.get() == (None if k not in model else agg.get_result(model[k]))
        d.verify(lambda k: _eq(st.get(), None if k not in model else agg.get_result(model[k]), k))


# ---- many states, string keys, a second instance ------------------------------------------


def test_all_states_together_with_string_keys_and_a_second_instance(arena):
    rng = random.Random(70)
    d = Driver(arena, key_kind="str")
    b = d.backend
    count = b.state(ValueStateDescriptor("count", Types.LONG()))
    last = b.state(ValueStateDescriptor("last", Types.STRING()))
    hist = b.state(ListStateDescriptor("hist", Types.LONG()))
    tags = b.state(MapStateDescriptor("tags", Types.STRING(), Types.LONG()))
    total = b.state(ReducingStateDescriptor("total", lambda x, y: x + y, Types.LONG()))
    model: dict = {}
    for _ in range(20):
        keys = [f"user-{rng.randrange(150)}" for _ in range(300)]
        for k in d.each(keys):
            v = rng.randrange(100)
            tag = rng.choice("abc")
            count.update((count.value() or 0) + 1)
            last.update(tag)
            hist.add(v)
            tags.put(tag, v)
            total.add(v)
            m = model.setdefault(k, {"count": 0, "hist": [], "tags": {}, "total": 0})
            m["count"] += 1
            m["last"] = tag
            m["hist"].append(v)
            m["tags"][tag] = v
            m["total"] += v

    def check(states, k):
        count, last, hist, tags, total = states
        m = model[k]
        assert (count.value(), last.value(), hist.get(), dict(tags.items()), total.get()) == (
            m["count"],
            m["last"],
            m["hist"],
            m["tags"],
            m["total"],
        ), k

    d.verify(lambda k: check((count, last, hist, tags, total), k))
    # Another instance of the operator, with its own mapping of the arena, sees the same state.
    other = Driver(Arena.attach(arena.name), key_kind="str")
    try:
        ob = other.backend
        states = (
            ob.state(ValueStateDescriptor("count", Types.LONG())),
            ob.state(ValueStateDescriptor("last", Types.STRING())),
            ob.state(ListStateDescriptor("hist", Types.LONG())),
            ob.state(MapStateDescriptor("tags", Types.STRING(), Types.LONG())),
            ob.state(ReducingStateDescriptor("total", lambda x, y: x + y, Types.LONG())),
        )
        other.seen = dict(d.seen)
        other.verify(lambda k: check(states, k))
    finally:
        other.table.arena.close()


def test_state_declarations(arena):
    d = Driver(arena)
    b = d.backend
    v = b.state(ValueStateDescriptor("x", Types.LONG()))
    assert b.state(ValueStateDescriptor("x", Types.LONG())) is v
    with pytest.raises(ValueError, match="'x'"):
        b.state(ListStateDescriptor("x", Types.LONG()))
    other = KeyedStateBackend(KeyedTable(arena))
    with pytest.raises(ValueError, match="'x'"):
        other.state(ValueStateDescriptor("x", Types.STRING()))  # same name, another type
    assert other.state(ValueStateDescriptor("x", Types.LONG())) is not None  # same declaration: fine


# ---- wrong types --------------------------------------------------------------------------

WRONG = {
    "value-long-str": (lambda n: ValueStateDescriptor(n, Types.LONG()), "update", 5, "abc"),
    "value-long-float": (lambda n: ValueStateDescriptor(n, Types.LONG()), "update", 5, 1.5),
    "value-long-bool": (lambda n: ValueStateDescriptor(n, Types.LONG()), "update", 5, True),
    "value-int-numpy-overflow": (
        lambda n: ValueStateDescriptor(n, Types.INT()),
        "update",
        5,
        np.int64(2**40),
    ),
    "value-double-str": (lambda n: ValueStateDescriptor(n, Types.DOUBLE()), "update", 2.5, "abc"),
    "value-boolean-str": (lambda n: ValueStateDescriptor(n, Types.BOOLEAN()), "update", True, "yes"),
    "value-boolean-int": (lambda n: ValueStateDescriptor(n, Types.BOOLEAN()), "update", True, 1),
    "value-string-int": (lambda n: ValueStateDescriptor(n, Types.STRING()), "update", "ok", 5),
    "value-bytes-str": (
        lambda n: ValueStateDescriptor(n, Types.PRIMITIVE_ARRAY(Types.BYTE())),
        "update",
        b"ok",
        "x",
    ),
    "list-int-str": (lambda n: ListStateDescriptor(n, Types.INT()), "add", 5, "x"),
    "list-int-float": (lambda n: ListStateDescriptor(n, Types.INT()), "add", 5, 1.5),
    "list-int-float-str": (lambda n: ListStateDescriptor(n, Types.INT()), "add", 5, "1.5"),
    "list-int-int-str": (lambda n: ListStateDescriptor(n, Types.INT()), "add", 5, "3"),
    "list-int-none": (lambda n: ListStateDescriptor(n, Types.INT()), "add", 5, None),
    "list-int-update": (lambda n: ListStateDescriptor(n, Types.INT()), "update", 5, [1, 2.5]),
    "list-string-int": (lambda n: ListStateDescriptor(n, Types.STRING()), "add", "ok", 5),
    "reducing-long-str": (
        lambda n: ReducingStateDescriptor(n, lambda a, b: b, Types.LONG()),  # keeps the last value
        "add",
        5,
        "abc",
    ),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_wrong_value_type_is_refused_at_the_call_naming_state_type_and_value(arena, case):
    """The call itself raises (inside the user's function, so the engine can name the record),
    with the state's name, its declared type and the value; nothing of it is stored."""
    make, method, good, bad = WRONG[case]
    name = f"my_state_{case.replace('-', '_')}"
    d = Driver(arena)
    descriptor = make(name)
    st = d.backend.state(descriptor)
    kind = descriptor.kind
    read = st.value if kind == "value" else st.get
    expected = [good] if kind == "list" else good
    for _ in d.each([1]):
        getattr(st, method)([good] if method == "update" and kind == "list" else good)
    declared = type_expr(descriptor.elem_type_info if kind == "list" else descriptor.type_info)
    shown = repr(bad[1] if isinstance(bad, list) else bad)
    for _ in d.each([1]):
        with pytest.raises(TypeError) as info:
            getattr(st, method)(bad)
        assert name in str(info.value) and declared in str(info.value) and shown in str(info.value)
    # the refused value was not stored; the state still works
    d.verify(lambda k: _eq(read(), expected, k))


ACCEPTED = {  # values of other Python types that the declared type holds, stored as the type says
    "long-numpy-int": (Types.LONG(), np.int32(7), 7),
    "double-int": (Types.DOUBLE(), 3, 3.0),
    "double-numpy-float": (Types.DOUBLE(), np.float32(0.5), 0.5),
    "boolean-numpy": (Types.BOOLEAN(), np.bool_(True), True),
    "string-subclass": (Types.STRING(), type("S", (str,), {})("s"), "s"),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_values_of_other_python_types_that_fit_are_accepted(arena, case):
    type_info, given, stored = ACCEPTED[case]
    d = Driver(arena)
    st = d.backend.state(ValueStateDescriptor("v", type_info))
    for _ in d.each([1]):
        st.update(given)
    d.verify(lambda k: _eq(st.value(), stored, k))


@pytest.mark.parametrize(
    "descriptor, method",
    [(ValueStateDescriptor("big", Types.INT()), "update"), (ListStateDescriptor("big", Types.INT()), "add")],
)
def test_an_int_beyond_the_column_range_fails_the_write_back_naming_its_key_slot(arena, descriptor, method):
    """An int of the declared type is taken without a range check on the per-record path; the
    batch's write-back refuses it and says which key slot holds it."""
    d = Driver(arena)
    st = d.backend.state(descriptor)
    keys = [10, 20, 30]
    with pytest.raises(StateTypeError) as info:
        for k in d.each(keys):
            getattr(st, method)(2**40 if k == 20 else k)
    assert keys[info.value.slot] == 20
    assert "'big'" in str(info.value) and "Types.INT()" in str(info.value)


@pytest.mark.parametrize(
    "type_info, value", [(Types.DOUBLE(), float("nan")), (Types.LONG(), 7), (Types.BOOLEAN(), False)]
)
def test_a_batch_of_values_beside_unset_and_cleared_keys_writes_back_each_as_it_was(arena, type_info, value):
    """The write-back converts a batch's values in one pass: a None (unset, cleared) stays no
    value, beside a NaN (a value) in a float column and beside values in an int or bool one."""
    d = Driver(arena)
    st = d.backend.state(ValueStateDescriptor("v", type_info))
    for _ in d.each([1, 2, 3]):
        st.update(value)
    for k in d.each([1, 2, 3, 4]):
        if k == 2:
            st.clear()
        elif k == 3:
            st.update(None)

    def check(k):
        got = st.value()
        if k == 1:
            assert got is not None and (got != got if value != value else got == value), (k, got)
            assert type(got) is type(value)
        else:
            assert got is None, (k, got)

    d.verify(check)
