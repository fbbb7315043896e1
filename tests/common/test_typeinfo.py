"""stretch.common.typeinfo (plus time and watermark_strategy, the rest of stretch.common).

References: the Arrow mapping table of the design brief, and the reprs of PyFlink 2.3.0's
typeinfo.py (``BasicTypeInfo.__repr__`` returns the BasicType value, e.g. ``'Long'``).
"""

import json
import pickle

import numpy as np
import pyarrow as pa
import pytest

from stretch.common import Duration, Instant, Time, TimestampAssigner, Types, WatermarkStrategy
from stretch.common.arrow_types import from_arrow, from_arrow_field
from stretch.common.batch_decoding import from_batch
from stretch.common.records import to_batch
from stretch.common.typeinfo import (
    RowTypeInfo,
    TupleTypeInfo,
    TypeInformation,
    from_json,
    type_expr,
)

T = Types

# (type, Arrow type, PyFlink repr)
SCALARS = [
    (T.STRING(), pa.large_string(), "String"),
    (T.BYTE(), pa.int8(), "Byte"),
    (T.BOOLEAN(), pa.bool_(), "Boolean"),
    (T.SHORT(), pa.int16(), "Short"),
    (T.INT(), pa.int32(), "Integer"),
    (T.LONG(), pa.int64(), "Long"),
    (T.FLOAT(), pa.float32(), "Float"),
    (T.DOUBLE(), pa.float64(), "Double"),
    (T.CHAR(), pa.string(), "Char"),
    (T.BIG_INT(), pa.decimal128(38, 0), "BigInteger"),
    (T.BIG_DEC(), pa.decimal128(38, 18), "BigDecimal"),
    (T.INSTANT(), pa.timestamp("us", tz="UTC"), "Instant"),
    (T.SQL_DATE(), pa.date32(), "DateTypeInfo"),
    (T.SQL_TIME(), pa.time64("us"), "TimeTypeInfo"),
    (T.SQL_TIMESTAMP(), pa.timestamp("us"), "TimestampTypeInfo"),
    (T.PRIMITIVE_ARRAY(T.BYTE()), pa.large_binary(), "PrimitiveArrayTypeInfo<Byte>"),
    (T.PICKLED_BYTE_ARRAY(), pa.large_binary(), "PickledByteArrayTypeInfo"),
]


def test_bytes_is_pyflinks_primitive_array_of_byte():
    """Types.BYTES is not PyFlink's (it spells bytes PRIMITIVE_ARRAY(BYTE())): it is that type."""
    assert T.BYTES() == T.PRIMITIVE_ARRAY(T.BYTE()) and hash(T.BYTES()) == hash(T.PRIMITIVE_ARRAY(T.BYTE()))
    assert T.BYTES().to_arrow() == pa.large_binary()
    assert repr(T.BYTES()) == "PrimitiveArrayTypeInfo<Byte>"
    assert from_json(json.loads(json.dumps(T.BYTES().to_json()))) == T.BYTES()
    assert pickle.loads(pickle.dumps(T.BYTES())) == T.BYTES()
    assert from_arrow(pa.large_binary()) == from_arrow_field(T.BYTES().to_arrow_field("x")) == T.BYTES()


def test_bytes_records_round_trip_through_arrow():
    values = [b"", b"\x00\xff\xfe", "é".encode(), bytes(range(256)) * 40, None]
    batch = to_batch(values, T.BYTES())
    assert batch.schema.field(0).type == pa.large_binary()
    assert from_batch(batch) == values
    records = [(v, i) for i, v in enumerate(values)]
    pairs = to_batch(records, T.TUPLE([T.BYTES(), T.LONG()]))
    assert from_batch(pairs) == records
    with pytest.raises(TypeError, match="expected"):
        to_batch(["not bytes"], T.BYTES())


def test_a_job_keys_sums_and_maps_bytes_declared_as_bytes():
    from stretch.datastream import StreamExecutionEnvironment

    records = [(bytes([i % 5, 0xFF]) if i % 5 else b"", i) for i in range(2000)]
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    summed = env.from_collection(records, T.TUPLE([T.BYTES(), T.LONG()])).key_by(0).sum(1)
    tagged = summed.map(lambda r: (r[0] + b"!", r[1]), output_type=T.TUPLE([T.BYTES(), T.LONG()]))
    with tagged.execute_and_collect("bytes") as results:
        got = sorted(results)
    acc, want = {}, []
    for key, value in records:
        acc[key] = acc.get(key, 0) + value
        want.append((key + b"!", acc[key]))
    assert got == sorted(want)


