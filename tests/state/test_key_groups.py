"""Tests of stretch.state.key_groups and its numba kernels.

Every expected hash is computed by ``ref_hash`` below: ``xxhash`` called directly on byte strings
built by hand from the definition, never through the module under test.
"""

import collections
import decimal
import enum
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from stretch.state import _hash_kernels as kernels
from stretch.state.key_groups import (
    DEFAULT_MAX_PARALLELISM,
    MAX_MAX_PARALLELISM,
    assignment,
    hashes_of,
    key_group,
    key_groups_of,
    key_groups_of_keys,
    operator_index,
    stable_hash,
)

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
NAN_BYTES = bytes.fromhex("000000000000f87f")  # 0x7FF8000000000000 little-endian


# ------------------------------------------------------------------------------------------------
# Independent reference
# ------------------------------------------------------------------------------------------------


def ref_int(n):
    if INT64_MIN <= n <= INT64_MAX:
        return xxhash.xxh64_intdigest(n.to_bytes(8, "little", signed=True), 0)
    return xxhash.xxh64_intdigest(str(decimal.Decimal(n)).encode("ascii"), 6)


def ref_float(x):
    if math.isnan(x):
        raw = NAN_BYTES
    elif x == 0.0:
        raw = b"\0" * 8
    else:
        raw = struct.pack("<d", x)
    return xxhash.xxh64_intdigest(raw, 1)


def ref_hash(key):
    if key is None:
        return xxhash.xxh64_intdigest(b"", 5)
    if isinstance(key, (bool, np.bool_, int, np.integer)):
        return ref_int(int(key))
    if isinstance(key, (float, np.floating)):
        return ref_float(float(key))
    if isinstance(key, str):
        return xxhash.xxh64_intdigest(key.encode("utf-8", "surrogatepass"), 2)
    if isinstance(key, (bytes, bytearray, memoryview)):
        return xxhash.xxh64_intdigest(bytes(key), 3)
    if isinstance(key, dict):  # a struct row from Arrow's to_pylist
        key = tuple(key.values())
    if hasattr(key, "_values"):
        key = tuple(key._values)
    if isinstance(key, tuple):
        raw = b"".join(ref_hash(c).to_bytes(8, "little") for c in key)
        return xxhash.xxh64_intdigest(raw, 4)
    raise AssertionError(f"reference has no rule for {key!r}")


class FakeRow:
    """PyFlink's Row shape: values in ``_values``."""

    def __init__(self, *values):
        self._values = list(values)


class Color(enum.IntEnum):
    RED = 1


class Name(str, enum.Enum):
    ALICE = "alice"


Point = collections.namedtuple("Point", "x y")


# ------------------------------------------------------------------------------------------------
# XXH64 kernel
# ------------------------------------------------------------------------------------------------


def test_xxhash_reference_known_answer():
    # Published XXH64 of the empty input; pins the reference itself.
    assert xxhash.xxh64_intdigest(b"", 0) == 0xEF46DB3751D8E999


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5, 6, 2**64 - 1])
def test_kernel_matches_xxhash_every_length(seed):
    rng = np.random.default_rng(seed % 1000)
    for length in range(101):
        data = rng.integers(0, 256, length, dtype=np.uint8)
        assert kernels.hash_xxh64(data, np.uint64(seed)) == xxhash.xxh64_intdigest(data.tobytes(), seed), (
            length
        )


def test_kernel_matches_xxhash_long_inputs_at_unaligned_offsets():
    rng = np.random.default_rng(7)
    for _ in range(200):
        length = int(rng.integers(101, 5000))
        start = int(rng.integers(0, 16))
        data = rng.integers(0, 256, start + length + 5, dtype=np.uint8)
        out = np.empty(1, dtype=np.uint64)
        kernels.hash_binary(np.array([start, start + length], dtype=np.int64), data, np.uint64(3), out)
        assert out[0] == xxhash.xxh64_intdigest(data[start : start + length].tobytes(), 3)


