"""stretch.common.records: Python records <-> Arrow record batches.

The reference for every round trip is the input itself: values must come back equal *and* of the
same Python types (checked recursively by ``assert_same``), and schemas are compared with Arrow
types written out by hand.
"""

import datetime
import decimal
import math
import pickle
import threading
from collections import namedtuple

import pyarrow as pa
import pytest

from stretch.common import Instant, Row, RowKind, Types
from stretch.common.batch_decoding import from_batch
from stretch.common.records import (
    RECORD_KIND_KEY,
    field_names,
    records_schema_kind,
    schema_for,
    to_batch,
    type_info_of,
)

T = Types
PICKLED_META = {b"stretch.pickled": b"1"}
UTC = datetime.timezone.utc


def assert_same(got, expected, path="record"):
    """Equal values of identical Python types, all the way down."""
    assert type(got) is type(expected), f"{path}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, Row):
        assert hasattr(got, "_fields") == hasattr(expected, "_fields"), path
        if hasattr(expected, "_fields"):
            assert got._fields == expected._fields, path
        assert got.get_row_kind() == expected.get_row_kind(), path
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{path}[{i}]")
    elif isinstance(expected, (tuple, list)):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert list(got) == list(expected), path
        for k in expected:
            assert_same(got[k], expected[k], f"{path}[{k!r}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(got), path
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


def round_trip(records, type_info=None):
    batch = to_batch(records, type_info)
    assert isinstance(batch, pa.RecordBatch)
    assert batch.num_rows == len(records)
    back = from_batch(batch)
    assert isinstance(back, list)
    return batch, back


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return type(other) is Point and (self.x, self.y) == (other.x, other.y)

    def __hash__(self):
        return hash((self.x, self.y))

    def __repr__(self):  # test ids name it the same in every process (parallel runs collect alike)
        return f"Point({self.x}, {self.y})"


Pair = namedtuple("Pair", "left right")

# --------------------------------------------------------------------------------------------------
# declared types: every type, as a scalar record and as a tuple field, with nulls
# --------------------------------------------------------------------------------------------------
DT = datetime.datetime(2024, 2, 29, 23, 59, 58, 123456)
CASES = {
    "LONG": (T.LONG(), pa.int64(), [0, 1, -(2**63), 2**63 - 1, None]),
    "INT": (T.INT(), pa.int32(), [-(2**31), 2**31 - 1, None]),
    "SHORT": (T.SHORT(), pa.int16(), [-(2**15), 2**15 - 1, None]),
    "BYTE": (T.BYTE(), pa.int8(), [-128, 127, None]),
    "DOUBLE": (T.DOUBLE(), pa.float64(), [1.5, -0.0, float("inf"), float("nan"), 1e300, None]),
    "FLOAT": (T.FLOAT(), pa.float32(), [0.5, -2.25, None]),
    "BOOLEAN": (T.BOOLEAN(), pa.bool_(), [True, False, None]),
    "STRING": (T.STRING(), pa.large_string(), ["", "ascii", "ünïcødé €", "😀 emoji", None]),
    "CHAR": (T.CHAR(), pa.string(), ["a", "é", None]),
    "BYTES": (T.PRIMITIVE_ARRAY(T.BYTE()), pa.large_binary(), [b"", b"\x00\xff", None]),
    "BIG_INT": (T.BIG_INT(), pa.decimal128(38, 0), [10**37, -(10**37), 0, None]),
    "BIG_DEC": (
        T.BIG_DEC(),
        pa.decimal128(38, 18),
        [decimal.Decimal("1.5"), decimal.Decimal("-0.000000000000000001"), None],
    ),
    "SQL_DATE": (
        T.SQL_DATE(),
        pa.date32(),
        [datetime.date(2024, 2, 29), datetime.date(1, 1, 1), datetime.date(9999, 12, 31), None],
    ),
    "SQL_TIME": (T.SQL_TIME(), pa.time64("us"), [datetime.time(23, 59, 59, 999999), None]),
    "SQL_TIMESTAMP": (
        T.SQL_TIMESTAMP(),
        pa.timestamp("us"),
        [DT, datetime.datetime(1, 1, 1), datetime.datetime(1969, 12, 31, 23, 59, 59), None],
    ),
    "INSTANT": (
        T.INSTANT(),
        pa.timestamp("us", tz="UTC"),
        [Instant(0, 0), Instant(1_700_000_000, 123_456_000), Instant(-1, 999_999_000), None],
    ),
    "LIST": (T.LIST(T.LONG()), pa.large_list(pa.int64()), [[1, 2], [], [None], None]),
    "BASIC_ARRAY": (
        T.BASIC_ARRAY(T.STRING()),
        pa.large_list(pa.large_string()),
        [["a", None], [], None],
    ),
    "PRIMITIVE_ARRAY": (T.PRIMITIVE_ARRAY(T.DOUBLE()), pa.large_list(pa.float64()), [[1.5], []]),
    "MAP": (
        T.MAP(T.STRING(), T.LONG()),
        pa.map_(pa.large_string(), pa.int64()),
        [{"a": 1, "ü": None}, {}, None],
    ),
    "PICKLED": (
        T.PICKLED_BYTE_ARRAY(),
        pa.large_binary(),
        [{1, 2}, Point(1, 2), ("t", [1]), Pair(1, 2), None],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_scalar_round_trip(name):
    type_info, arrow_type, values = CASES[name]
    batch, back = round_trip(values, type_info)
    assert batch.schema.names == ["f0"]
    assert batch.schema.field(0).type == arrow_type
    kind = b"pickled" if name == "PICKLED" else b"scalar"
    assert batch.schema.metadata[RECORD_KIND_KEY] == kind
    assert batch.schema == schema_for(type_info)
    assert_same(back, values)


@pytest.mark.parametrize("name", CASES)
def test_tuple_field_round_trip(name):
    type_info, arrow_type, values = CASES[name]
    records = [(i, v) for i, v in enumerate(values)]
    batch, back = round_trip(records, T.TUPLE([T.INT(), type_info]))
    assert batch.schema.names == ["f0", "f1"]
    assert batch.schema.field(1).type == arrow_type
    assert batch.schema.metadata[RECORD_KIND_KEY] == b"tuple"
    if name == "PICKLED":
        assert batch.schema.field(1).metadata == PICKLED_META
    assert_same(back, records)


def test_ints_widen_into_double_and_float():
    _, back = round_trip([1, 2.5, None, -3], T.DOUBLE())
    assert_same(back, [1.0, 2.5, None, -3.0])
    _, back = round_trip([(1,)], T.TUPLE([T.FLOAT()]))
    assert_same(back, [(1.0,)])


def test_instant_accepts_aware_datetimes():
    aware = datetime.datetime(2024, 1, 1, 12, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    _, back = round_trip([aware], T.INSTANT())
    assert back == [Instant.of_epoch_milli(int(aware.timestamp() * 1000))]


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_instants_read_from_arrow_timestamps_of_any_unit(unit):
    millis = [1_795_356_163_813, 0, None]
    batch = pa.record_batch(
        {"t": pa.array(millis, pa.timestamp("ms", tz="UTC")).cast(pa.timestamp(unit, tz="UTC"), safe=False)}
    )
    expected = [
        None if m is None else Instant.of_epoch_milli(m // 1000 * 1000 if unit == "s" else m) for m in millis
    ]
    assert [r[0] for r in from_batch(batch)] == expected


def test_nested_row_inside_tuple():
    t = T.TUPLE(
        [
            T.STRING(),
            T.ROW_NAMED(["name", "tags"], [T.STRING(), T.LIST(T.STRING())]),
            T.ROW([T.LONG(), T.DOUBLE()]),
            T.TUPLE([T.LONG(), T.TUPLE([T.BOOLEAN()])]),
        ]
    )
    records = [
        ("k1", Row(name="ü", tags=["a", "b"]), Row(1, 2.5), (7, (True,))),
        ("k2", Row(name=None, tags=[]), (3, None), (8, None)),
        ("k3", None, None, None),
        ("k4", {"name": "from dict", "tags": None}, [4, 4.5], [9, [False]]),
        ("k5", Row(tags=["reordered"], name="n"), Row(f1=0.5, f0=5), (10, (None,))),
    ]
    batch, back = round_trip(records, t)
    assert batch.schema.field(1).type == pa.struct(
        [("name", pa.large_string()), ("tags", pa.large_list(pa.large_string()))]
    )
    expected = [
        ("k1", Row(name="ü", tags=["a", "b"]), Row(f0=1, f1=2.5), (7, (True,))),
        ("k2", Row(name=None, tags=[]), Row(f0=3, f1=None), (8, None)),
        ("k3", None, None, None),
        ("k4", Row(name="from dict", tags=None), Row(f0=4, f1=4.5), (9, (False,))),
        ("k5", Row(name="n", tags=["reordered"]), Row(f0=5, f1=0.5), (10, (None,))),
    ]
    assert_same(back, expected)
    assert type_info_of(batch.schema) == t


def test_lists_and_maps_of_composites():
    t = T.TUPLE(
        [
            T.LIST(T.ROW_NAMED(["a"], [T.LONG()])),
            T.MAP(T.STRING(), T.LIST(T.TUPLE([T.INT(), T.STRING()]))),
            T.LIST(T.LIST(T.PICKLED_BYTE_ARRAY())),
            T.MAP(T.LONG(), T.MAP(T.STRING(), T.DOUBLE())),
        ]
    )
    records = [
        (
            [Row(a=1), None, Row(a=None)],
            {"x": [(1, "é"), (2, None)], "y": [], "z": None},
            [[{"any": "thing"}, None], []],
            {1: {"p": 0.5}, 2: {}},
        ),
        (None, None, None, None),
        ([], {}, [], {}),
    ]
    _, back = round_trip(records, t)
    assert_same(back, records)


def test_empty_records_with_declared_type():
    t = T.TUPLE([T.STRING(), T.LIST(T.LONG()), T.ROW_NAMED(["a"], [T.DOUBLE()])])
    batch = to_batch([], t)
    assert batch.num_rows == 0
    assert batch.schema == schema_for(t)
    assert batch.schema.types == [
        pa.large_string(),
        pa.large_list(pa.int64()),
        pa.struct([("a", pa.float64())]),
    ]
    assert from_batch(batch) == []
    for t in (T.LONG(), T.ROW_NAMED(["a", "b"], [T.LONG(), T.STRING()]), T.PICKLED_BYTE_ARRAY()):
        batch = to_batch([], t)
        assert batch.schema == schema_for(t)
        assert batch.num_rows == 0
        assert from_batch(batch) == []


def test_row_named_records_of_every_shape():
    t = T.ROW_NAMED(["id", "name"], [T.LONG(), T.STRING()])
    records = [
        Row(id=1, name="a"),
        Row(name="b", id=2),
        Row(3, "c"),
        (4, "d"),
        [5, "e"],
        {"id": 6, "name": "f"},
        {"id": 7},
    ]
    batch, back = round_trip(records, t)
    assert batch.schema.names == ["id", "name"]
    assert batch.schema.metadata[RECORD_KIND_KEY] == b"row"
    expected = [
        Row(id=1, name="a"),
        Row(id=2, name="b"),
        Row(id=3, name="c"),
        Row(id=4, name="d"),
        Row(id=5, name="e"),
        Row(id=6, name="f"),
        Row(id=7, name=None),
    ]
    assert_same(back, expected)
    assert repr(back[0]) == "Row(id=1, name='a')"


def test_unnamed_row_type_gives_rows_named_f0_like_pyflink():
    batch, back = round_trip([("a", 1), Row("b", 2)], T.ROW([T.STRING(), T.LONG()]))
    assert batch.schema.names == ["f0", "f1"]
    assert_same(back, [Row(f0="a", f1=1), Row(f0="b", f1=2)])
    assert type_info_of(batch.schema) == T.ROW([T.STRING(), T.LONG()])


def test_unnamed_row_type_matches_f_names_then_position():
    t = T.ROW([T.STRING(), T.LONG()])
    _, back = round_trip([Row(f1=1, f0="a"), Row(x="b", y=2), Row("c", 3)], t)
    assert_same(back, [Row(f0="a", f1=1), Row(f0="b", f1=2), Row(f0="c", f1=3)])


def test_tuple_type_accepts_lists_and_rows():
    _, back = round_trip([[1, "a"], Row(2, "b"), Row(x=3, y="c")], T.TUPLE([T.LONG(), T.STRING()]))
    assert_same(back, [(1, "a"), (2, "b"), (3, "c")])


def test_row_kinds_survive():
    rows = [Row(k="a", v=1), Row.of_kind(RowKind.UPDATE_BEFORE, k="a", v=1)]
    rows.append(Row.of_kind(RowKind.DELETE, k="b", v=None))
    for t in (None, T.ROW_NAMED(["k", "v"], [T.STRING(), T.LONG()])):
        batch, back = round_trip(rows, t)
        assert "__row_kind" in batch.schema.names
        assert_same(back, rows)
    batch = to_batch([Row(k="a", v=1)])
    assert "__row_kind" not in batch.schema.names


# --------------------------------------------------------------------------------------------------
# inference
# --------------------------------------------------------------------------------------------------
def test_infer_plain_tuples():
    records = [("a", 1, 1.5, True, b"x"), ("b", None, None, None, None), ("ü", -5, 2.0, False, b"")]
    batch, back = round_trip(records)
    assert batch.schema.metadata[RECORD_KIND_KEY] == b"tuple"
    assert batch.schema.names == ["f0", "f1", "f2", "f3", "f4"]
    assert batch.schema.types == [
        pa.large_string(),
        pa.int64(),
        pa.float64(),
        pa.bool_(),
        pa.large_binary(),
    ]
    assert all(f.metadata is None for f in batch.schema)
    assert_same(back, records)


def test_infer_dates_and_times():
    records = [(DT, DT.date(), DT.time()), (None, None, None)]
    batch, back = round_trip(records)
    assert batch.schema.types == [pa.timestamp("us"), pa.date32(), pa.time64("us")]
    assert_same(back, records)


@pytest.mark.parametrize(
    "column",
    [
        [1, "a"],  # int and str
        [1, 2.5],  # int and float: ints must not become floats
        [2.5, 1],
        [1, True],  # bools stay bools
        [2**63, 1],  # beyond int64
        [-(2**63) - 1],
        [(1, 2), (3,)],  # tuples stay tuples
        [[1, 2], ["a"]],
        [{"a": 1}, {}],
        [Point(1, 2), None],
        [Pair(1, 2)],
        [Row(a=1), Row(1)],
        [decimal.Decimal("1.50")],
        [datetime.datetime(2024, 1, 1, tzinfo=UTC)],  # aware datetimes keep their zone
        [frozenset({1}), None],
        [None, None],
    ],
    ids=repr,
)
def test_infer_unrepresentable_field_is_pickled(column):
    records = [(i, v) for i, v in enumerate(column)]
    batch, back = round_trip(records)
    assert batch.schema.metadata[RECORD_KIND_KEY] == b"tuple"
    assert batch.schema.field(0).type == pa.int64()
    assert batch.schema.field(1).type == pa.large_binary()
    assert batch.schema.field(1).metadata == PICKLED_META
    assert_same(back, records)


def test_infer_rows():
    rows = [Row(name="a", age=1, score=0.5), Row(name="b", age=None, score=None)]
    batch, back = round_trip(rows)
    assert batch.schema.metadata[RECORD_KIND_KEY] == b"row"
    assert batch.schema.names == ["name", "age", "score"]
    assert_same(back, rows)

    positional = [Row("a", 1), Row("b", 2)]
    batch, back = round_trip(positional)
    assert batch.schema.metadata[RECORD_KIND_KEY] == b"row"
    assert_same(back, positional)
    assert repr(back[0]) == "<Row('a', 1)>"

    mixed_values = [Row(k="a", v=1), Row(k="b", v="two"), Row(k="c", v=(1, 2))]
    _, back = round_trip(mixed_values)
    assert_same(back, mixed_values)


@pytest.mark.parametrize(
    "records",
    [
        [Row(a=1), Row(b=1)],  # different names
        [Row(a=1), Row(1)],  # named and positional
        [Row(a=1, b=2), Row(b=2, a=1)],  # same names, other order
        [(1, 2), (1,)],  # different lengths
        [(1,), [1]],  # tuples and lists
        [1, "a"],
        [1, 2.5],
        [1, True],
        [Point(1, 2), Point(3, 4)],
        [Pair(1, 2), Pair(3, 4)],
        [(), ()],
        [{"a": 1}],
        [[1, 2]],
        [None],
        [2**64],
        [datetime.datetime(2024, 1, 1, tzinfo=UTC)],
    ],
    ids=repr,
)
def test_infer_pickled_records(records):
    batch, back = round_trip(records)
    assert batch.schema.metadata[RECORD_KIND_KEY] == b"pickled"
    assert batch.schema.field(0).metadata == PICKLED_META
    assert_same(back, records)


@pytest.mark.parametrize(
    ("records", "arrow_type"),
    [
        ([1, 2, None], pa.int64()),
        ([0.5, None], pa.float64()),
        (["a", "ü"], pa.large_string()),
        ([b"a"], pa.large_binary()),
        ([True, None], pa.bool_()),
        ([DT], pa.timestamp("us")),
        ([DT.date()], pa.date32()),
    ],
    ids=repr,
)
def test_infer_scalars(records, arrow_type):
    batch, back = round_trip(records)
    assert batch.schema.metadata[RECORD_KIND_KEY] == b"scalar"
    assert batch.schema.field(0).type == arrow_type
    assert_same(back, records)


_READ_IN_A_WORKER = """
import pickle, sys
import pyarrow as pa
from stretch.common.batch_decoding import from_batch
batch = pa.ipc.open_stream(sys.stdin.buffer.read()).read_next_batch()
print(repr([(type(r).__name__, vars(r)) for r in from_batch(batch)]))
"""


@pytest.mark.parametrize("typed", [False, True], ids=["inferred", "PICKLED_BYTE_ARRAY"])
def test_records_of_classes_of_the_script_reach_a_worker(monkeypatch, typed):
    """A class of the user's script is ``__main__.X`` to pickle, which a worker (whose ``__main__``
    is not the script) cannot import: such records are pickled by value."""
    import subprocess
    import sys

    main = sys.modules["__main__"]
    click = type("Click", (), {"__module__": "__main__", "__init__": Point.__init__})
    monkeypatch.setattr(main, "Click", click, raising=False)  # as a class defined in the script
    records = [click("u1", 1), click("ü", [2, 3])]
    batch = to_batch(records, T.PICKLED_BYTE_ARRAY() if typed else None)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    worker = subprocess.run(
        [sys.executable, "-c", _READ_IN_A_WORKER],
        input=sink.getvalue().to_pybytes(),
        capture_output=True,
        check=True,
    )
    expected = [(type(r).__name__, vars(r)) for r in records]
    assert worker.stdout.decode().strip() == repr(expected)
    back = from_batch(batch)
    assert [type(r) for r in back] == [click, click]  # in the script's process, the class itself
    assert [vars(r) for r in back] == [vars(r) for r in records]


def test_infer_empty():
    batch = to_batch([])
    assert batch.num_rows == 0
    assert from_batch(batch) == []


def test_records_from_any_iterable():
    _, back = round_trip(tuple((i, str(i)) for i in range(3)))
    assert back == [(0, "0"), (1, "1"), (2, "2")]
    assert from_batch(to_batch(iter([1, 2]))) == [1, 2]
    with pytest.raises(TypeError, match="list or sequence"):
        to_batch("abc")


# --------------------------------------------------------------------------------------------------
# type errors
# --------------------------------------------------------------------------------------------------
PAIR = T.TUPLE([T.STRING(), T.LONG()])


def raises(records, type_info):
    with pytest.raises(TypeError) as info:
        to_batch(records, type_info)
    return str(info.value)


def test_error_message_names_record_field_and_type():
    message = raises([("a", 1), ("b", 2), ("c", 3), ("a", "x")], PAIR)
    assert message == (
        "record 3 ('a', 'x') does not match Types.TUPLE([Types.STRING(), Types.LONG()]): "
        "field 1 expected LONG, got str 'x'"
    )


def test_error_finds_late_record():
    records = [(str(i), i) for i in range(5000)]
    records[4321] = ("bad", 1.5)
    message = raises(records, PAIR)
    assert message.startswith("record 4321 ('bad', 1.5) does not match")
    assert message.endswith("field 1 expected LONG, got float 1.5")


@pytest.mark.parametrize(
    ("records", "type_info", "expected"),
    [
        ([1, 1.5], T.LONG(), "record 1 1.5 does not match Types.LONG(): expected LONG, got float 1.5"),
        ([1.0], T.LONG(), "expected LONG, got float 1.0"),
        ([True], T.LONG(), "expected LONG, got bool True"),
        ([2.5], T.INT(), "expected INT, got float 2.5"),
        ([2**31], T.INT(), "expected INT, got int 2147483648 (out of range"),
        ([-129], T.BYTE(), "expected BYTE, got int -129 (out of range [-128, 127])"),
        ([40000], T.SHORT(), "expected SHORT, got int 40000 (out of range"),
        ([2**63], T.LONG(), "expected LONG, got int 9223372036854775808 (out of range"),
        (["x"], T.DOUBLE(), "expected DOUBLE, got str 'x'"),
        ([1.5, True], T.DOUBLE(), "record 1 True does not match Types.DOUBLE(): expected DOUBLE"),
        ([1, "1"], T.LONG(), "record 1 '1' does not match Types.LONG(): expected LONG, got str '1'"),
        ([1], T.BOOLEAN(), "expected BOOLEAN, got int 1"),
        ([b"x"], T.STRING(), "expected STRING, got bytes b'x'"),
        (["x"], T.PRIMITIVE_ARRAY(T.BYTE()), "got str 'x'"),
        (["ab"], T.CHAR(), "expected CHAR, got str 'ab' (not a single character)"),
        ([10**38], T.BIG_INT(), "expected BIG_INT, got int 1" + "0" * 38 + " (more than 38 digits)"),
        ([1.5], T.BIG_DEC(), "expected BIG_DEC, got float 1.5"),
        ([decimal.Decimal("1e-19")], T.BIG_DEC(), "expected BIG_DEC, got Decimal Decimal('1E-19')"),
        ([DT], T.SQL_DATE(), "expected SQL_DATE, got datetime"),
        ([0], T.SQL_TIMESTAMP(), "expected SQL_TIMESTAMP, got int 0"),
        (["2024"], T.INSTANT(), "expected INSTANT, got str '2024'"),
        (["ab"], T.LIST(T.STRING()), "expected Types.LIST(Types.STRING()), got str 'ab'"),
        ([[1, "x"]], T.LIST(T.LONG()), "record 0 [1, 'x'] does not match Types.LIST(Types.LONG()): "),
        ([{"k": 1.5}], T.MAP(T.STRING(), T.LONG()), "field ['k'] expected LONG, got float 1.5"),
        ([{None: 1}], T.MAP(T.STRING(), T.LONG()), "got a None key"),
        ([{1: 1}], T.MAP(T.STRING(), T.LONG()), "field [key 1] expected STRING, got int 1"),
    ],
    ids=repr,
)
def test_scalar_type_errors(records, type_info, expected):
    assert expected in raises(records, type_info)


@pytest.mark.parametrize(
    ("records", "type_info", "expected"),
    [
        (
            [("a",)],
            PAIR,
            "record 0 ('a',) does not match Types.TUPLE([Types.STRING(), Types.LONG()]): "
            "expected 2 fields, got 1",
        ),
        ([("a", 1, 2)], PAIR, "expected 2 fields, got 3"),
        (
            [("a", 1), None],
            PAIR,
            "record 1 None does not match Types.TUPLE([Types.STRING(), "
            "Types.LONG()]): expected a tuple, list or Row, got NoneType None",
        ),
        ([5], PAIR, "expected a tuple, list or Row, got int 5"),
        (["ab"], PAIR, "expected a tuple, list or Row, got str 'ab'"),
        ([{"f0": "a", "f1": 1}], PAIR, "expected a tuple, list or Row, got dict"),
        ([(1, 1)], PAIR, "field 0 expected STRING, got int 1"),
        ([("a", 1.0)], PAIR, "field 1 expected LONG, got float 1.0"),
        ([("a", True)], PAIR, "field 1 expected LONG, got bool True"),
        (
            [Row(id=1, nme="typo")],
            T.ROW_NAMED(["id", "name"], [T.LONG(), T.STRING()]),
            "expected fields ['id', 'name'], got a Row without field 'name'",
        ),
        (
            [Row(id="1", name="a")],
            T.ROW_NAMED(["id", "name"], [T.LONG(), T.STRING()]),
            "record 0 Row(id='1', name='a') does not match Types.ROW_NAMED(['id', 'name'], "
            "[Types.LONG(), Types.STRING()]): field id expected LONG, got str '1'",
        ),
        (
            [(1, Row(a=1, b="x"))],
            T.TUPLE([T.LONG(), T.ROW_NAMED(["a", "b"], [T.LONG(), T.LONG()])]),
            "field 1.b expected LONG, got str 'x'",
        ),
        (
            [(1, [(1, "a"), (2, 3)])],
            T.TUPLE([T.LONG(), T.LIST(T.TUPLE([T.LONG(), T.STRING()]))]),
            "field 1[1].1 expected STRING, got int 3",
        ),
        (
            [(1, {"k": [1, "x"]})],
            T.TUPLE([T.LONG(), T.MAP(T.STRING(), T.LIST(T.LONG()))]),
            "field 1['k'][1] expected LONG, got str 'x'",
        ),
        ([(1, (1, 2))], T.TUPLE([T.LONG(), T.TUPLE([T.LONG()])]), "field 1 expected 1 fields, got 2"),
        ([(1, 5)], T.TUPLE([T.LONG(), T.TUPLE([T.LONG()])]), "field 1 expected a tuple, list or Row"),
    ],
    ids=repr,
)
def test_record_type_errors(records, type_info, expected):
    assert expected in raises(records, type_info)


def test_none_fields_are_nulls_not_errors():
    _, back = round_trip([(None, None)], PAIR)
    assert back == [(None, None)]


def test_long_records_are_truncated_in_messages():
    message = raises([("x" * 1000, "y" * 1000)], PAIR)
    shown = message[len("record 0 ") : message.index(" does not match")]
    assert len(shown) <= 200
    assert shown.endswith("...")
    assert message.endswith("...")  # the value in the reason is truncated too


def test_unpicklable_value():
    message = raises([threading.Lock()], T.PICKLED_BYTE_ARRAY())
    assert "record 0" in message and "cannot be pickled" in message
    message = raises([(1, "a"), (2, threading.Lock())], None)
    assert message.startswith("record 1 (2, <unlocked _thread.lock object")
    assert "cannot be pickled" in message
    # lambdas are not picklable by pickle but are by cloudpickle: accepted
    (fn,) = from_batch(to_batch([lambda x: x + 1], T.PICKLED_BYTE_ARRAY()))
    assert fn(1) == 2


# --------------------------------------------------------------------------------------------------
# batches built elsewhere
# --------------------------------------------------------------------------------------------------
def test_engine_columns_are_ignored():
    records = [("a", 1), ("b", 2)]
    batch = to_batch(records)
    batch = batch.append_column("__kg", pa.array([5, 7], type=pa.int32()))
    batch = batch.add_column(0, "__key", pa.array(["a", "b"]))
    assert batch.schema.names == ["__key", "f0", "f1", "__kg"]
    assert_same(from_batch(batch), records)

    rows = [Row(k="a", v=1)]
    batch = to_batch(rows).add_column(0, "__kg", pa.array([1]))
    assert_same(from_batch(batch), rows)

    scalars = to_batch([1, 2]).add_column(0, "__kg", pa.array([1, 2]))
    assert from_batch(scalars) == [1, 2]

    pickled = to_batch([Point(1, 2)]).add_column(0, "__kg", pa.array([1]))
    assert from_batch(pickled) == [Point(1, 2)]


def test_batches_without_metadata():
    named = pa.RecordBatch.from_pydict({"a": [1, None], "b": ["x", "y"]})
    assert records_schema_kind(named.schema) == "row"
    assert_same(from_batch(named), [Row(a=1, b="x"), Row(a=None, b="y")])
    tuples = pa.RecordBatch.from_pydict({"f0": [1], "f1": [0.5], "__kg": [3]})
    assert records_schema_kind(tuples.schema) == "tuple"
    assert_same(from_batch(tuples), [(1, 0.5)])
    scalars = pa.RecordBatch.from_pydict({"f0": ["a", "b"]})
    assert records_schema_kind(scalars.schema) == "scalar"
    assert from_batch(scalars) == ["a", "b"]
    foreign = pa.RecordBatch.from_pydict(
        {
            "ts": pa.array([1_000_000], type=pa.timestamp("ns")),
            "n": pa.array([None], type=pa.null()),
            "u": pa.array([2**64 - 1], type=pa.uint64()),
            "s": pa.array([{"x": 1}]),
            "d": pa.array([0], type=pa.date64()),
        }
    )
    assert_same(
        from_batch(foreign),
        [
            Row(
                ts=datetime.datetime(1970, 1, 1, 0, 0, 0, 1000),
                n=None,
                u=2**64 - 1,
                s=Row(x=1),
                d=datetime.date(1970, 1, 1),
            )
        ],
    )


def test_sliced_batches():
    t = T.TUPLE(
        [
            T.LONG(),
            T.LIST(T.ROW_NAMED(["a"], [T.STRING()])),
            T.MAP(T.STRING(), T.LIST(T.LONG())),
            T.TUPLE([T.DOUBLE(), T.LIST(T.LONG())]),
            T.PICKLED_BYTE_ARRAY(),
            T.BOOLEAN(),
        ]
    )
    records = []
    for i in range(12):
        if i % 4 == 3:
            records.append((None, None, None, None, None, None))
        else:
            records.append(
                (
                    i,
                    [Row(a=str(j)) for j in range(i % 3)],
                    {str(j): list(range(j)) for j in range(i % 3)},
                    (i / 2, list(range(i % 2))),
                    {i},
                    i % 2 == 0,
                )
            )
    batch = to_batch(records, t)
    for start in range(12):
        for length in (0, 1, 3, 12):
            assert_same(from_batch(batch.slice(start, length)), records[start : start + length])


def test_tables_and_chunks():
    first = to_batch([(1, "a"), (2, None)], PAIR.__class__([T.LONG(), T.STRING()]))
    second = to_batch([(3, "c")], T.TUPLE([T.LONG(), T.STRING()]))
    table = pa.Table.from_batches([first, second])
    assert from_batch(table) == [(1, "a"), (2, None), (3, "c")]


def test_large_batches_with_nulls():
    n = 20_000
    records = [
        (
            i if i % 7 else None,
            i * 0.25 if i % 5 else None,
            i % 3 == 0 if i % 11 else None,
            DT if i % 13 else None,
            f"s{i}" if i % 17 else None,
        )
        for i in range(n)
    ]
    t = T.TUPLE([T.LONG(), T.DOUBLE(), T.BOOLEAN(), T.SQL_TIMESTAMP(), T.STRING()])
    for type_info in (t, None):
        _, back = round_trip(records, type_info)
        assert_same(back, records)
    rows = [Row(i=i, s=None if i % 3 else str(i)) for i in range(n)]
    _, back = round_trip(rows)
    assert_same(back, rows)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def test_schema_helpers():
    assert schema_for(None) is None
    t = T.ROW_NAMED(["a", "b"], [T.LONG(), T.PICKLED_BYTE_ARRAY()])
    schema = schema_for(t)
    assert schema.names == ["a", "b"]
    assert schema.field(1).metadata == PICKLED_META
    assert records_schema_kind(schema) == "row"
    assert type_info_of(schema) == t
    assert field_names(t) == ["a", "b"]
    assert field_names(T.TUPLE([T.LONG(), T.LONG()])) == ["f0", "f1"]
    assert field_names(T.LONG()) == ["f0"]
    assert field_names(None) is None
    for type_info in (T.LONG(), T.PICKLED_BYTE_ARRAY(), T.TUPLE([T.LIST(T.INT())]), T.ROW([T.LONG()])):
        assert type_info_of(schema_for(type_info)) == type_info
    assert records_schema_kind(schema_for(T.PICKLED_BYTE_ARRAY())) == "pickled"
    with pytest.raises(ValueError, match="reserved"):
        schema_for(T.ROW_NAMED(["__kg"], [T.LONG()]))


def test_pickled_column_is_plain_pickle():
    batch = to_batch([Point(1, 2)])
    payload = batch.column(0)[0].as_py()
    assert pickle.loads(payload) == Point(1, 2)
    assert payload[:2] == b"\x80\x05"  # protocol 5
