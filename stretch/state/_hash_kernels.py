"""Numba kernels for the vectorized stable hash (private; see :mod:`stretch.state.key_groups`).

Every kernel computes exactly what the scalar path (the ``xxhash`` package) computes for the same
key, one row at a time, writing into a caller-allocated ``uint64`` array. XXH64 is written out here
from the reference algorithm (https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md):
the 32-byte stripe loop with four accumulators, then 8-, 4- and 1-byte tails, then the avalanche.

Numba pitfall this file is written around: any arithmetic that mixes ``uint64`` with a signed
int (including a bare Python literal) is promoted to float64 and silently loses bits. Every
operand below is therefore an ``np.uint64`` (module constants, or wrapped literals), and offsets are
kept as int64 and only converted for the length term.

Lanes are read from the byte buffers with one unaligned load each (an llvmlite intrinsic, byte-
swapped on big-endian hosts), so Arrow data buffers are hashed in place at any byte offset.
"""

from __future__ import annotations

import sys

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

P1 = np.uint64(0x9E3779B185EBCA87)
P2 = np.uint64(0xC2B2AE3D27D4EB4F)
P3 = np.uint64(0x165667B19E3779F9)
P4 = np.uint64(0x85EBCA77C2B2AE63)
P5 = np.uint64(0x27D4EB2F165667C5)

# Seeds of the key types; they must match stretch.state.key_groups.
SEED_INT = np.uint64(0)
SEED_FLOAT = np.uint64(1)
SEED_STR = np.uint64(2)
SEED_BYTES = np.uint64(3)
SEED_TUPLE = np.uint64(4)
SEED_NONE = np.uint64(5)

CANONICAL_NAN = np.uint64(0x7FF8000000000000)
_ZERO = np.uint64(0)
_EIGHT = np.uint64(8)

_OPTS = {"cache": True, "nogil": True}


@njit(**_OPTS)
def _rotl(x, r):
    return (x << r) | (x >> (np.uint64(64) - r))


@njit(**_OPTS)
def _round(acc, lane):
    acc = acc + lane * P2
    acc = _rotl(acc, np.uint64(31))
    return acc * P1


@njit(**_OPTS)
def _merge_round(acc, val):
    acc = acc ^ _round(_ZERO, val)
    return acc * P1 + P4


@njit(**_OPTS)
def _avalanche(h):
    h = h ^ (h >> np.uint64(33))
    h = h * P2
    h = h ^ (h >> np.uint64(29))
    h = h * P3
    return h ^ (h >> np.uint64(32))


@njit(**_OPTS)
def _tail8(h, lane):
    h = h ^ _round(_ZERO, lane)
    return _rotl(h, np.uint64(27)) * P1 + P4


def _unaligned_load(width: int):
    """An intrinsic ``(uint8 array, int64 index) -> uint64``: one unaligned little-endian load.

    Assembling the value from single bytes costs 8 bounds-wrapped loads per lane (LLVM does not
    fuse them because numba's negative-index wraparound sits in between); this is one ``mov``.
    """
    int_type = ir.IntType(width)

    @intrinsic
    def load(typingctx, arr, index):
        if not (isinstance(arr, types.Array) and arr.dtype == types.uint8 and arr.layout == "C"):
            return None

        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, args[0])
            byte_ptr = builder.gep(array.data, [args[1]])
            value = builder.load(builder.bitcast(byte_ptr, int_type.as_pointer()), align=1, typ=int_type)
            if _BIG_ENDIAN:
                value = builder.bswap(value)
            if width < 64:
                value = builder.zext(value, ir.IntType(64))
            return value

        return types.uint64(arr, types.int64), codegen

    return load


_BIG_ENDIAN = sys.byteorder == "big"
_read64 = _unaligned_load(64)
_read32 = _unaligned_load(32)