COMPOSITES = [
    T.ROW([T.LONG(), T.STRING()]),
    T.ROW_NAMED(["a", "b"], [T.LONG(), T.STRING()]),
    T.TUPLE([T.LONG(), T.STRING()]),
    T.PRIMITIVE_ARRAY(T.INT()),
    T.BASIC_ARRAY(T.STRING()),
    T.OBJECT_ARRAY(T.ROW([T.LONG()])),
    T.LIST(T.DOUBLE()),
    T.MAP(T.STRING(), T.LIST(T.LONG())),
    T.TUPLE([T.ROW_NAMED(["x"], [T.PICKLED_BYTE_ARRAY()]), T.LIST(T.TUPLE([T.INT(), T.STRING()]))]),
    T.LIST(T.MAP(T.LONG(), T.ROW([T.SQL_DATE(), T.INSTANT()]))),
]
ALL_TYPES = [t for t, _, _ in SCALARS] + COMPOSITES


@pytest.mark.parametrize(("type_info", "arrow_type", "_repr"), SCALARS, ids=str)
def test_scalar_to_arrow(type_info, arrow_type, _repr):
    assert type_info.to_arrow() == arrow_type


@pytest.mark.parametrize(("type_info", "_arrow", "expected"), SCALARS, ids=str)
def test_scalar_repr_like_pyflink(type_info, _arrow, expected):
    assert repr(type_info) == expected
    assert str(type_info) == expected


def test_composite_reprs_like_pyflink():
    assert repr(T.ROW([T.LONG(), T.STRING()])) == "RowTypeInfo(Long, String)"
    assert repr(T.ROW_NAMED(["a", "b"], [T.LONG(), T.STRING()])) == "RowTypeInfo(a: Long, b: String)"
    assert repr(T.TUPLE([T.LONG(), T.STRING()])) == "TupleTypeInfo(Long, String)"
    assert repr(T.LIST(T.LONG())) == "ListTypeInfo<Long>"
    assert repr(T.MAP(T.STRING(), T.LONG())) == "MapTypeInfo<String, Long>"
    assert repr(T.BASIC_ARRAY(T.STRING())) == "BasicArrayTypeInfo<String>"
    assert repr(T.PRIMITIVE_ARRAY(T.INT())) == "PrimitiveArrayTypeInfo<Integer>"
    assert repr(T.OBJECT_ARRAY(T.LIST(T.LONG()))) == "ObjectArrayTypeInfo<ListTypeInfo<Long>>"


def test_struct_types():
    row = T.ROW([T.LONG(), T.STRING()]).to_arrow()
    assert row == pa.struct([("f0", pa.int64()), ("f1", pa.large_string())])
    named = T.ROW_NAMED(["a", "b"], [T.LONG(), T.STRING()]).to_arrow()
    assert named == pa.struct([("a", pa.int64()), ("b", pa.large_string())])
    tup = T.TUPLE([T.DOUBLE(), T.BOOLEAN()]).to_arrow()
    assert tup == pa.struct([("f0", pa.float64()), ("f1", pa.bool_())])


def test_list_and_map_types():
    for t in (
        T.LIST(T.LONG()),
        T.BASIC_ARRAY(T.LONG()),
        T.PRIMITIVE_ARRAY(T.LONG()),
        T.OBJECT_ARRAY(T.LONG()),
    ):
        assert t.to_arrow() == pa.large_list(pa.int64())
    m = T.MAP(T.STRING(), T.DOUBLE()).to_arrow()
    assert pa.types.is_map(m)
    assert m.key_type == pa.large_string()
    assert m.item_type == pa.float64()


def test_pickled_field_metadata():
    field = T.PICKLED_BYTE_ARRAY().to_arrow_field("x")
    assert field.type == pa.large_binary()
    assert field.metadata == {b"stretch.pickled": b"1"}
    nested = T.TUPLE([T.LONG(), T.PICKLED_BYTE_ARRAY()]).to_arrow()
    assert nested.field(1).metadata == {b"stretch.pickled": b"1"}
    assert nested.field(0).metadata is None


