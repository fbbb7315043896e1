"""Type information, mirroring ``pyflink.common.typeinfo``, mapped onto Arrow types.

Every hop of the engine carries records as Arrow record batches, so every ``TypeInformation``
knows its Arrow type (:meth:`TypeInformation.to_arrow`), a small JSON form used to describe state
types in shared memory (:meth:`TypeInformation.to_json` / :func:`from_json`), and, for the fixed
width types that state tables store as plain columns, a NumPy dtype.

Names, constructor arguments and ``repr`` follow PyFlink (``repr(Types.LONG()) == 'Long'``,
``repr(Types.ROW([...])) == 'RowTypeInfo(Long, String)'``). Deliberate differences:

* every type is hashable (PyFlink defines ``__eq__`` without ``__hash__``), so types can key caches;
* ``RowTypeInfo`` equality also compares the field names (as Java's ``RowTypeInfo.equals`` does;
  PyFlink's Python class compares only the field types), because the names decide the Arrow schema;
* invalid array element types raise ``TypeError`` when the type is built, not when it is first used.

Arrow mapping of composite types: ROW and TUPLE are structs with fields ``f0..fn`` (ROW_NAMED uses
its names); arrays and LIST are ``large_list``; MAP is ``map_``; PICKLED_BYTE_ARRAY is
``large_binary`` whose *field* carries the metadata ``{b"stretch.pickled": b"1"}``. Struct fields
carry ``{b"stretch.kind": b"tuple" | b"row"}`` (plus ``b"stretch.named": b"default"`` for an
unnamed ROW, whose Rows get Flink's default names ``f0..fn``)
so that ``arrow_types.from_arrow_field`` recovers the exact type.
"""

from __future__ import annotations

from stretch.common.type_classes import (
    BasicArrayTypeInfo,
    BasicType,
    BasicTypeInfo,
    DateTypeInfo,
    InstantTypeInfo,
    ListTypeInfo,
    MapTypeInfo,
    ObjectArrayTypeInfo,
    PickledBytesTypeInfo,
    PrimitiveArrayTypeInfo,
    RowTypeInfo,
    SqlTimeTypeInfo,
    TimestampTypeInfo,
    TimeTypeInfo,
    TupleTypeInfo,
    TypeInformation,
    from_json,
    type_expr,
)

__all__ = [
    "BasicArrayTypeInfo",
    "BasicType",
    "BasicTypeInfo",
    "DateTypeInfo",
    "InstantTypeInfo",
    "ListTypeInfo",
    "MapTypeInfo",
    "ObjectArrayTypeInfo",
    "PickledBytesTypeInfo",
    "PrimitiveArrayTypeInfo",
    "RowTypeInfo",
    "SqlTimeTypeInfo",
    "TimeTypeInfo",
    "TimestampTypeInfo",
    "TupleTypeInfo",
    "TypeInformation",
    "Types",
    "from_json",
    "type_expr",
]


