"""Key routing: the key and key group of every record, computed once, by the producer.

A gate batch gets ``__kg`` (and ``__key`` where the operator needs the key as a column of its own)
here, whoever produces it: a stage's ``to_gate`` step or an outside writer of a channel that the
job keys by a field right away. With ``runs``, the batch is laid out in runs of key groups
(:mod:`stretch.runtime.key_group_runs`), in memory the thread reuses for its next layout: the
producer appends it to the gate before it keys another.
"""

from __future__ import annotations

import pyarrow as pa

from stretch.common.typeinfo import Types
from stretch.runtime.batch import CANONICAL_META, KEY_COLUMN, TS_COLUMN, resolve_field
from stretch.runtime.key_group_runs import KG_FIELD, in_runs
from stretch.runtime.outputs import short
from stretch.state.key_codec import encode_key
from stretch.state.key_groups import key_groups_of, key_groups_of_keys, stable_hash


def key_column(keys: list, key_type) -> tuple[pa.Field, pa.Array]:
    """The ``__key`` column for keys a selector returned: int64, string, bytes, or canonical bytes."""
    if key_type is not None and key_type != Types.PICKLED_BYTE_ARRAY():
        arrow = key_type.to_arrow()
        try:
            if pa.types.is_integer(arrow) or pa.types.is_boolean(arrow):
                if not all(isinstance(k, int) for k in keys):
                    raise TypeError("not an int")
                return pa.field(KEY_COLUMN, pa.int64()), pa.array(keys, pa.int64())
            if pa.types.is_string(arrow) or pa.types.is_large_string(arrow):
                return pa.field(KEY_COLUMN, pa.large_string()), pa.array(keys, pa.large_string())
        except (TypeError, pa.ArrowException, OverflowError):
            bad = next((k for k in keys if not _matches(k, arrow)), None)
            raise TypeError(f"key {short(bad)} does not match the declared key_type {key_type!r}") from None
    elif key_type is None:
        kinds = {type(k) for k in keys}
        if kinds <= {int, bool}:
            try:
                return pa.field(KEY_COLUMN, pa.int64()), pa.array(keys, pa.int64())
            except (OverflowError, pa.ArrowException):
                pass
        elif kinds == {str}:
            return pa.field(KEY_COLUMN, pa.large_string()), pa.array(keys, pa.large_string())
        elif kinds == {bytes}:
            return pa.field(KEY_COLUMN, pa.large_binary()), pa.array(keys, pa.large_binary())
    field = pa.field(KEY_COLUMN, pa.large_binary(), metadata=CANONICAL_META)
    return field, pa.array([encode_key(k) for k in keys], pa.large_binary())


def _matches(k, arrow) -> bool:
    if pa.types.is_integer(arrow) or pa.types.is_boolean(arrow):
        return isinstance(k, int)
    return isinstance(k, str)


def _stored_canonically(t: pa.DataType) -> bool:
    """Key fields of other types than these are hashed and stored by their canonical encoding."""
    return not (
        pa.types.is_integer(t)
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )


def keyed_by_field(
    batch: pa.RecordBatch, field, max_parallelism: int, timestamps=None, runs: bool = False, block: int = 0
) -> pa.RecordBatch:
    """A gate batch of records keyed by one of their fields: ``__key`` where the field's values are
    stored canonically, ``__ts`` if the records have event timestamps, and ``__kg``; with ``runs``,
    in runs of key groups in blocks of ``block`` rows (key_group_runs.in_runs)."""
    column = batch.column(resolve_field(batch.schema, field))
    kgs = key_groups_of(column, max_parallelism)
    if _stored_canonically(column.type):
        keys = pa.array([encode_key(k) for k in column.to_pylist()], pa.large_binary())
        batch = batch.append_column(pa.field(KEY_COLUMN, pa.large_binary(), metadata=CANONICAL_META), keys)
    return _stamped(batch, kgs, timestamps, max_parallelism if runs else 0, block)


def keyed_by_selector(
    batch: pa.RecordBatch,
    items: list,
    keys: list,
    key_type,
    max_parallelism: int,
    operator: str,
    timestamps=None,
    runs: bool = False,
    block: int = 0,
) -> pa.RecordBatch:
    """A gate batch of records whose keys a selector computed (``keys[i]`` of ``items[i]``)."""
    kgs = _selector_key_groups(items, keys, max_parallelism, operator)
    batch = batch.append_column(*key_column(keys, key_type))
    return _stamped(batch, kgs, timestamps, max_parallelism if runs else 0, block)


def _stamped(batch: pa.RecordBatch, kgs, timestamps, runs_of: int, block: int) -> pa.RecordBatch:
    """``__ts`` and ``__kg`` appended; in runs of key groups if ``runs_of`` (the max parallelism),
    block by block."""
    if timestamps is not None:
        batch = batch.append_column(TS_COLUMN, pa.array(timestamps, type=pa.int64()))
    field = KG_FIELD
    if runs_of:
        batch, kgs, field = in_runs(batch, kgs, runs_of, block)
    return batch.append_column(field, pa.array(kgs, type=pa.uint16()))


def _selector_key_groups(items: list, keys: list, max_parallelism: int, operator: str):
    try:
        return key_groups_of_keys(keys, max_parallelism)
    except TypeError:
        for r, k in zip(items, keys):
            try:
                stable_hash(k)
            except TypeError:
                raise TypeError(
                    f"key_by of operator {operator!r}: record {short(r)} has key {short(k)} "
                    f"of type {type(k).__name__}, which cannot be hashed stably; keys must be int, "
                    "float, str, bytes, bool or tuples of these (which may hold None)"
                ) from None
        raise


def not_null(key):
    """A key as a selector returned it; as in Flink, a key must not be None."""
    if key is None:
        raise ValueError("the key is None; keys must not be None (as in Flink)")
    return key
