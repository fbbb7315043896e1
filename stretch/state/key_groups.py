"""Key groups: the stable hashing that decides which operator instance owns a key.

Every process of a job (the instances of an operator, the coordinator, Spark executors writing
into a channel) must agree on a key's key group without talking to each other, in every run, so
the hash is fixed here once and never uses Python's ``hash()`` (salted per process for str/bytes).

``stable_hash(key)`` is XXH64 of a canonical byte form of the key, with a per-type seed so that
e.g. the str ``"a"`` and the bytes ``b"a"`` do not collide by construction:

=====================  ==============================================================  =====
key                    bytes hashed                                                    seed
=====================  ==============================================================  =====
int, bool (int64)      8-byte little-endian two's complement                           0
float                  8-byte little-endian double; ``-0.0`` -> ``0.0``, NaN canonical  1
str                    UTF-8                                                           2
bytes-like             the bytes                                                       3
tuple / Row            the components' stable hashes, each 8-byte little-endian        4
None                   ``b""``                                                         5
int outside int64      ASCII decimal                                                   6
=====================  ==============================================================  =====

Equal keys hash equally (``True`` and ``1``, ``-0.0`` and ``0.0``, a tuple and a Row), except
``1`` against ``1.0``, which are different keys here, as in Flink.

``key_group = stable_hash(key) % max_parallelism``; key group ``kg`` belongs to instance
``kg * parallelism // max_parallelism`` (Flink's contiguous ranges), so rescaling only rewrites
the key group -> instance table (:func:`assignment`) and moves no state.

There are two implementations of the same function: the scalar one (``xxhash`` package) for
single keys, and numba kernels for whole Arrow / numpy columns, which is what runs on every batch.
They are tested against each other and against ``xxhash`` on hand-built bytes.
"""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import xxhash

from stretch.state import _hash_kernels as _k
from stretch.state.key_codec import (
    big_int_text,
    canonical_float_bytes,
    int64_bytes,
    row_values,
    unsupported_key,
)

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "MAX_MAX_PARALLELISM",
    "LayoutScratch",
    "assignment",
    "hashes_of",
    "in_key_group_order",
    "key_group",
    "key_groups_of",
    "key_groups_of_keys",
    "operator_index",
    "stable_hash",
]

DEFAULT_MAX_PARALLELISM = 128
"""Number of key groups when the job does not set one: Flink's default, and enough to scale an
operator to 128 instances on one machine, while keeping per-key-group overhead small."""

MAX_MAX_PARALLELISM = 32768
"""Upper bound on the number of key groups, as in Flink; lets key groups be uint16 and owner
indexes int16 in shared-memory tables."""

SEED_INT = 0
SEED_FLOAT = 1
SEED_STR = 2
SEED_BYTES = 3
SEED_TUPLE = 4
SEED_NONE = 5
SEED_BIG_INT = 6

_xxh64 = xxhash.xxh64_intdigest
NONE_HASH = _xxh64(b"", SEED_NONE)
_INT64_MAX = 2**63 - 1
_INT_TYPES = frozenset((int, bool))
_FLOAT_TYPE = frozenset((float,))
_STR_TYPE = frozenset((str,))
_BYTES_TYPE = frozenset((bytes,))


# --------------------------------------------------------------------------------------------
# Scalar path
# --------------------------------------------------------------------------------------------


def stable_hash(key: object) -> int:
    """The uint64 stable hash of one key, identical in every process and run (see module doc).

    Raises TypeError for keys other than int, float, str, bytes, bool, None and tuples/Rows of
    these, because no other type has a value-based byte form every process agrees on.
    """
    t = type(key)
    if t is int or t is bool:
        return _hash_int(key)  # type: ignore[arg-type]
    if t is str:
        return _xxh64(key.encode("utf-8", "surrogatepass"), SEED_STR)  # type: ignore[union-attr]
    if t is tuple:
        return _hash_tuple(key)  # type: ignore[arg-type]
    if t is float:
        return _xxh64(canonical_float_bytes(key), SEED_FLOAT)  # type: ignore[arg-type]
    if key is None:
        return NONE_HASH
    if t is bytes:
        return _xxh64(key, SEED_BYTES)  # type: ignore[arg-type]
    return _stable_hash_other(key)