@njit(**_OPTS)
def xxh64_span(data, start, length, seed):
    """XXH64 of ``data[start:start + length]`` (``data`` a uint8 array, start/length int64)."""
    p = start
    end = start + length
    if length >= 32:
        limit = end - 32
        v1 = seed + P1 + P2
        v2 = seed + P2
        v3 = seed
        v4 = seed - P1
        while p <= limit:
            v1 = _round(v1, _read64(data, p))
            v2 = _round(v2, _read64(data, p + 8))
            v3 = _round(v3, _read64(data, p + 16))
            v4 = _round(v4, _read64(data, p + 24))
            p += 32
        h = (
            _rotl(v1, np.uint64(1))
            + _rotl(v2, np.uint64(7))
            + _rotl(v3, np.uint64(12))
            + _rotl(v4, np.uint64(18))
        )
        h = _merge_round(h, v1)
        h = _merge_round(h, v2)
        h = _merge_round(h, v3)
        h = _merge_round(h, v4)
    else:
        h = seed + P5
    h = h + np.uint64(length)
    while p + 8 <= end:
        h = _tail8(h, _read64(data, p))
        p += 8
    if p + 4 <= end:
        h = h ^ (_read32(data, p) * P1)
        h = _rotl(h, np.uint64(23)) * P2 + P3
        p += 4
    while p < end:
        h = h ^ (np.uint64(data[p]) * P5)
        h = _rotl(h, np.uint64(11)) * P1
        p += 1
    return _avalanche(h)


@njit(**_OPTS)
def xxh64_lane(lane, seed):
    """XXH64 of one 8-byte little-endian input given as its uint64 value."""
    return _avalanche(_tail8(seed + P5 + _EIGHT, lane))


@njit(**_OPTS)
def hash_xxh64(data, seed):
    """XXH64 of a whole uint8 array (used to test the byte kernel against the reference)."""
    return xxh64_span(data, np.int64(0), np.int64(data.shape[0]), np.uint64(seed))


@njit(**_OPTS)
def hash_ints(values, out):
    """Integers of any numpy width (bool as uint8) -> hash of the value as int64, seed 0.

    uint64 values above int64 max wrap here; the caller re-hashes those rows by the big-int rule.
    """
    for i in range(values.shape[0]):
        out[i] = xxh64_lane(np.uint64(np.int64(values[i])), SEED_INT)


@njit(**_OPTS)
def hash_floats(values, bits, out):
    """float64 values (and the same memory viewed as uint64) -> hash of the canonical double, seed 1."""
    for i in range(values.shape[0]):
        v = values[i]
        if np.isnan(v):
            b = CANONICAL_NAN
        elif v == 0.0:
            b = _ZERO
        else:
            b = bits[i]
        out[i] = xxh64_lane(b, SEED_FLOAT)


@njit(**_OPTS)
def hash_binary(offsets, data, seed, out):
    """Variable-length values from Arrow offsets (int32 or int64, already sliced) and data bytes."""
    for i in range(out.shape[0]):
        start = np.int64(offsets[i])
        out[i] = xxh64_span(data, start, np.int64(offsets[i + 1]) - start, seed)


@njit(**_OPTS)
def hash_fixed_binary(data, start, width, seed, out):
    """Fixed-width binary values laid out back to back from byte ``start``."""
    for i in range(out.shape[0]):
        out[i] = xxh64_span(data, start + i * width, width, seed)


@njit(**_OPTS)
def hash_tuples(components, out):
    """Rows of a struct: XXH64, seed 4, of the row's component hashes as 8-byte LE words.

    ``components`` is (k, n): one row of hashes per field. This is ``xxh64_span`` specialised to
    inputs made of whole 8-byte lanes, reading the lanes from the matrix instead of from bytes.
    """
    k = components.shape[0]
    seed = SEED_TUPLE
    length = np.uint64(8 * k)
    for i in range(out.shape[0]):
        j = 0
        if k >= 4:
            v1 = seed + P1 + P2
            v2 = seed + P2
            v3 = seed
            v4 = seed - P1
            while j + 4 <= k:
                v1 = _round(v1, components[j, i])
                v2 = _round(v2, components[j + 1, i])
                v3 = _round(v3, components[j + 2, i])
                v4 = _round(v4, components[j + 3, i])
                j += 4
            h = (
                _rotl(v1, np.uint64(1))
                + _rotl(v2, np.uint64(7))
                + _rotl(v3, np.uint64(12))
                + _rotl(v4, np.uint64(18))
            )
            h = _merge_round(h, v1)
            h = _merge_round(h, v2)
            h = _merge_round(h, v3)
            h = _merge_round(h, v4)
        else:
            h = seed + P5
        h = h + length
        while j < k:
            h = _tail8(h, components[j, i])
            j += 1
        out[i] = _avalanche(h)