def test_equality_and_hash():
    assert T.LONG() == T.LONG()
    assert T.LONG() != T.INT()
    assert hash(T.LONG()) == hash(T.LONG())
    assert T.PICKLED_BYTE_ARRAY() == T.PICKLED_BYTE_ARRAY()
    assert T.LIST(T.LONG()) == T.LIST(T.LONG())
    assert T.LIST(T.LONG()) != T.LIST(T.INT())
    assert T.LIST(T.LONG()) != T.BASIC_ARRAY(T.LONG())
    assert T.MAP(T.STRING(), T.LONG()) != T.MAP(T.LONG(), T.LONG())
    assert T.TUPLE([T.LONG()]) != T.ROW([T.LONG()])
    # Field names matter (as in Java's RowTypeInfo.equals).
    assert T.ROW_NAMED(["a"], [T.LONG()]) != T.ROW_NAMED(["b"], [T.LONG()])
    assert T.ROW([T.LONG()]) != T.ROW_NAMED(["f0"], [T.LONG()])
    assert T.SQL_DATE() == T.SQL_DATE() and T.SQL_DATE() != T.SQL_TIMESTAMP()
    assert T.LONG() != "Long"
    cache = {t: i for i, t in enumerate(ALL_TYPES)}
    assert all(cache[t] == i for i, t in enumerate(ALL_TYPES))
    rebuilt = [from_json(t.to_json()) for t in ALL_TYPES]
    assert all(cache[t] == i for i, t in enumerate(rebuilt))


@pytest.mark.parametrize("type_info", ALL_TYPES, ids=repr)
def test_json_round_trip(type_info):
    data = type_info.to_json()
    text = json.dumps(data)
    assert from_json(data) == type_info
    assert from_json(text) == type_info
    assert TypeInformation.from_json(json.loads(text)) == type_info
    assert type(from_json(data)) is type(type_info)


def test_json_form_is_small():
    assert T.LONG().to_json() == {"type": "LONG"}
    assert T.ROW_NAMED(["a"], [T.LONG()]).to_json() == {
        "type": "ROW_NAMED",
        "names": ["a"],
        "fields": [{"type": "LONG"}],
    }
    with pytest.raises(ValueError, match="unknown type"):
        from_json({"type": "NOPE"})


@pytest.mark.parametrize("type_info", ALL_TYPES, ids=repr)
def test_pickle_round_trip(type_info):
    assert pickle.loads(pickle.dumps(type_info)) == type_info


FIXED = {
    "LONG": (T.LONG(), np.int64),
    "INT": (T.INT(), np.int32),
    "SHORT": (T.SHORT(), np.int16),
    "BYTE": (T.BYTE(), np.int8),
    "DOUBLE": (T.DOUBLE(), np.float64),
    "FLOAT": (T.FLOAT(), np.float32),
    "BOOLEAN": (T.BOOLEAN(), np.bool_),
    "SQL_TIMESTAMP": (T.SQL_TIMESTAMP(), np.int64),
    "SQL_DATE": (T.SQL_DATE(), np.int32),
}


@pytest.mark.parametrize("name", FIXED)
def test_fixed_width(name):
    type_info, dtype = FIXED[name]
    assert type_info.is_fixed_width()
    assert type_info.numpy_dtype() == np.dtype(dtype)


@pytest.mark.parametrize(
    "type_info",
    [
        T.STRING(),
        T.CHAR(),
        T.BIG_INT(),
        T.BIG_DEC(),
        T.SQL_TIME(),
        T.PICKLED_BYTE_ARRAY(),
        T.LIST(T.LONG()),
        T.TUPLE([T.LONG()]),
        T.MAP(T.LONG(), T.LONG()),
    ],
    ids=repr,
)
def test_not_fixed_width(type_info):
    assert not type_info.is_fixed_width()
    assert type_info.numpy_dtype() is None


@pytest.mark.parametrize(
    ("type_info", "_arrow", "_repr"),
    [s for s in SCALARS if s[0] not in (T.CHAR(), T.PICKLED_BYTE_ARRAY())],
    ids=str,
)
def test_from_arrow_inverts_scalars(type_info, _arrow, _repr):
    assert from_arrow(type_info.to_arrow()) == type_info


def test_from_arrow_decisions():
    assert from_arrow(pa.string()) == T.STRING()  # CHAR does not round-trip: both are str
    assert from_arrow(pa.binary()) == T.PRIMITIVE_ARRAY(T.BYTE())
    assert from_arrow(pa.timestamp("ns")) == T.SQL_TIMESTAMP()
    assert from_arrow(pa.timestamp("ms", tz="Europe/Paris")) == T.INSTANT()
    assert from_arrow(pa.decimal128(10, 2)) == T.BIG_DEC()
    assert from_arrow(pa.list_(pa.int32())) == T.LIST(T.INT())
    assert from_arrow(pa.map_(pa.string(), pa.int64())) == T.MAP(T.STRING(), T.LONG())
    # Bare structs: f0..fn -> TUPLE, other names -> ROW_NAMED.
    assert from_arrow(pa.struct([("f0", pa.int64()), ("f1", pa.string())])) == T.TUPLE([T.LONG(), T.STRING()])
    assert from_arrow(pa.struct([("a", pa.int64())])) == T.ROW_NAMED(["a"], [T.LONG()])
    with pytest.raises(TypeError, match="no stretch TypeInformation"):
        from_arrow(pa.dictionary(pa.int8(), pa.string()))