def test_tuple_kernel_matches_xxhash_for_every_arity():
    rng = np.random.default_rng(3)
    for k in range(12):
        comps = rng.integers(0, 2**64, (k, 5), dtype=np.uint64)
        out = np.empty(5, dtype=np.uint64)
        kernels.hash_tuples(comps, out)
        for i in range(5):
            raw = b"".join(int(comps[j, i]).to_bytes(8, "little") for j in range(k))
            assert out[i] == xxhash.xxh64_intdigest(raw, 4)


# ------------------------------------------------------------------------------------------------
# Scalar path
# ------------------------------------------------------------------------------------------------

INT_KEYS = [
    0,
    1,
    -1,
    2,
    255,
    256,
    -129,
    INT64_MAX,
    INT64_MIN,
    INT64_MAX + 1,
    INT64_MIN - 1,
    2**64,
    10**30,
    -(10**30),
]


@pytest.mark.parametrize("n", INT_KEYS)
def test_int(n):
    if INT64_MIN <= n <= INT64_MAX:
        expected = xxhash.xxh64_intdigest(struct.pack("<q", n), 0)
    else:
        expected = xxhash.xxh64_intdigest(str(n).encode(), 6)
    assert stable_hash(n) == expected


def test_int_beyond_str_digit_limit():
    n = 7 * 10**5000 + 3
    assert stable_hash(n) == xxhash.xxh64_intdigest(str(decimal.Decimal(n)).encode(), 6)
    assert stable_hash(-n) == xxhash.xxh64_intdigest(b"-" + str(decimal.Decimal(n)).encode(), 6)


def test_bool_and_numpy_integers_hash_as_int():
    assert stable_hash(True) == xxhash.xxh64_intdigest(struct.pack("<q", 1), 0) == stable_hash(1)
    assert stable_hash(False) == stable_hash(0)
    assert stable_hash(np.bool_(True)) == stable_hash(1)
    assert stable_hash(np.int8(-3)) == xxhash.xxh64_intdigest(struct.pack("<q", -3), 0)
    assert stable_hash(np.uint32(7)) == stable_hash(7)
    assert stable_hash(np.int64(INT64_MIN)) == xxhash.xxh64_intdigest(struct.pack("<q", INT64_MIN), 0)
    assert stable_hash(np.uint64(2**64 - 1)) == xxhash.xxh64_intdigest(b"18446744073709551615", 6)
    assert stable_hash(Color.RED) == stable_hash(1)


@pytest.mark.parametrize(
    "x",
    [0.0, 1.5, -2.25, 1e300, 5e-324, math.inf, -math.inf, 0.1],
)
def test_float(x):
    assert stable_hash(x) == xxhash.xxh64_intdigest(struct.pack("<d", x), 1)


def test_float_normalisation():
    zero = xxhash.xxh64_intdigest(b"\0" * 8, 1)
    nan = xxhash.xxh64_intdigest(NAN_BYTES, 1)
    assert stable_hash(-0.0) == stable_hash(0.0) == zero
    signalling = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000001))[0]
    negative_payload = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000123))[0]
    for x in [math.nan, -math.nan, signalling, negative_payload, np.float32("nan"), np.float64("nan")]:
        assert stable_hash(x) == nan
    assert stable_hash(np.float32(0.1)) == xxhash.xxh64_intdigest(
        struct.pack("<d", float(np.float32(0.1))), 1
    )
    assert stable_hash(np.float16(-0.0)) == zero


def test_int_and_float_are_different_keys():
    assert stable_hash(1) != stable_hash(1.0)


@pytest.mark.parametrize("s", ["", "a", "user-1", "héllo", "日本語", "🦀 crab", "x" * 100, "\ud800", "\0"])
def test_str(s):
    assert stable_hash(s) == xxhash.xxh64_intdigest(s.encode("utf-8", "surrogatepass"), 2)


