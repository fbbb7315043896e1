"""Tests of stretch.state.key_codec: canonical key bytes and their inverse."""

import collections
import decimal
import enum
import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stretch.state.key_codec import decode_key, encode_key
from stretch.state.key_groups import stable_hash

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class FakeRow:
    """PyFlink's Row shape: values in ``_values``."""

    def __init__(self, *values):
        self._values = list(values)


class Color(enum.IntEnum):
    RED = 1


Point = collections.namedtuple("Point", "x y")


def u32(n):
    return struct.pack("<I", n)


# ------------------------------------------------------------------------------------------------
# Exact layout
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (0, b"i" + bytes(8)),
        (1, b"i" + b"\x01" + bytes(7)),
        (-1, b"i" + b"\xff" * 8),
        (INT64_MAX, b"i" + b"\xff" * 7 + b"\x7f"),
        (INT64_MIN, b"i" + bytes(7) + b"\x80"),
        (True, b"i" + b"\x01" + bytes(7)),
        (False, b"i" + bytes(8)),
        (INT64_MAX + 1, b"I9223372036854775808"),
        (INT64_MIN - 1, b"I-9223372036854775809"),
        (10**30, b"I1" + b"0" * 30),
        (1.5, b"f" + struct.pack("<d", 1.5)),
        (0.0, b"f" + bytes(8)),
        (-0.0, b"f" + bytes(8)),
        (math.nan, b"f" + bytes.fromhex("000000000000f87f")),
        (-math.inf, b"f" + struct.pack("<d", -math.inf)),
        ("", b"s"),
        ("é", b"s\xc3\xa9"),
        ("\ud800", b"s\xed\xa0\x80"),
        (b"", b"b"),
        (b"\x00x", b"b\x00x"),
        (None, b"n"),
        ((), b"t" + u32(0)),
        ((1, "ab"), b"t" + u32(2) + u32(9) + b"i\x01" + bytes(7) + u32(3) + b"sab"),
        (((None,), b""), b"t" + u32(2) + u32(10) + b"t" + u32(1) + u32(1) + b"n" + u32(1) + b"b"),
    ],
)
def test_layout(key, expected):
    assert encode_key(key) == expected


def test_nan_payloads_fold_to_canonical_nan():
    canonical = encode_key(math.nan)
    for bits in [0x7FF0000000000001, 0xFFF8000000000000, 0x7FFFFFFFFFFFFFFF, 0xFFF8000000000123]:
        assert encode_key(struct.unpack("<d", struct.pack("<Q", bits))[0]) == canonical
    assert encode_key(np.float32("nan")) == canonical


def test_numpy_scalars_and_subclasses_encode_as_base_types():
    assert encode_key(np.int64(-5)) == encode_key(-5)
    assert encode_key(np.uint64(2**64 - 1)) == b"I18446744073709551615"
    assert encode_key(np.bool_(True)) == encode_key(1)
    assert encode_key(np.float32(0.5)) == encode_key(0.5)
    assert encode_key(np.str_("x")) == encode_key("x")
    assert encode_key(Color.RED) == encode_key(1)
    assert encode_key(Point(1, 2)) == encode_key((1, 2))
    assert encode_key(FakeRow(1, FakeRow("a"))) == encode_key((1, ("a",)))
    assert encode_key(bytearray(b"ab")) == encode_key(memoryview(b"ab")) == encode_key(b"ab")


@pytest.mark.parametrize("bad", [[1], {1: 2}, {1}, object(), 1j, decimal.Decimal(1), (1, [2]), FakeRow([1])])
def test_unsupported_keys(bad):
    with pytest.raises(TypeError, match="cannot be hashed stably; keys must be int, float, str"):
        encode_key(bad)


def test_huge_int_beyond_str_digit_limit_round_trips():
    n = -(3 * 10**6000 + 17)
    data = encode_key(n)
    assert data[:2] == b"I-"
    assert decode_key(data) == n


def test_bool_decodes_as_int():
    value = decode_key(encode_key(True))
    assert value == 1
    assert type(value) is int
    assert decode_key(encode_key((True, False))) == (1, 0)


def test_negative_zero_decodes_as_positive_zero():
    assert math.copysign(1.0, decode_key(encode_key(-0.0))) == 1.0