def _hash_int(n: int) -> int:
    raw = int64_bytes(n)
    if raw is not None:
        return _xxh64(raw, SEED_INT)
    return _xxh64(big_int_text(int(n)), SEED_BIG_INT)


def _hash_tuple(values: tuple) -> int:
    hashes = [stable_hash(v) for v in values]
    return _xxh64(struct.pack(f"<{len(hashes)}Q", *hashes), SEED_TUPLE)


def _stable_hash_other(key: object) -> int:
    # Subclasses (IntEnum, StrEnum, named tuples) and numpy scalars hash as the base type they
    # compare equal to.
    if isinstance(key, (bool, np.bool_, int, np.integer)):
        return _hash_int(int(key))  # type: ignore[arg-type]
    if isinstance(key, (float, np.floating)):
        return _xxh64(canonical_float_bytes(float(key)), SEED_FLOAT)  # type: ignore[arg-type]
    if isinstance(key, str):
        return _xxh64(key.encode("utf-8", "surrogatepass"), SEED_STR)
    if isinstance(key, (bytes, bytearray)):
        return _xxh64(key, SEED_BYTES)
    if isinstance(key, memoryview):
        return _xxh64(key.tobytes(), SEED_BYTES)
    if isinstance(key, tuple):
        return _hash_tuple(key)
    values = row_values(key)
    if values is None:
        raise unsupported_key(key)
    return _hash_tuple(values)


def _check_max_parallelism(max_parallelism: int) -> None:
    if not 1 <= max_parallelism <= MAX_MAX_PARALLELISM:
        raise ValueError(f"max_parallelism must be in 1..{MAX_MAX_PARALLELISM}, got {max_parallelism}")


def _check_parallelism(parallelism: int, max_parallelism: int) -> None:
    _check_max_parallelism(max_parallelism)
    if not 1 <= parallelism <= max_parallelism:
        raise ValueError(
            f"parallelism must be in 1..max_parallelism ({max_parallelism}), got {parallelism}; "
            "an instance without a key group would have nothing to do"
        )


def key_group(key: object, max_parallelism: int = DEFAULT_MAX_PARALLELISM) -> int:
    """The key group of ``key``: the unit of state ownership that moves between instances."""
    _check_max_parallelism(max_parallelism)
    return stable_hash(key) % max_parallelism


def operator_index(key_group: int, parallelism: int, max_parallelism: int) -> int:
    """The instance (0-based) owning ``key_group`` when the operator runs ``parallelism`` instances.

    Contiguous ranges (Flink's rule): each instance owns a run of adjacent key groups, so a
    rescale changes the owner of whole ranges and each instance's state stays in few segments.
    """
    _check_parallelism(parallelism, max_parallelism)
    if not 0 <= key_group < max_parallelism:
        raise ValueError(f"key_group must be in 0..{max_parallelism - 1}, got {key_group}")
    return key_group * parallelism // max_parallelism


