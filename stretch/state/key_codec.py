"""Canonical byte encoding of keys, for key equality inside shared-memory state tables.

State tables live in shared memory and are read by several processes, so a key cannot be stored as
a Python object: it is stored as bytes, and two keys are the same key exactly when their bytes are
equal. The encoding is therefore *canonical*: keys that are equal in Python's ``==`` sense encode to
identical bytes (``True`` and ``1``; ``-0.0`` and ``0.0``; ``bytes``, ``bytearray`` and
``memoryview``; a tuple and a Row with the same values). The one deliberate exception is ``int``
against ``float``: ``1`` and ``1.0`` encode (and hash, see :mod:`stretch.state.key_groups`)
differently, as in Flink, where a key's type is part of the key. All NaNs encode as the one
canonical quiet NaN, so every NaN key lands in the same state slot.

Layout: a tag byte, then the payload.

====  =========================================================================================
tag   payload
====  =========================================================================================
i     int in int64 range (bool as 0/1): 8 bytes little-endian two's complement
I     int outside int64: ASCII decimal, canonical (optional ``-``, no leading zeros)
f     float: 8 bytes little-endian IEEE 754 double, ``-0.0`` -> ``0.0``, NaN -> ``0x7FF8000000000000``
s     str: UTF-8 (lone surrogates kept with ``surrogatepass``, so every Python str round-trips)
b     bytes: the raw bytes
n     None: empty
t     tuple: 4-byte LE component count, then per component a 4-byte LE length and its encoding
====  =========================================================================================

This module is also the home of the small helpers the stable hash shares with the codec (the
canonical float bytes, the big-int text, Row duck-typing and the unsupported-key error), so that
the hash and the codec cannot drift apart. It imports nothing heavy (no numba).
"""

from __future__ import annotations

import decimal
import math
import re
import struct

import numpy as np

__all__ = ["decode_key", "encode_key"]

_INT64 = struct.Struct("<q")
_UINT32 = struct.Struct("<I")
_UINT64 = struct.Struct("<Q")
_DOUBLE = struct.Struct("<d")

CANONICAL_NAN_BITS = 0x7FF8000000000000
_NAN_BYTES = _UINT64.pack(CANONICAL_NAN_BITS)
_ZERO_BYTES = bytes(8)

_BIG_INT_RE = re.compile(rb"-?[1-9][0-9]*")
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def canonical_float_bytes(x: float) -> bytes:
    """8 little-endian bytes of ``x`` with ``-0.0`` -> ``0.0`` and every NaN -> the canonical NaN.

    ``-0.0 == 0.0`` in Python, so they must share bytes; NaN payloads and signs vary by platform
    and operation, so all NaNs are folded into one value rather than scattered over state slots.
    """
    if math.isnan(x):
        return _NAN_BYTES
    if x == 0.0:
        return _ZERO_BYTES
    return _DOUBLE.pack(x)


def int64_bytes(n: int) -> bytes | None:
    """8 little-endian two's-complement bytes of ``n``, or None if ``n`` is outside int64."""
    try:
        return _INT64.pack(n)
    except struct.error:
        return None


def big_int_text(n: int) -> bytes:
    """ASCII decimal of an int of any size.

    ``str(n)`` refuses ints longer than ``sys.get_int_max_str_digits()`` (4300 digits by default);
    ``decimal.Decimal`` converts exactly without that limit, so no int key is ever unencodable.
    """
    try:
        return str(n).encode("ascii")
    except ValueError:
        return str(decimal.Decimal(n)).encode("ascii")


