"""Arrow types -> TypeInformation: what ``from_batch`` decodes a column as, and what a schema
without declared types (a channel written by Spark, a Parquet file) is read as. A field's metadata
(``typeinfo``'s ``stretch.*`` keys) recovers the exact type; a bare ``pa.DataType`` cannot carry
metadata, so :func:`from_arrow` on a struct guesses: names ``f0..fn`` give TUPLE, others
ROW_NAMED."""

from __future__ import annotations

import pyarrow as pa

from stretch.common.type_classes import KIND_KEY, NAMED_KEY, PICKLED_KEY
from stretch.common.typeinfo import TypeInformation, Types

_ARROW_BASIC: dict[pa.DataType, TypeInformation] = {
    pa.int8(): Types.BYTE(),
    pa.int16(): Types.SHORT(),
    pa.int32(): Types.INT(),
    pa.int64(): Types.LONG(),
    pa.float32(): Types.FLOAT(),
    pa.float64(): Types.DOUBLE(),
    pa.bool_(): Types.BOOLEAN(),
    pa.string(): Types.STRING(),
    pa.large_string(): Types.STRING(),
    pa.string_view(): Types.STRING(),
    pa.binary(): Types.PRIMITIVE_ARRAY(Types.BYTE()),
    pa.large_binary(): Types.PRIMITIVE_ARRAY(Types.BYTE()),
    pa.binary_view(): Types.PRIMITIVE_ARRAY(Types.BYTE()),
    pa.date32(): Types.SQL_DATE(),
    pa.date64(): Types.SQL_DATE(),
    pa.uint8(): Types.SHORT(),
    pa.uint16(): Types.INT(),
    pa.uint32(): Types.LONG(),
    pa.uint64(): Types.BIG_INT(),
    pa.float16(): Types.FLOAT(),
}


def _is_tuple_names(names: list[str]) -> bool:
    return names == [f"f{i}" for i in range(len(names))]


def from_arrow(data_type: pa.DataType) -> TypeInformation:
    """The TypeInformation whose values an Arrow type holds.

    Inverse of :meth:`TypeInformation.to_arrow` for scalar types; ``string`` maps to STRING (so
    CHAR does not round-trip), decimals of scale 0 to BIG_INT and others to BIG_DEC, timestamps
    with a time zone to INSTANT and without to SQL_TIMESTAMP, lists to LIST and maps to MAP.
    Structs use their children's field metadata; a bare struct named ``f0..fn`` gives TUPLE,
    otherwise ROW_NAMED (use :func:`from_arrow_field` to honour a struct field's own metadata).
    """
    found = _ARROW_BASIC.get(data_type)
    if found is not None:
        return found
    if pa.types.is_timestamp(data_type):
        return Types.INSTANT() if data_type.tz is not None else Types.SQL_TIMESTAMP()
    if pa.types.is_time(data_type):
        return Types.SQL_TIME()
    if pa.types.is_decimal(data_type):
        return Types.BIG_INT() if data_type.scale == 0 else Types.BIG_DEC()
    if pa.types.is_struct(data_type):
        fields = [data_type.field(i) for i in range(data_type.num_fields)]
        names = [f.name for f in fields]
        types = [from_arrow_field(f) for f in fields]
        if _is_tuple_names(names):
            return Types.TUPLE(types)
        return Types.ROW_NAMED(names, types)
    if pa.types.is_map(data_type):
        return Types.MAP(from_arrow_field(data_type.key_field), from_arrow_field(data_type.item_field))
    if (
        pa.types.is_list(data_type)
        or pa.types.is_large_list(data_type)
        or pa.types.is_list_view(data_type)
        or pa.types.is_large_list_view(data_type)
        or pa.types.is_fixed_size_list(data_type)
    ):
        return Types.LIST(from_arrow_field(data_type.value_field))
    raise TypeError(f"Arrow type {data_type} has no stretch TypeInformation")


def from_arrow_field(field: pa.Field) -> TypeInformation:
    """Like :func:`from_arrow` but honours stretch's field metadata (pickled, tuple/row kind)."""
    meta = field.metadata or {}
    if meta.get(PICKLED_KEY) == b"1":
        return Types.PICKLED_BYTE_ARRAY()
    kind = meta.get(KIND_KEY)
    if kind is not None and pa.types.is_struct(field.type):
        data_type = field.type
        children = [data_type.field(i) for i in range(data_type.num_fields)]
        types = [from_arrow_field(f) for f in children]
        if kind == b"tuple":
            return Types.TUPLE(types)
        if meta.get(NAMED_KEY) in (b"default", b"0"):
            return Types.ROW(types)
        return Types.ROW_NAMED([f.name for f in children], types)
    return from_arrow(field.type)