def test_decode_accepts_buffers():
    data = encode_key((1, "x"))
    assert decode_key(bytearray(data)) == (1, "x")
    assert decode_key(memoryview(data)) == (1, "x")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"z",
        b"i\x00",
        b"i" + bytes(9),
        b"nn",
        b"f" + bytes(7),
        b"f" + struct.pack("<d", -0.0),
        b"f" + struct.pack("<Q", 0x7FF0000000000001),
        b"I123",
        b"I0",
        b"I09223372036854775808",
        b"I+9223372036854775808",
        b"I 9223372036854775808",
        b"I",
        b"t",
        b"t" + u32(1),
        b"t" + u32(1) + u32(5) + b"n",
        b"t" + u32(1) + u32(2) + b"nn",
        b"t" + u32(0) + b"n",
    ],
)
def test_decode_rejects_non_canonical_or_truncated(data):
    with pytest.raises(ValueError):
        decode_key(data)


# ------------------------------------------------------------------------------------------------
# Properties
# ------------------------------------------------------------------------------------------------

scalar_keys = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=INT64_MIN, max_value=INT64_MAX),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
    st.sampled_from(["\ud800", "a\udfffb", "\ud83d\ude00"]),
    st.binary(),
)
keys = st.recursive(scalar_keys, lambda children: st.lists(children, max_size=5).map(tuple), max_leaves=12)


def canon(key):
    """Type-aware value of a key, under which decode(encode(k)) must equal k."""
    if key is None:
        return ("none",)
    if isinstance(key, (bool, np.bool_, int, np.integer)):
        return ("int", int(key))
    if isinstance(key, (float, np.floating)):
        x = float(key)
        return ("float", "nan") if math.isnan(x) else ("float", x + 0.0)
    if isinstance(key, str):
        return ("str", key)
    if isinstance(key, (bytes, bytearray, memoryview)):
        return ("bytes", bytes(key))
    if hasattr(key, "_values"):
        key = tuple(key._values)
    return ("tuple", tuple(canon(c) for c in key))


@settings(max_examples=300, deadline=None)
@given(keys)
def test_round_trip(key):
    data = encode_key(key)
    decoded = decode_key(data)
    assert canon(decoded) == canon(key)
    assert encode_key(decoded) == data
    if isinstance(key, tuple):
        assert type(decoded) is tuple


def equal_variant(key, rnd):
    """A different object that Python considers the same key (NaN: another NaN)."""
    if isinstance(key, bool):
        return rnd.choice([int(key), np.bool_(key), key])
    if isinstance(key, int):
        options = [key, Color.RED] if key == 1 else [key]
        if key in (0, 1):
            options.append(bool(key))
        if INT64_MIN <= key <= INT64_MAX:
            options.append(np.int64(key))
        return rnd.choice(options)
    if isinstance(key, float):
        if math.isnan(key):
            return struct.unpack(
                "<d", struct.pack("<Q", rnd.choice([0x7FF0000000000001, 0xFFF8000000000000]))
            )[0]
        if key == 0.0:
            return rnd.choice([0.0, -0.0, np.float64(-0.0)])
        return rnd.choice([key, np.float64(key)])
    if isinstance(key, str):
        return rnd.choice([key, np.str_(key), "".join(list(key))])
    if isinstance(key, bytes):
        return rnd.choice(
            [bytearray(key), memoryview(key), np.bytes_(key) if not key.endswith(b"\0") else key]
        )
    if isinstance(key, tuple):
        parts = [equal_variant(c, rnd) for c in key]
        return rnd.choice([tuple(parts), FakeRow(*parts)])
    return key


def python_equal(a, b):
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(b, FakeRow):
        b = tuple(b._values)
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(python_equal, a, b))
    return a == b


@settings(max_examples=300, deadline=None)
@given(keys, st.randoms(use_true_random=False))
def test_equal_keys_encode_and_hash_identically(key, rnd):
    other = equal_variant(key, rnd)
    assert python_equal(key, other)
    assert encode_key(other) == encode_key(key)
    assert stable_hash(other) == stable_hash(key)


@settings(max_examples=300, deadline=None)
@given(keys, keys)
def test_different_keys_encode_differently(a, b):
    if canon(a) != canon(b):
        assert encode_key(a) != encode_key(b)