def assignment(parallelism: int, max_parallelism: int) -> np.ndarray:
    """The ownership table of one epoch: int16 owner instance for each of the key groups.

    This array is all that changes on a rescale; it equals ``operator_index`` for every key group.
    """
    _check_parallelism(parallelism, max_parallelism)
    kg = np.arange(max_parallelism, dtype=np.int64)
    return (kg * parallelism // max_parallelism).astype(np.int16)


# --------------------------------------------------------------------------------------------
# Vectorized path
# --------------------------------------------------------------------------------------------


def hashes_of(column: pa.Array | pa.ChunkedArray | np.ndarray) -> np.ndarray:
    """uint64 stable hash of every row of a key column, equal to ``stable_hash`` of each value.

    Runs numba kernels over the Arrow buffers without copying them (except where Arrow's layout
    differs from the kernel's: booleans, float16/float32, view types). Struct rows hash as tuples
    of their fields, nulls as None. Raises TypeError for column types whose values are not keys
    (temporal, decimal, list, map, ...), as ``stable_hash`` would for the values.
    """
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 0:
            return np.empty(0, dtype=np.uint64)
        if column.num_chunks == 1:
            return _hash_array(column.chunk(0))
        return np.concatenate([_hash_array(chunk) for chunk in column.chunks])
    if isinstance(column, pa.Array):
        return _hash_array(column)
    if isinstance(column, np.ndarray):
        return _hash_numpy(column)
    raise TypeError(
        f"expected a pyarrow Array or ChunkedArray or a numpy array, got {type(column).__qualname__}"
    )


def key_groups_of(column: pa.Array | pa.ChunkedArray | np.ndarray, max_parallelism: int) -> np.ndarray:
    """uint16 key group of every row of a key column: how a batch is split among instances."""
    _check_max_parallelism(max_parallelism)
    return _to_key_groups(hashes_of(column), max_parallelism)


def key_groups_of_keys(keys: list, max_parallelism: int) -> np.ndarray:
    """uint16 key group of each Python key object, equal to ``[key_group(k) for k in keys]``.

    Lists of one plain type (all int/bool, all float, all str, all bytes) go through the numba
    kernels; homogeneity is checked on exact types (``set(map(type, keys))``) rather than trusting
    numpy's or Arrow's inference, which would turn ``[1, 2.5]`` into doubles. Anything else (mixed
    types, tuples, None, subclasses, ints beyond int64) is hashed key by key.
    """
    _check_max_parallelism(max_parallelism)
    return _to_key_groups(_hashes_of_keys(keys), max_parallelism)


class LayoutScratch:
    """Memory that ``in_key_group_order`` lays batches out into, kept between batches: fresh
    buffers for every batch would cost a page fault per 4 KiB of output (its random writes touch
    every page), several times the sort itself. A batch laid out into it is valid until the next
    layout into the same scratch."""

    def __init__(self):
        self.rows = 0
        self.places = np.empty(0, dtype=np.int32)
        self.kgs = np.empty(0, dtype=np.uint16)
        self.words: list[np.ndarray] = []

    def fit(self, n: int, columns: int) -> None:
        if n > self.rows:
            self.rows = max(n, 2 * self.rows)
            self.places = np.empty(self.rows, dtype=np.int32)
            self.kgs = np.empty(self.rows, dtype=np.uint16)
            self.words = []
        while len(self.words) < columns:
            self.words.append(np.empty(self.rows, dtype=np.int64))


def in_key_group_order(
    batch: pa.RecordBatch, kgs: np.ndarray, max_parallelism: int, scratch: LayoutScratch, block: int = 0
):
    """(batch, kgs) with the rows in key-group order within each block of ``block`` rows (the
    whole batch if 0): a stable counting sort, so a key group's rows, and each key's, keep their
    order; None when they are in that order already.

    Columns of 8-byte values without nulls are moved by one numba pass each into ``scratch``;
    others by Arrow.
    """
    n = kgs.shape[0]
    scratch.fit(n, batch.num_columns)
    places, sorted_kgs = scratch.places[:n], scratch.kgs[:n]
    if not _k.key_group_places(
        kgs, np.int64(max_parallelism), np.int64(block or max(n, 1)), places, sorted_kgs
    ):
        return None
    columns, order = [], None
    for i, column in enumerate(batch.columns):
        t = column.type
        if column.null_count == 0 and pa.types.is_primitive(t) and t.bit_width == 64:
            src = np.frombuffer(column.buffers()[1], np.int64, n, column.offset * 8)
            dst = scratch.words[i][:n]
            _k.scatter_words(src, places, dst)
            columns.append(pa.Array.from_buffers(t, n, [None, pa.py_buffer(dst)]))
        else:
            if order is None:
                order = np.empty(n, dtype=np.int64)
                order[places] = np.arange(n)
            columns.append(column.take(order))
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema), sorted_kgs