# --------------------------------------------------------------------------------------------------
# the factory
# --------------------------------------------------------------------------------------------------
class Types:
    """Access to the type information of the most common types (PyFlink: ``Types``)."""

    @staticmethod
    def STRING() -> TypeInformation:
        """Python ``str``; Arrow ``large_string``. Supports None."""
        return BasicTypeInfo.STRING_TYPE_INFO()

    @staticmethod
    def BYTE() -> TypeInformation:
        """Python ``int`` in [-128, 127]; Arrow ``int8``."""
        return BasicTypeInfo.BYTE_TYPE_INFO()

    @staticmethod
    def BYTES() -> TypeInformation:
        """Python ``bytes``; Arrow ``large_binary``. Not in PyFlink, whose name for it is
        ``PRIMITIVE_ARRAY(BYTE())``: this is that type (equal to it, with its repr)."""
        return PrimitiveArrayTypeInfo(BasicTypeInfo.BYTE_TYPE_INFO())

    @staticmethod
    def BOOLEAN() -> TypeInformation:
        """Python ``bool``; Arrow ``bool``."""
        return BasicTypeInfo.BOOLEAN_TYPE_INFO()

    @staticmethod
    def SHORT() -> TypeInformation:
        """Python ``int`` in the int16 range; Arrow ``int16``."""
        return BasicTypeInfo.SHORT_TYPE_INFO()

    @staticmethod
    def INT() -> TypeInformation:
        """Python ``int`` in the int32 range; Arrow ``int32``."""
        return BasicTypeInfo.INT_TYPE_INFO()

    @staticmethod
    def LONG() -> TypeInformation:
        """Python ``int`` in the int64 range; Arrow ``int64``."""
        return BasicTypeInfo.LONG_TYPE_INFO()

    @staticmethod
    def FLOAT() -> TypeInformation:
        """Python ``float`` (ints accepted); Arrow ``float32``."""
        return BasicTypeInfo.FLOAT_TYPE_INFO()

    @staticmethod
    def DOUBLE() -> TypeInformation:
        """Python ``float`` (ints accepted); Arrow ``float64``."""
        return BasicTypeInfo.DOUBLE_TYPE_INFO()

    @staticmethod
    def CHAR() -> TypeInformation:
        """A one-character Python ``str``; Arrow ``string``."""
        return BasicTypeInfo.CHAR_TYPE_INFO()

    @staticmethod
    def BIG_INT() -> TypeInformation:
        """Python ``int`` with up to 38 digits; Arrow ``decimal128(38, 0)``."""
        return BasicTypeInfo.BIG_INT_TYPE_INFO()

    @staticmethod
    def BIG_DEC() -> TypeInformation:
        """``decimal.Decimal`` with up to 20 integer and 18 fractional digits;
        Arrow ``decimal128(38, 18)``."""
        return BasicTypeInfo.BIG_DEC_TYPE_INFO()

    @staticmethod
    def INSTANT() -> TypeInformation:
        """:class:`stretch.common.time.Instant` (aware datetimes accepted);
        Arrow ``timestamp[us, tz=UTC]``."""
        return BasicTypeInfo.INSTANT_TYPE_INFO()

    @staticmethod
    def SQL_DATE() -> TypeInformation:
        """``datetime.date``; Arrow ``date32``."""
        return SqlTimeTypeInfo.DATE()

    @staticmethod
    def SQL_TIME() -> TypeInformation:
        """``datetime.time``; Arrow ``time64[us]``."""
        return SqlTimeTypeInfo.TIME()

    @staticmethod
    def SQL_TIMESTAMP() -> TypeInformation:
        """Naive ``datetime.datetime``; Arrow ``timestamp[us]``."""
        return SqlTimeTypeInfo.TIMESTAMP()

    @staticmethod
    def PICKLED_BYTE_ARRAY() -> TypeInformation:
        """Any picklable Python object."""
        return PickledBytesTypeInfo()

    @staticmethod
    def ROW(field_types: list[TypeInformation]) -> RowTypeInfo:
        """Rows with positional fields of the given types. A row itself must not be None."""
        return RowTypeInfo(field_types)

    @staticmethod
    def ROW_NAMED(field_names: list[str], field_types: list[TypeInformation]) -> RowTypeInfo:
        """Rows with the given field names and types. A row itself must not be None."""
        return RowTypeInfo(field_types, field_names)

    @staticmethod
    def TUPLE(field_types: list[TypeInformation]) -> TupleTypeInfo:
        """Tuples with fields of the given types. A tuple itself must not be None."""
        return TupleTypeInfo(field_types)

    @staticmethod
    def PRIMITIVE_ARRAY(element_type: TypeInformation) -> TypeInformation:
        """Arrays of a primitive type; ``PRIMITIVE_ARRAY(BYTE())`` is Python ``bytes``."""
        return PrimitiveArrayTypeInfo(element_type)

    @staticmethod
    def BASIC_ARRAY(element_type: TypeInformation) -> TypeInformation:
        """Arrays of boxed primitive types or strings (Python lists)."""
        return BasicArrayTypeInfo(element_type)

    @staticmethod
    def OBJECT_ARRAY(element_type: TypeInformation) -> TypeInformation:
        """Arrays of any type (Python lists); None elements are supported."""
        return ObjectArrayTypeInfo(element_type)

    @staticmethod
    def MAP(key_type_info: TypeInformation, value_type_info: TypeInformation) -> TypeInformation:
        """Python dicts with keys and values of the given types."""
        return MapTypeInfo(key_type_info, value_type_info)

    @staticmethod
    def LIST(element_type_info: TypeInformation) -> TypeInformation:
        """Python lists of the given element type."""
        return ListTypeInfo(element_type_info)