@pytest.mark.parametrize("type_info", [t for t in ALL_TYPES if t != T.CHAR()], ids=repr)
def test_from_arrow_field_round_trip(type_info):
    """With field metadata every type comes back, except the array flavours (all lists)."""
    back = from_arrow_field(type_info.to_arrow_field("x"))
    if "ArrayTypeInfo<" in repr(type_info) and type_info != T.PRIMITIVE_ARRAY(T.BYTE()):
        assert back.to_arrow() == type_info.to_arrow()
    else:
        assert back == type_info


def test_struct_kinds_survive_nesting():
    t = T.LIST(T.TUPLE([T.ROW([T.LONG()]), T.ROW_NAMED(["f0"], [T.LONG()])]))
    assert from_arrow_field(t.to_arrow_field("x")) == t


def test_row_type_info_accessors():
    named = T.ROW_NAMED(["a", "b"], [T.LONG(), T.STRING()])
    assert isinstance(named, RowTypeInfo)
    assert named.get_field_names() == ["a", "b"]
    assert named.get_field_index("b") == 1
    assert named.get_field_index("zz") == -1
    assert named.get_field_types() == [T.LONG(), T.STRING()]
    assert T.ROW([T.LONG(), T.LONG()]).get_field_names() == ["f0", "f1"]
    tup = T.TUPLE([T.LONG()])
    assert isinstance(tup, TupleTypeInfo)
    assert tup.get_field_types() == [T.LONG()]


def test_invalid_types_rejected():
    with pytest.raises(TypeError, match="primitive array"):
        T.PRIMITIVE_ARRAY(T.STRING())
    with pytest.raises(TypeError, match="boxed primitive array"):
        T.BASIC_ARRAY(T.LIST(T.LONG()))
    with pytest.raises(TypeError):
        T.TUPLE([int])
    with pytest.raises(ValueError, match="names"):
        T.ROW_NAMED(["a"], [T.LONG(), T.LONG()])
    with pytest.raises(ValueError, match="unique"):
        T.ROW_NAMED(["a", "a"], [T.LONG(), T.LONG()])


def test_type_expr():
    assert type_expr(T.TUPLE([T.STRING(), T.LONG()])) == "Types.TUPLE([Types.STRING(), Types.LONG()])"
    assert (
        type_expr(T.ROW_NAMED(["a"], [T.MAP(T.STRING(), T.LIST(T.INT()))]))
        == "Types.ROW_NAMED(['a'], [Types.MAP(Types.STRING(), Types.LIST(Types.INT()))])"
    )
    assert type_expr(T.PRIMITIVE_ARRAY(T.BYTE())) == "Types.PRIMITIVE_ARRAY(Types.BYTE())"


# --------------------------------------------------------------------------------------------------
# time.py
# --------------------------------------------------------------------------------------------------
def test_time():
    assert Time.seconds(2).to_milliseconds() == 2000
    assert Time.minutes(1).to_milliseconds() == 60_000
    assert Time.hours(1).to_milliseconds() == 3_600_000
    assert Time.days(1).to_milliseconds() == 86_400_000
    assert Time.milliseconds(5) == Time(5)
    assert Time.seconds(1) == Time.milliseconds(1000)
    assert Time.seconds(1) != Time.seconds(2)
    assert Time.seconds(1) != Duration.of_seconds(1)
    assert str(Time(7)) == "7 ms"
    assert Time.seconds(1) < Time.seconds(2)
    assert {Time(1): 1}[Time(1)] == 1
    assert Time.seconds(0.5).to_milliseconds() == 500
    assert pickle.loads(pickle.dumps(Time(3))) == Time(3)


