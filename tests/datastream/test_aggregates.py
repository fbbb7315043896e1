"""Rolling sum/min/max/reduce/min_by/max_by and keyed map/filter, against PyFlink's semantics."""

from __future__ import annotations

import random
from collections import defaultdict

import pyarrow as pa
import pytest

from stretch.common import Row, Types
from stretch.datastream import MapFunction, StreamExecutionEnvironment
from stretch.datastream.state import ValueStateDescriptor


def rolling(records, key_of, combine):
    """PyFlink's rolling aggregation: the first record as is, then combine(acc, value) per record."""
    acc, out = {}, []
    for r in records:
        k = key_of(r)
        acc[k] = r if k not in acc else combine(acc[k], r)
        out.append(acc[k])
    return out


def per_key(outputs, key_of):
    d = defaultdict(list)
    for o in outputs:
        d[key_of(o)].append(o)
    return dict(d)


def env(p=2):
    e = StreamExecutionEnvironment.get_execution_environment()
    e.set_parallelism(p)
    return e


def records3(n=2500, seed=3):
    rng = random.Random(seed)
    return [(f"k{rng.randrange(40)}", rng.randrange(-50, 50), rng.random() * 10) for _ in range(n)]


TUPLE3 = Types.TUPLE([Types.STRING(), Types.LONG(), Types.DOUBLE()])


@pytest.mark.parametrize(
    ("op", "combine"),
    [
        ("sum", lambda a, b: (a[0], a[1] + b[1], a[2])),
        ("min", lambda a, b: (a[0], min(a[1], b[1]), a[2])),
        ("max", lambda a, b: (a[0], max(a[1], b[1]), a[2])),
    ],
)
def test_rolling_aggregate_keeps_first_record_fields(op, combine):
    records = records3()
    ds = env().from_collection(records, TUPLE3)
    with getattr(ds.key_by(lambda r: r[0]), op)(1).execute_and_collect() as it:
        got = list(it)
    want = rolling(records, lambda r: r[0], combine)
    assert per_key(got, lambda r: r[0]) == per_key(want, lambda r: r[0])


def test_sum_of_several_fields_by_name_on_arrow_is_vectorized_and_exact():
    rng = random.Random(5)
    n = 20000
    table = pa.table(
        {
            "user": [rng.randrange(300) for _ in range(n)],
            "n": [1] * n,
            "amount": [rng.randrange(1000) / 4 for _ in range(n)],
            "tag": [rng.choice(["a", "bb", "ccc"]) for _ in range(n)],
        }
    )
    e = env(3)
    with e.from_arrow(table).key_by("user").sum(["n", "amount"]).execute_and_collect() as it:
        got = [tuple(r) for r in it]
    rows = list(zip(*(table[c].to_pylist() for c in table.column_names)))
    want = rolling(rows, lambda r: r[0], lambda a, b: (a[0], a[1] + b[1], a[2] + b[2], a[3]))
    assert per_key(got, lambda r: r[0]) == per_key(want, lambda r: r[0])


def test_sum_on_plain_values_and_on_pickled_records():
    e = env()
    values = [i % 10 for i in range(500)]
    with e.from_collection(values, Types.LONG()).key_by(lambda v: v % 3).sum(0).execute_and_collect() as it:
        got = list(it)
    want = rolling(values, lambda v: v % 3, lambda a, b: a + b)
    assert sorted(got) == sorted(want)
    objects = [{"k": i % 4, "v": i} for i in range(300)]  # no declared type: pickled records
    e2 = env()
    ds = e2.from_collection([(o["k"], o["v"], [o["v"]]) for o in objects])
    with ds.key_by(lambda r: r[0]).sum(1).execute_and_collect() as it:
        got2 = list(it)
    want2 = rolling(
        [(o["k"], o["v"], [o["v"]]) for o in objects], lambda r: r[0], lambda a, b: (a[0], a[1] + b[1], a[2])
    )
    assert per_key(got2, lambda r: r[0]) == per_key(want2, lambda r: r[0])


def test_reduce_min_by_max_by():
    records = records3(1500)
    key_of = lambda r: r[0]  # noqa: E731
    cases = {
        "reduce": (
            lambda ks: ks.reduce(lambda a, b: (a[0], a[1] + b[1], max(a[2], b[2]))),
            lambda a, b: (a[0], a[1] + b[1], max(a[2], b[2])),
        ),
        "min_by": (lambda ks: ks.min_by(1), lambda a, b: b if b[1] < a[1] else a),
        "max_by": (lambda ks: ks.max_by(2), lambda a, b: b if b[2] > a[2] else a),
    }
    for name, (build, combine) in cases.items():
        ds = env().from_collection(records, TUPLE3)
        with build(ds.key_by(key_of)).execute_and_collect() as it:
            got = list(it)
        assert per_key(got, key_of) == per_key(rolling(records, key_of, combine), key_of), name


def test_rows_by_field_name():
    rows = [Row(user=f"u{i % 6}", clicks=i % 4) for i in range(600)]
    t = Types.ROW_NAMED(["user", "clicks"], [Types.STRING(), Types.LONG()])
    with env().from_collection(rows, t).key_by(lambda r: r.user).max("clicks").execute_and_collect() as it:
        got = list(it)
    want = rolling(rows, lambda r: r.user, lambda a, b: Row(user=a.user, clicks=max(a.clicks, b.clicks)))
    assert per_key(got, lambda r: r.user) == per_key(want, lambda r: r.user)


class Numbered(MapFunction):
    """A MapFunction on a KeyedStream may use keyed state, as in PyFlink."""

    def open(self, runtime_context):
        self.seen = runtime_context.get_state(ValueStateDescriptor("seen", Types.LONG()))

    def map(self, value):
        n = (self.seen.value() or 0) + 1
        self.seen.update(n)
        return value[0], n


def test_keyed_map_filter_flat_map():
    records = [(f"k{i % 9}", i) for i in range(900)]
    ks = env(3).from_collection(records, Types.TUPLE([Types.STRING(), Types.LONG()])).key_by(lambda r: r[0])
    with ks.map(Numbered()).execute_and_collect() as it:
        got = list(it)
    seen = defaultdict(int)
    want = []
    for k, _ in records:
        seen[k] += 1
        want.append((k, seen[k]))
    assert per_key(got, lambda r: r[0]) == per_key(want, lambda r: r[0])
    ks2 = env(2).from_collection(records, Types.TUPLE([Types.STRING(), Types.LONG()])).key_by(lambda r: r[0])
    with ks2.filter(lambda r: r[1] % 2 == 0).flat_map(lambda r: [r[1]] * 2).execute_and_collect() as it:
        got2 = sorted(it)
    assert got2 == sorted(v for _, i in records if i % 2 == 0 for v in (i, i))