@njit(**_OPTS)
def fill_nulls(out, validity, bit_offset, value):
    """Set ``out[i] = value`` wherever bit ``bit_offset + i`` of an Arrow validity bitmap is 0."""
    for i in range(out.shape[0]):
        bit = bit_offset + i
        if not (validity[bit >> 3] >> (bit & 7)) & 1:
            out[i] = value


@njit(**_OPTS)
def to_key_groups(hashes, max_parallelism, out):
    """``hashes % max_parallelism`` as uint16; a mask when max_parallelism is a power of two."""
    m = np.uint64(max_parallelism)
    if max_parallelism & (max_parallelism - 1) == 0:
        mask = m - np.uint64(1)
        for i in range(hashes.shape[0]):
            out[i] = np.uint16(hashes[i] & mask)
    else:
        for i in range(hashes.shape[0]):
            out[i] = np.uint16(hashes[i] % m)


@njit(**_OPTS)
def key_group_places(kgs, max_parallelism, block, places, sorted_kgs):
    """A stable counting sort of rows by key group within each block of ``block`` rows: row i goes
    to ``places[i]`` (in its block; a key group's rows, and so each key's, keep their order),
    ``sorted_kgs`` gets the key groups in that order. Returns False (nothing written) when every
    block is in key-group order already."""
    n = kgs.shape[0]
    ordered = True
    for i in range(1, n):
        if kgs[i] < kgs[i - 1] and i % block != 0:
            ordered = False
            break
    if ordered:
        return False
    start = np.zeros(max_parallelism + 1, np.int64)
    for first in range(0, n, block):
        last = min(first + block, n)
        start[:] = 0
        start[0] = first
        for i in range(first, last):
            start[np.int64(kgs[i]) + 1] += 1
        for g in range(max_parallelism):
            start[g + 1] += start[g]
            for j in range(start[g], start[g + 1]):
                sorted_kgs[j] = g
        for i in range(first, last):
            g = np.int64(kgs[i])
            places[i] = start[g]
            start[g] += 1
    return True


@njit(**_OPTS)
def scatter_words(src, places, dst):
    """``dst[places[i]] = src[i]``: a column of 8-byte values moved to its rows' places."""
    for i in range(src.shape[0]):
        dst[places[i]] = src[i]


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels for the common column types.

    Called by workers before they take ownership of key groups, so that the first batch after a
    rescale never waits for numba.
    """
    out = np.empty(1, dtype=np.uint64)
    for dtype in (np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8):
        hash_ints(np.zeros(1, dtype=dtype), out)
    f = np.zeros(1, dtype=np.float64)
    hash_floats(f, f.view(np.uint64), out)
    data = np.zeros(1, dtype=np.uint8)
    for odtype in (np.int32, np.int64):
        hash_binary(np.zeros(2, dtype=odtype), data, SEED_STR, out)
    hash_fixed_binary(data, np.int64(0), np.int64(1), SEED_BYTES, out)
    hash_tuples(np.zeros((2, 1), dtype=np.uint64), out)
    fill_nulls(out, np.ones(1, dtype=np.uint8), np.int64(0), np.uint64(0))
    to_key_groups(out, np.int64(128), np.empty(1, dtype=np.uint16))
    places = np.zeros(2, dtype=np.int32)  # left as is: the rows are in order already
    key_group_places(
        np.zeros(2, dtype=np.uint16), np.int64(128), np.int64(2), places, np.empty(2, dtype=np.uint16)
    )
    scatter_words(np.zeros(2, dtype=np.int64), places, np.empty(2, dtype=np.int64))
    hash_xxh64(data, np.uint64(0))
