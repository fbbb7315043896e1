"""Queryable state: any key group's keyed state as a pyarrow Table, read while the job runs.

Reads go straight to the operator's shared-memory tables (from the job's process, or from any
process of the same user that attaches the arena) under the key group's seqlock, so a reader never
stops or slows the instances and never sees a half-written batch.
"""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa

from stretch.common.typeinfo import TypeInformation
from stretch.state import _table_kernels as _K
from stretch.state.codecs import ElementStream, value_codec
from stretch.state.keyed_table import KeyedTable


def _arrow_type(entry: dict) -> pa.DataType | None:
    t = _type_info(entry)
    return None if t is None else t.to_arrow()


def _type_info(entry: dict) -> TypeInformation | None:
    return TypeInformation.from_json(entry["type"]) if entry.get("type") else None


def _record_columns(table: KeyedTable, sid: int, entry: dict, kg: int, n: int) -> dict[str, pa.Array]:
    """A rolling aggregate's per-key record (k 8-byte words) as one column per field."""
    fields = entry["fields"]
    k = len(fields)
    words = table.headers[kg, _K.STATE_BASE + sid * _K.STATE_WORDS :][: _K.STATE_WORDS]
    cap = int(words[_K.S_DATA_CAP])
    a = table.arena
    m = min(n, cap)
    data = a.a64[int(words[_K.S_DATA_OFF]) // 8 :][: m * k].reshape(m, k) if m else np.zeros((0, k), np.int64)
    valid = a.a8[int(words[_K.S_VALID_OFF]) :][:m] if m else np.zeros(0, np.uint8)
    mask = np.concatenate([valid == 0, np.ones(n - m, dtype=bool)])
    out = {}
    for j, f in enumerate(fields):
        values = np.concatenate([data[:, j], np.zeros(n - m, np.int64)])
        label = f"{entry['name'].split()[-1]}({f['name']})" if f["acc"] else f"first({f['name']})"
        out[label] = pa.array(values.view(np.float64) if f["float"] else values, mask=mask)
    return out


def _column(table: KeyedTable, sid: int, entry: dict, kgs: np.ndarray, rows: np.ndarray) -> pa.Array:
    storage, kind = entry["storage"], entry["kind"]
    if storage != "var":
        dtype = np.dtype(storage)
        values, valid = table.gather(sid, dtype, kgs, rows)
        mask = valid == 0
        if entry.get("type") and _arrow_type(entry) == pa.bool_():
            return pa.array(values.astype(bool), mask=mask)
        return pa.array(values, mask=mask)
    raw = table.read_var(sid, kgs, rows)
    t = _type_info(entry)
    if kind == "list":
        stream = ElementStream(t.get_element_type() if t is not None else None)
        values = [None if r is None else stream.decode(r) for r in raw]
        elem = t.get_element_type().to_arrow() if t is not None else None
        return _array(values, pa.large_list(elem) if elem is not None else None)
    if kind == "map":
        values = [None if r is None else list(pickle.loads(r).items()) for r in raw]
        return _array(values, t.to_arrow() if t is not None else None)
    codec = value_codec(t)
    values = [None if r is None else codec.decode(r) for r in raw]
    return _array(values, t.to_arrow() if t is not None else None)


def _array(values: list, arrow_type: pa.DataType | None) -> pa.Array:
    """Values as their declared Arrow type; pickled where Arrow cannot hold them."""
    try:
        return pa.array(values, type=arrow_type)
    except (pa.ArrowException, TypeError, ValueError):
        return pa.array(
            [None if v is None else pickle.dumps(v, protocol=5) for v in values], pa.large_binary()
        )


def read_key_group(table: KeyedTable, kg: int) -> pa.Table:
    """Every key of key group ``kg`` with one column per declared state (null where unset)."""

    def read() -> pa.Table:
        keys = table.key_array(kg)
        if keys is None:
            keys = _array(table.keys_of(kg), None)
        n = len(keys)
        kgs = np.full(n, kg, dtype=np.uint16)
        rows = np.arange(n, dtype=np.int64)
        columns = {"key_group": pa.array(kgs, pa.int32()), "key": keys}
        for sid, entry in enumerate(table.arena.registry()):
            if entry["name"].startswith("__"):
                continue  # the engine's own state (timers)
            if entry["kind"] == "record":
                columns.update(_record_columns(table, sid, entry, kg, n))
            else:
                columns[entry["name"]] = _column(table, sid, entry, kgs, rows)
        return pa.table(columns)

    return table.stable_read(kg, read)


def read_state(table: KeyedTable, key_groups=None) -> pa.Table:
    """The state of several key groups (all by default) as one table."""
    groups = np.arange(table.maxp) if key_groups is None else np.asarray(key_groups, dtype=np.int64)
    parts = [read_key_group(table, int(kg)) for kg in table.here(groups) if table.n_keys(int(kg))]
    if not parts:  # the schema, without rows (key group 0 may hold keys not asked for)
        return read_key_group(table, 0).slice(0, 0)
    return concat_states(parts)


def concat_states(parts: list[pa.Table]) -> pa.Table:
    """Key groups' states (``read_key_group``'s tables) as one table."""
    try:
        return pa.concat_tables(parts, promote_options="permissive")
    except pa.ArrowTypeError:  # a column Arrow held in some key groups and had to pickle in others
        return pa.concat_tables(_pickled_where_types_differ(parts), promote_options="permissive")


def _pickled_where_types_differ(parts: list[pa.Table]) -> list[pa.Table]:
    """The parts with every column whose type differs between them pickled, as ``_array`` does
    for values Arrow cannot hold."""
    names = {n for part in parts for n in part.column_names}
    differing = [n for n in names if len({p.schema.field(n).type for p in parts if n in p.column_names}) > 1]
    out = []
    for part in parts:
        fixed = part
        for name in differing:
            if name in fixed.column_names and fixed.schema.field(name).type != pa.large_binary():
                values = fixed.column(name).to_pylist()
                pickled = pa.array(
                    [None if v is None else pickle.dumps(v, protocol=5) for v in values], pa.large_binary()
                )
                fixed = fixed.set_column(fixed.schema.get_field_index(name), name, pickled)
        out.append(fixed)
    return out