def _int_from_text(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:  # longer than the int/str conversion limit
        return int(decimal.Decimal(text.decode("ascii")))


def row_values(key: object) -> tuple | None:
    """The values of a PyFlink-style Row (anything with a ``_values`` sequence), else None.

    Duck-typed so that ``stretch.common.Row`` (and a real ``pyflink.common.Row``) work as keys
    without this low-level module importing either; a Row key is the same key as the tuple of
    its values.
    """
    values = getattr(key, "_values", None)
    if values is None or isinstance(values, (str, bytes, bytearray)):
        return None
    try:
        return tuple(values)
    except TypeError:
        return None


def unsupported_key(key: object) -> TypeError:
    """The error for a key that has no stable hash or canonical encoding."""
    return TypeError(
        f"key {key!r} of type {type(key).__qualname__} cannot be hashed stably; keys must be "
        "int, float, str, bytes, bool, None or tuples of these"
    )


def encode_key(key: object) -> bytes:
    """Canonical bytes of ``key`` (see the module docstring for the layout).

    Raises TypeError for keys that are not int, float, str, bytes, bool, None, or tuples/Rows of
    these, because any other type has no equality that every process agrees on.
    """
    out = bytearray()
    _encode_into(key, out)
    return bytes(out)


def _encode_into(key: object, out: bytearray) -> None:
    t = type(key)
    if t is int or t is bool:
        _encode_int(key, out)  # type: ignore[arg-type]
    elif t is str:
        out += b"s"
        out += key.encode("utf-8", "surrogatepass")  # type: ignore[union-attr]
    elif t is float:
        out += b"f"
        out += canonical_float_bytes(key)  # type: ignore[arg-type]
    elif key is None:
        out += b"n"
    elif t is bytes:
        out += b"b"
        out += key  # type: ignore[operator]
    elif t is tuple:
        _encode_tuple(key, out)  # type: ignore[arg-type]
    else:
        _encode_other(key, out)


def _encode_int(n: int, out: bytearray) -> None:
    raw = int64_bytes(n)
    if raw is not None:
        out += b"i"
        out += raw
    else:
        out += b"I"
        out += big_int_text(int(n))


def _encode_tuple(values: tuple, out: bytearray) -> None:
    out += b"t"
    out += _UINT32.pack(len(values))
    for value in values:
        length_at = len(out)
        out += b"\0\0\0\0"
        _encode_into(value, out)
        out[length_at : length_at + 4] = _UINT32.pack(len(out) - length_at - 4)


def _encode_other(key: object, out: bytearray) -> None:
    # Subclasses (IntEnum, StrEnum, named tuples) and numpy scalars: encode as the base type they
    # compare equal to.
    if isinstance(key, (bool, np.bool_, int, np.integer)):
        _encode_int(int(key), out)  # type: ignore[arg-type]
    elif isinstance(key, (float, np.floating)):
        out += b"f"
        out += canonical_float_bytes(float(key))  # type: ignore[arg-type]
    elif isinstance(key, str):
        out += b"s"
        out += key.encode("utf-8", "surrogatepass")
    elif isinstance(key, (bytes, bytearray)):
        out += b"b"
        out += key
    elif isinstance(key, memoryview):
        out += b"b"
        out += key.tobytes()
    elif isinstance(key, tuple):
        _encode_tuple(key, out)
    else:
        values = row_values(key)
        if values is None:
            raise unsupported_key(key)
        _encode_tuple(values, out)


def decode_key(data: bytes) -> object:
    """Inverse of :func:`encode_key`.

    Tuples and Rows come back as plain tuples, bools as ints (``True`` encodes as ``1``, because
    they are the same dict key in Python), numpy scalars as Python scalars, and ``-0.0``/NaN
    payloads in their canonical form. Raises ValueError if ``data`` is not a canonical encoding.
    """
    data = bytes(data)  # no copy for bytes; accepts bytearray / memoryview of a state table
    value, end = _decode_at(data, 0, len(data))
    if end != len(data):
        raise ValueError(f"trailing bytes after key encoding at offset {end}")
    return value


def _decode_at(data: bytes, pos: int, end: int) -> tuple[object, int]:
    if pos >= end:
        raise ValueError("truncated key encoding: missing tag byte")
    tag = data[pos]
    pos += 1
    if tag == 0x69:  # i
        _need(pos, 8, end)
        return _INT64.unpack_from(data, pos)[0], pos + 8
    if tag == 0x73:  # s
        return data[pos:end].decode("utf-8", "surrogatepass"), end
    if tag == 0x66:  # f
        _need(pos, 8, end)
        raw = data[pos : pos + 8]
        value = _DOUBLE.unpack(raw)[0]
        if canonical_float_bytes(value) != raw:
            raise ValueError("non-canonical float in key encoding")
        return value, pos + 8
    if tag == 0x62:  # b
        return data[pos:end], end
    if tag == 0x6E:  # n
        return None, pos
    if tag == 0x74:  # t
        _need(pos, 4, end)
        (count,) = _UINT32.unpack_from(data, pos)
        pos += 4
        items = []
        for _ in range(count):
            _need(pos, 4, end)
            (length,) = _UINT32.unpack_from(data, pos)
            pos += 4
            _need(pos, length, end)
            item, item_end = _decode_at(data, pos, pos + length)
            if item_end != pos + length:
                raise ValueError(f"tuple component at offset {pos} has trailing bytes")
            items.append(item)
            pos += length
        return tuple(items), pos
    if tag == 0x49:  # I
        text = data[pos:end]
        if not _BIG_INT_RE.fullmatch(text):
            raise ValueError(f"invalid big-int text {text[:40]!r} in key encoding")
        value = _int_from_text(text)
        if _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError("int64-range value encoded as big int")
        return value, end
    raise ValueError(f"unknown key encoding tag {bytes([tag])!r} at offset {pos - 1}")


def _need(pos: int, size: int, end: int) -> None:
    if pos + size > end:
        raise ValueError(f"truncated key encoding: need {size} bytes at offset {pos}, have {end - pos}")