def test_str_subclass():
    assert stable_hash(Name.ALICE) == xxhash.xxh64_intdigest(b"alice", 2)
    assert stable_hash(np.str_("é")) == xxhash.xxh64_intdigest("é".encode(), 2)


@pytest.mark.parametrize("b", [b"", b"a", b"\0\xff" * 50])
def test_bytes_like(b):
    expected = xxhash.xxh64_intdigest(b, 3)
    assert stable_hash(b) == expected
    assert stable_hash(bytearray(b)) == expected
    assert stable_hash(memoryview(b)) == expected
    assert stable_hash(np.bytes_(b)) == expected  # a bytes subclass, equal to b


def test_str_and_bytes_do_not_collide():
    assert stable_hash("a") != stable_hash(b"a")


def test_none():
    assert stable_hash(None) == xxhash.xxh64_intdigest(b"", 5)


def test_tuples():
    def h8(*parts):
        return b"".join(p.to_bytes(8, "little") for p in parts)

    i1 = xxhash.xxh64_intdigest(struct.pack("<q", 1), 0)
    sa = xxhash.xxh64_intdigest(b"a", 2)
    none = xxhash.xxh64_intdigest(b"", 5)
    assert stable_hash(()) == xxhash.xxh64_intdigest(b"", 4)
    assert stable_hash((1,)) == xxhash.xxh64_intdigest(h8(i1), 4)
    assert stable_hash((1, "a", None)) == xxhash.xxh64_intdigest(h8(i1, sa, none), 4)
    inner = xxhash.xxh64_intdigest(h8(i1, sa), 4)
    assert stable_hash(((1, "a"), None)) == xxhash.xxh64_intdigest(h8(inner, none), 4)
    long = tuple(range(9))
    assert stable_hash(long) == xxhash.xxh64_intdigest(h8(*[ref_int(i) for i in long]), 4)
    assert stable_hash((1, (2, (3, (4.5, b"x"))))) == ref_hash((1, (2, (3, (4.5, b"x")))))


def test_rows_and_namedtuples_hash_as_tuples():
    assert stable_hash(FakeRow(1, "a")) == stable_hash((1, "a"))
    assert stable_hash(FakeRow(FakeRow(1), None)) == stable_hash(((1,), None))
    assert stable_hash(Point(1, 2)) == stable_hash((1, 2))
    assert stable_hash((True, -0.0)) == stable_hash((1, 0.0))


@pytest.mark.parametrize(
    "bad", [[1], {1: 2}, {1}, object(), 1j, decimal.Decimal(1), (1, [2]), FakeRow([1]), np.datetime64(1, "s")]
)
def test_unhashable_keys(bad):
    with pytest.raises(TypeError, match="cannot be hashed stably; keys must be int, float, str"):
        stable_hash(bad)
    with pytest.raises(TypeError):
        key_group(bad)
    with pytest.raises(TypeError):
        key_groups_of_keys([1, bad], 128)


def test_golden_values():
    # Changing any of these silently re-partitions every persisted job: it must be deliberate.
    assert stable_hash(0) == 0x34C96ACDCADB1BBB
    assert stable_hash(-1) == 0x85D136ADB773C6C9
    assert stable_hash("user-1") == 0x594B7C1AE455D842
    assert stable_hash(b"user-1") == 0x3C2FBA9C5658CED5
    assert stable_hash(1.5) == 0x3E9092EEE57D53BD
    assert stable_hash(None) == 0x4BE1D406981CFD3B
    assert stable_hash((1, "a")) == 0x3C2310B05BE0E2BA
    assert stable_hash(2**64) == 0x26DC543F28496B07
    assert [key_group(k) for k in [0, 1, -1, "user-1", 2**64, ()]] == [59, 21, 73, 66, 7, 91]