def _to_key_groups(hashes: np.ndarray, max_parallelism: int) -> np.ndarray:
    out = np.empty(hashes.shape[0], dtype=np.uint16)
    _k.to_key_groups(hashes, np.int64(max_parallelism), out)
    return out


def _hashes_of_keys(keys: list | tuple | np.ndarray) -> np.ndarray:
    n = len(keys)
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    kinds = set(map(type, keys))
    try:
        if kinds <= _INT_TYPES:
            return _hash_numpy(np.array(keys, dtype=np.int64))
        if kinds == _FLOAT_TYPE:
            return _hash_numpy(np.array(keys, dtype=np.float64))
        if kinds == _STR_TYPE:
            return _hash_array(pa.array(keys, type=pa.large_string()))
        if kinds == _BYTES_TYPE:
            return _hash_array(pa.array(keys, type=pa.large_binary()))
    except (OverflowError, UnicodeError, pa.ArrowException):
        # ints beyond int64, strs with lone surrogates: the scalar path handles them.
        pass
    out = np.empty(n, dtype=np.uint64)
    for i, key in enumerate(keys):
        out[i] = stable_hash(key)
    return out


# numpy dtype of the values buffer of each Arrow integer type
_ARROW_INT_DTYPES = {
    pa.int8(): np.int8,
    pa.int16(): np.int16,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.uint8(): np.uint8,
    pa.uint16(): np.uint16,
    pa.uint32(): np.uint32,
    pa.uint64(): np.uint64,
}


def _buffer(buf: pa.Buffer | None, dtype: type, offset: int, count: int) -> np.ndarray:
    """``count`` items of ``dtype`` from ``offset`` in an Arrow buffer, zero-copy."""
    if buf is None or count == 0:
        return np.zeros(count, dtype=dtype)
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset * np.dtype(dtype).itemsize)


def _bytes_of(buf: pa.Buffer | None) -> np.ndarray:
    if buf is None:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def _hash_array(arr: pa.Array) -> np.ndarray:
    typ = arr.type
    n = len(arr)
    out = np.empty(n, dtype=np.uint64)
    if n == 0:
        return out
    if arr.null_count == n:
        out.fill(NONE_HASH)
        return out
    bufs = arr.buffers()
    off = arr.offset

    if pa.types.is_integer(typ):
        values = _buffer(bufs[1], _ARROW_INT_DTYPES[typ], off, n)
        _k.hash_ints(values, out)
        if typ == pa.uint64():
            _rehash_big_uint64(values, out)
    elif pa.types.is_boolean(typ):
        return _hash_array(arr.cast(pa.uint8()))
    elif pa.types.is_float64(typ):
        values = _buffer(bufs[1], np.float64, off, n)
        _k.hash_floats(values, values.view(np.uint64), out)
    elif pa.types.is_float32(typ) or pa.types.is_float16(typ):
        dtype = np.float32 if pa.types.is_float32(typ) else np.float16
        values = _buffer(bufs[1], dtype, off, n).astype(np.float64)
        _k.hash_floats(values, values.view(np.uint64), out)
    elif pa.types.is_string(typ) or pa.types.is_binary(typ):
        seed = _k.SEED_STR if pa.types.is_string(typ) else _k.SEED_BYTES
        _hash_binary(_buffer(bufs[1], np.int32, off, n + 1), _bytes_of(bufs[2]), seed, out)
    elif pa.types.is_large_string(typ) or pa.types.is_large_binary(typ):
        seed = _k.SEED_STR if pa.types.is_large_string(typ) else _k.SEED_BYTES
        _hash_binary(_buffer(bufs[1], np.int64, off, n + 1), _bytes_of(bufs[2]), seed, out)
    elif pa.types.is_string_view(typ):
        return _hash_array(arr.cast(pa.large_string()))
    elif pa.types.is_binary_view(typ):
        return _hash_array(arr.cast(pa.large_binary()))
    elif pa.types.is_fixed_size_binary(typ):
        width = typ.byte_width
        _k.hash_fixed_binary(_bytes_of(bufs[1]), np.int64(off * width), np.int64(width), _k.SEED_BYTES, out)
    elif pa.types.is_struct(typ):
        components = np.empty((typ.num_fields, n), dtype=np.uint64)
        for j in range(typ.num_fields):
            components[j] = _hash_array(arr.field(j))
        _k.hash_tuples(components, out)
    elif pa.types.is_dictionary(typ):
        return _hash_dictionary(arr)
    else:
        raise TypeError(
            f"key column of type {typ} cannot be hashed stably; key columns must be integer, bool, "
            "floating point, string, binary, struct of these, or dictionary-encoded of these"
        )
    if arr.null_count:
        _k.fill_nulls(out, _bytes_of(bufs[0]), np.int64(off), np.uint64(NONE_HASH))
    return out