def test_duration():
    assert Duration.of_millis(1500).to_milliseconds() == 1500
    assert Duration.of_seconds(2).to_millis() == 2000
    assert Duration.of_minutes(1) == Duration.of_seconds(60)
    assert Duration.of_hours(1) == Duration.of_minutes(60)
    assert Duration.of_days(1) == Duration.of_hours(24)
    assert Duration.of_nanos(1_500_000).to_millis() == 1
    assert Duration.of_nanos(1_500_000).to_nanos() == 1_500_000
    assert Duration.of_seconds(90).to_minutes() == 1
    # Java: toMillis floors; getSeconds floors, getNano is in [0, 1e9).
    assert Duration.of_nanos(-1).to_millis() == -1
    assert Duration.of_nanos(-1).get_seconds() == -1
    assert Duration.of_nanos(-1).get_nano() == 999_999_999
    assert Duration.of_seconds(-90).to_minutes() == -1
    assert repr(Duration.of_seconds(5)) == "Duration.of_seconds(5)"
    assert repr(Duration.of_millis(1500)) == "Duration.of_millis(1500)"
    assert Duration.of_seconds(1) < Duration.of_seconds(2)
    assert hash(Duration.of_seconds(1)) == hash(Duration.of_millis(1000))
    assert Duration.of_seconds(1) != Time.seconds(1)
    assert Duration.of_seconds(1.5).to_millis() == 1500
    assert pickle.loads(pickle.dumps(Duration.of_seconds(3))) == Duration.of_seconds(3)
    with pytest.raises(TypeError):
        Duration.of_seconds("1")


def test_instant():
    assert Instant.of_epoch_milli(1500) == Instant(1, 500_000_000)
    assert Instant.of_epoch_milli(-1) == Instant(-1, 999_000_000)
    assert Instant(-1, 999_000_000).to_epoch_milli() == -1
    assert Instant(5, 1).to_epoch_milli() == 5000
    assert repr(Instant(1, 2)) == "Instant<1, 2>"
    assert pickle.loads(pickle.dumps(Instant(1, 2))) == Instant(1, 2)


# --------------------------------------------------------------------------------------------------
# watermark_strategy.py
# --------------------------------------------------------------------------------------------------
class _Assigner(TimestampAssigner):
    def extract_timestamp(self, value, record_timestamp):
        return value[1]


def test_watermark_strategies():
    mono = WatermarkStrategy.for_monotonous_timestamps()
    assert mono.kind == "monotonous"
    assert mono.max_out_of_orderness == Duration.of_millis(0)
    bounded = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_seconds(5))
    assert bounded.kind == "bounded"
    assert bounded.max_out_of_orderness == Duration.of_seconds(5)
    assert WatermarkStrategy.no_watermarks().kind == "none"
    with pytest.raises(TypeError, match="Duration"):
        WatermarkStrategy.for_bounded_out_of_orderness(5)


def test_with_timestamp_assigner_sets_and_returns_self_like_pyflink():
    strategy = WatermarkStrategy.for_monotonous_timestamps()
    assigner = _Assigner()
    assert strategy.with_timestamp_assigner(assigner) is strategy
    assert strategy.timestamp_assigner is assigner
    assert strategy.timestamp_assigner.extract_timestamp(("a", 42), -1) == 42
    with pytest.raises(TypeError, match="extract_timestamp"):
        strategy.with_timestamp_assigner(lambda v, t: 0)


def test_with_idleness_returns_new_strategy():
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_seconds(1))
    assigner = _Assigner()
    strategy.with_timestamp_assigner(assigner)
    idle = strategy.with_idleness(Duration.of_minutes(1))
    assert idle is not strategy
    assert idle.idle_timeout == Duration.of_minutes(1)
    assert strategy.idle_timeout is None
    assert idle.timestamp_assigner is assigner  # kept (PyFlink drops it)
    assert idle.max_out_of_orderness == Duration.of_seconds(1)
    with pytest.raises(TypeError):
        strategy.with_idleness(1000)


def test_a_type_not_called_is_named_with_the_call_it_needs():
    """``Types.INT`` instead of ``Types.INT()`` is an easy slip; the error says what to write."""
    from stretch.common.records import to_batch

    for make in (
        lambda: to_batch([1], Types.INT),
        lambda: Types.TUPLE([Types.STRING(), Types.LONG]),
        lambda: Types.ROW_NAMED(["a"], [Types.DOUBLE]),
        lambda: Types.LIST(Types.STRING),
        lambda: Types.MAP(Types.STRING(), Types.BOOLEAN),
    ):
        with pytest.raises(TypeError, match=r"got Types\.[A-Z]+ \(call it: Types\.[A-Z]+\(\)\)"):
            make()
    with pytest.raises(TypeError, match=r"got 'int'$"):
        Types.LIST("int")