def test_same_hash_in_other_processes():
    keys = [0, -1, "user-1", b"x", 1.5, None, (1, ("a", b"b")), 2**70, "é"]
    code = (
        "from stretch.state.key_groups import stable_hash, key_groups_of_keys;"
        f"print([stable_hash(k) for k in {keys!r}]);"
        f"print(key_groups_of_keys({keys!r}, 128).tolist())"
    )
    expected = f"{[stable_hash(k) for k in keys]}\n{key_groups_of_keys(keys, 128).tolist()}\n"
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout == expected


# ------------------------------------------------------------------------------------------------
# Key groups and ownership
# ------------------------------------------------------------------------------------------------


def test_key_group_is_hash_mod_max_parallelism():
    for key in [0, 1, "a", b"a", 2.5, None, (1, 2), 2**65]:
        assert key_group(key) == ref_hash(key) % DEFAULT_MAX_PARALLELISM
        for maxp in [1, 2, 7, 100, 128, MAX_MAX_PARALLELISM]:
            assert key_group(key, maxp) == ref_hash(key) % maxp


@pytest.mark.parametrize("maxp", [0, -1, MAX_MAX_PARALLELISM + 1])
def test_bad_max_parallelism(maxp):
    with pytest.raises(ValueError, match="max_parallelism"):
        key_group(1, maxp)
    with pytest.raises(ValueError, match="max_parallelism"):
        key_groups_of(np.arange(3), maxp)
    with pytest.raises(ValueError, match="max_parallelism"):
        key_groups_of_keys([1], maxp)
    with pytest.raises(ValueError, match="max_parallelism"):
        assignment(1, maxp)