def _hash_binary(offsets: np.ndarray, data: np.ndarray, seed: np.uint64, out: np.ndarray) -> None:
    # The kernel reads without bounds checks; Arrow offsets are monotonic, so checking the two
    # ends keeps a corrupt batch from reading outside its data buffer.
    if offsets[0] < 0 or offsets[-1] > data.shape[0]:
        raise ValueError(
            f"corrupt Arrow binary column: offsets span {offsets[0]}..{offsets[-1]}, "
            f"data buffer has {data.shape[0]} bytes"
        )
    _k.hash_binary(offsets, data, seed, out)


def _rehash_big_uint64(values: np.ndarray, out: np.ndarray) -> None:
    """uint64 values above int64 max are big ints for the scalar rule: hash those rows in Python."""
    for i in np.flatnonzero(values > np.uint64(_INT64_MAX)):
        out[i] = _hash_int(int(values[i]))


def _hash_dictionary(arr: pa.DictionaryArray) -> np.ndarray:
    # Hash each distinct value once, then gather: equal to hashing the decoded column.
    value_hashes = _hash_array(arr.dictionary)
    n = len(arr)
    if len(value_hashes) == 0:
        return np.full(n, NONE_HASH, dtype=np.uint64)
    indices = arr.indices
    idx = _buffer(indices.buffers()[1], _ARROW_INT_DTYPES[indices.type], indices.offset, n)
    out = np.take(value_hashes, idx, mode="clip")  # indices under nulls are unspecified
    if indices.null_count:
        _k.fill_nulls(out, _bytes_of(indices.buffers()[0]), np.int64(indices.offset), np.uint64(NONE_HASH))
    return out


def _hash_numpy(values: np.ndarray) -> np.ndarray:
    if values.ndim != 1:
        raise ValueError(f"key column must be 1-dimensional, got shape {values.shape}")
    kind = values.dtype.kind
    if kind in "biuf":
        if not values.dtype.isnative:
            values = values.astype(values.dtype.newbyteorder("="))
        values = np.ascontiguousarray(values)
    out = np.empty(values.shape[0], dtype=np.uint64)
    if kind in "iu":
        _k.hash_ints(values, out)
        if values.dtype == np.uint64:
            _rehash_big_uint64(values, out)
    elif kind == "b":
        _k.hash_ints(values.view(np.uint8), out)
    elif kind == "f":
        if values.dtype != np.float64:
            values = values.astype(np.float64)
        _k.hash_floats(values, values.view(np.uint64), out)
    elif kind in "US":
        return _hash_array(pa.array(values))
    elif kind == "O":
        return _hashes_of_keys(values)
    else:
        raise TypeError(
            f"key column of dtype {values.dtype} cannot be hashed stably; key columns must be "
            "integer, bool, floating point, str, bytes or object arrays of keys"
        )
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) the hash kernels now, so that the first batch a worker
    routes (or the first after a rescale) never waits for numba."""
    _k.warm_up()