@pytest.mark.parametrize("maxp", [1, 2, 3, 7, 128, 1000])
def test_assignment_matches_rule_and_covers_every_instance(maxp):
    kg = np.arange(maxp)
    for p in range(1, maxp + 1):
        owners = assignment(p, maxp)
        assert owners.dtype == np.int16
        assert owners.shape == (maxp,)
        assert owners.tolist() == [g * p // maxp for g in range(maxp)]
        assert set(owners.tolist()) == set(range(p))
        assert np.all(np.diff(owners) >= 0)  # contiguous ranges
        if p in (1, maxp // 2 or 1, maxp):
            assert [operator_index(int(g), p, maxp) for g in kg] == owners.tolist()


def test_assignment_at_the_maximum():
    for p in [1, 2, 3, 1000, 32767, MAX_MAX_PARALLELISM]:
        owners = assignment(p, MAX_MAX_PARALLELISM)
        assert np.array_equal(
            owners.astype(np.int64), np.arange(MAX_MAX_PARALLELISM) * p // MAX_MAX_PARALLELISM
        )
        assert len(np.unique(owners)) == p
    assert int(assignment(MAX_MAX_PARALLELISM, MAX_MAX_PARALLELISM)[-1]) == MAX_MAX_PARALLELISM - 1


@pytest.mark.parametrize(("p", "maxp"), [(0, 128), (-1, 128), (129, 128), (2, 1), (1, 0), (1, 32769)])
def test_bad_parallelism(p, maxp):
    with pytest.raises(ValueError):
        assignment(p, maxp)
    with pytest.raises(ValueError):
        operator_index(0, p, maxp)


@pytest.mark.parametrize("kg", [-1, 128, 1000])
def test_operator_index_rejects_key_group_out_of_range(kg):
    with pytest.raises(ValueError, match="key_group"):
        operator_index(kg, 2, 128)


# ------------------------------------------------------------------------------------------------
# Vectorized path == scalar path
# ------------------------------------------------------------------------------------------------


def scalar_hashes(arr):
    return [ref_hash(v) for v in arr.to_pylist()]


def with_nulls(values, rng, frac=0.2):
    return [None if rng.random() < frac else v for v in values]


def random_strings(rng, n, max_len=80):
    alphabet = list("abcxyz0123456789-_ é日🦀")
    out = []
    for _ in range(n):
        length = int(rng.integers(0, max_len))
        out.append("".join(rng.choice(alphabet, length)))
    return out


def arrow_cases():
    rng = np.random.default_rng(11)
    n = 300
    cases = {}
    for typ in [
        pa.int8(),
        pa.int16(),
        pa.int32(),
        pa.int64(),
        pa.uint8(),
        pa.uint16(),
        pa.uint32(),
        pa.uint64(),
    ]:
        info = np.iinfo(typ.to_pandas_dtype())
        values = [int(v) for v in rng.integers(info.min, info.max, n, endpoint=True, dtype=info.dtype)]
        values[:3] = [int(info.min), int(info.max), 0]
        cases[str(typ)] = pa.array(with_nulls(values, rng), type=typ)
    cases["uint64_all_small"] = pa.array(rng.integers(0, 2**63 - 1, n, dtype=np.uint64))
    cases["bool"] = pa.array(with_nulls([bool(b) for b in rng.integers(0, 2, n)], rng), type=pa.bool_())
    floats = list(rng.normal(size=n) * 1e6)
    floats[:8] = [0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 5e-324, 1e308]
    for typ in [pa.float64(), pa.float32()]:
        cases[str(typ)] = pa.array(with_nulls(floats, rng), type=typ)
    cases["halffloat"] = pa.array(
        np.array(
            [0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 1e-7, *rng.normal(size=40)],
            dtype=np.float16,
        )
    )
    strings = random_strings(rng, n)
    strings[:3] = ["", "x" * 33, "y" * 1000]
    for typ in [pa.string(), pa.large_string(), pa.string_view()]:
        cases[str(typ)] = pa.array(with_nulls(strings, rng), type=typ)
    blobs = [bytes(rng.integers(0, 256, int(rng.integers(0, 70)), dtype=np.uint8)) for _ in range(n)]
    for typ in [pa.binary(), pa.large_binary(), pa.binary_view()]:
        cases[str(typ)] = pa.array(with_nulls(blobs, rng), type=typ)
    cases["fixed_size_binary"] = pa.array(
        with_nulls([bytes(rng.integers(0, 256, 5, dtype=np.uint8)) for _ in range(n)], rng), type=pa.binary(5)
    )
    cases["null"] = pa.nulls(20)
    cases["all_null_int"] = pa.array([None] * 10, type=pa.int64())
    cases["empty_strings"] = pa.array([""] * 10)
    cases["dict_string"] = pa.array(with_nulls([f"k{i % 7}" for i in range(n)], rng)).dictionary_encode()
    cases["dict_int"] = pa.array(
        with_nulls([i % 5 for i in range(n)], rng), type=pa.int32()
    ).dictionary_encode()
    ints = pa.array(with_nulls([int(v) for v in rng.integers(-1000, 1000, n)], rng), type=pa.int64())
    strs = pa.array(with_nulls(strings, rng), type=pa.string())
    mask = pa.array(rng.random(n) < 0.1)
    cases["struct"] = pa.StructArray.from_arrays([ints, strs], names=["a", "b"], mask=mask)
    cases["struct_5_fields"] = pa.StructArray.from_arrays(
        [ints, strs, pa.array(floats), pa.array(blobs), pa.array([bool(i % 2) for i in range(n)])],
        names=list("abcde"),
    )
    inner = pa.StructArray.from_arrays([ints, strs], names=["x", "y"])
    cases["nested_struct"] = pa.StructArray.from_arrays([inner, ints], names=["in", "z"])
    cases["struct_of_dict"] = pa.StructArray.from_arrays([cases["dict_string"], ints], names=["d", "i"])
    return cases


ARROW_CASES = arrow_cases()


@pytest.mark.parametrize("name", list(ARROW_CASES))
def test_arrow_column_matches_scalar(name):
    arr = ARROW_CASES[name]
    hashes = hashes_of(arr)
    assert hashes.dtype == np.uint64
    assert hashes.tolist() == scalar_hashes(arr)


@pytest.mark.parametrize("name", list(ARROW_CASES))
def test_sliced_arrow_column_matches_scalar(name):
    arr = ARROW_CASES[name]
    for start, length in [(1, None), (3, 7), (len(arr) - 2, None), (5, 0)]:
        sliced = arr.slice(start, length)
        assert hashes_of(sliced).tolist() == scalar_hashes(sliced), (start, length)


@pytest.mark.parametrize(
    "name", ["int64", "string", "large_binary", "struct", "dict_string", "bool", "uint64"]
)
def test_chunked_array_matches_scalar(name):
    arr = ARROW_CASES[name]
    chunked = pa.chunked_array([arr.slice(0, 10), arr.slice(10, 0), arr.slice(10, 100), arr.slice(110)])
    assert hashes_of(chunked).tolist() == scalar_hashes(arr)
    assert hashes_of(pa.chunked_array([arr])).tolist() == scalar_hashes(arr)
    assert hashes_of(pa.chunked_array([], type=arr.type)).tolist() == []


def test_uint64_above_int64_max_uses_big_int_rule():
    values = [0, INT64_MAX, INT64_MAX + 1, 2**64 - 1, None, 5]
    arr = pa.array(values, type=pa.uint64())
    assert hashes_of(arr).tolist() == [ref_hash(v) for v in values]
    assert hashes_of(arr.slice(2)).tolist() == [ref_hash(v) for v in values[2:]]
    np_values = np.array([1, 2**64 - 1, INT64_MAX + 1], dtype=np.uint64)
    assert hashes_of(np_values).tolist() == [ref_int(int(v)) for v in np_values]


def test_struct_row_is_tuple_of_fields():
    arr = pa.array(
        [{"a": 1, "b": "x"}, {"a": None, "b": None}], type=pa.struct([("a", pa.int64()), ("b", pa.string())])
    )
    assert hashes_of(arr).tolist() == [stable_hash((1, "x")), stable_hash((None, None))]


def test_empty_columns():
    for arr in [pa.array([], pa.int64()), pa.array([], pa.string()), np.array([], dtype=np.int64)]:
        assert hashes_of(arr).shape == (0,)
        assert key_groups_of(arr, 128).dtype == np.uint16


@pytest.mark.parametrize(
    "arr",
    [
        pa.array([1], pa.timestamp("s")),
        pa.array([[1]]),
        pa.array([decimal.Decimal(1)]),
        pa.array([1], pa.date32()),
        pa.array([{1: 2}], pa.map_(pa.int64(), pa.int64())),
    ],
)
def test_unsupported_arrow_types(arr):
    with pytest.raises(TypeError, match="cannot be hashed stably"):
        hashes_of(arr)


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_]
)
def test_numpy_integer_columns(dtype):
    rng = np.random.default_rng(5)
    if dtype is np.bool_:
        values = rng.integers(0, 2, 200).astype(np.bool_)
    else:
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, 200, endpoint=True, dtype=dtype)
    assert hashes_of(values).tolist() == [ref_hash(v) for v in values.tolist()]
    assert hashes_of(values[::3]).tolist() == [ref_hash(v) for v in values[::3].tolist()]
    swapped = values.astype(values.dtype.newbyteorder(">"))
    assert hashes_of(swapped).tolist() == [ref_hash(v) for v in values.tolist()]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_numpy_float_columns(dtype):
    values = np.array([0.0, -0.0, np.nan, -np.nan, np.inf, 1.5, -3.25, 1e-3], dtype=dtype)
    assert hashes_of(values).tolist() == [ref_float(float(v)) for v in values]


def test_numpy_str_bytes_and_object_columns():
    u = np.array(["a", "", "héllo"])
    assert hashes_of(u).tolist() == [ref_hash(s) for s in u.tolist()]
    b = np.array([b"a", b"", b"xyz"])
    assert hashes_of(b).tolist() == [ref_hash(s) for s in b.tolist()]
    objs = np.array([1, "a", None, (1, 2), 2.5, 2**70], dtype=object)
    assert hashes_of(objs).tolist() == [ref_hash(k) for k in objs]


def test_bad_numpy_columns():
    with pytest.raises(ValueError, match="1-dimensional"):
        hashes_of(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(TypeError, match="cannot be hashed stably"):
        hashes_of(np.array(["2020-01-01"], dtype="datetime64[D]"))
    with pytest.raises(TypeError, match="cannot be hashed stably"):
        hashes_of(np.array([1j]))
    with pytest.raises(TypeError):
        hashes_of([1, 2, 3])


@pytest.mark.parametrize("maxp", [1, 2, 100, 128, 1000, MAX_MAX_PARALLELISM])
def test_key_groups_of(maxp):
    for arr in [ARROW_CASES["int64"], ARROW_CASES["string"], ARROW_CASES["struct"], np.arange(-50, 50)]:
        groups = key_groups_of(arr, maxp)
        assert groups.dtype == np.uint16
        expected = [
            ref_hash(v) % maxp for v in (arr.to_pylist() if isinstance(arr, pa.Array) else arr.tolist())
        ]
        assert groups.tolist() == expected


# ------------------------------------------------------------------------------------------------
# key_groups_of_keys == scalar path
# ------------------------------------------------------------------------------------------------

LIST_CASES = {
    "ints": [*range(-100, 100), INT64_MIN, INT64_MAX],
    "ints_and_bools": [True, 1, False, 0, 7],
    "bools": [True, False, True],
    "big_int_among_ints": [1, 2, 2**63, -(2**63) - 1, 3],
    "floats": [0.0, -0.0, math.nan, 1.5, math.inf, -1e300],
    "ints_and_floats": [1, 2.5, 3],
    "strs": ["", "a", "héllo", "x" * 100, "🦀"],
    "strs_with_surrogate": ["a", "\ud800", "b"],
    "bytes": [b"", b"a", b"\xff" * 40],
    "bytes_and_bytearray": [b"a", bytearray(b"a")],
    "str_and_bytes": ["a", b"a"],
    "ints_and_none": [1, None, 2],
    "tuples": [(1, "a"), (2, "b"), ((1,), None)],
    "rows": [FakeRow(1, "a"), (1, "a")],
    "numpy_scalars": [np.int64(3), np.float32(1.5), np.str_("s"), np.bool_(False)],
    "int_subclass": [Color.RED, 1, 2],
    "str_subclass": [Name.ALICE, "alice"],
    "single": [42],
    "empty": [],
}


@pytest.mark.parametrize("name", list(LIST_CASES))
@pytest.mark.parametrize("maxp", [128, 100])
def test_key_groups_of_keys_matches_scalar(name, maxp):
    keys = LIST_CASES[name]
    groups = key_groups_of_keys(keys, maxp)
    assert groups.dtype == np.uint16
    assert groups.tolist() == [ref_hash(k) % maxp for k in keys]
    assert groups.tolist() == [key_group(k, maxp) for k in keys]


SCALAR_STRATEGIES = [
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=INT64_MIN, max_value=INT64_MAX),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
    st.binary(),
]
scalar_keys = st.one_of(*SCALAR_STRATEGIES)
keys_strategy = st.recursive(
    scalar_keys, lambda children: st.lists(children, max_size=4).map(tuple), max_leaves=8
)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(st.lists(keys_strategy, max_size=20), *(st.lists(s, max_size=40) for s in SCALAR_STRATEGIES))
)
def test_key_groups_of_keys_property(keys):
    assert key_groups_of_keys(keys, 128).tolist() == [ref_hash(k) % 128 for k in keys]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text()), max_size=50), st.integers(0, 10))
def test_string_column_property(values, start):
    arr = pa.array(values, type=pa.string()).slice(min(start, len(values)))
    assert hashes_of(arr).tolist() == scalar_hashes(arr)
