"""The type classes behind ``Types`` (stretch.common.typeinfo, the public face): basic, time,
array, list, map, pickled, row and tuple types, each knowing its Arrow type, its NumPy dtype where
it is fixed width, its ``Types`` expression and its small JSON form (``from_json`` inverts it)."""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

import numpy as np
import pyarrow as pa

PICKLED_KEY = b"stretch.pickled"
KIND_KEY = b"stretch.kind"
NAMED_KEY = b"stretch.named"
_PICKLED_META = {PICKLED_KEY: b"1"}


class TypeInformation:
    """Base class of all type information (PyFlink: ``pyflink.common.typeinfo.TypeInformation``)."""

    # -- identity ---------------------------------------------------------------------------------
    def _key(self) -> tuple:
        """Everything that makes two instances of one class equal."""
        return ()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key() == other._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def __ne__(self, other: object) -> bool:
        return not self == other

    # -- PyFlink compatibility --------------------------------------------------------------------
    def need_conversion(self) -> bool:
        return False

    def to_internal_type(self, obj: Any) -> Any:
        return obj

    def from_internal_type(self, obj: Any) -> Any:
        return obj

    # -- Arrow ------------------------------------------------------------------------------------
    def to_arrow(self) -> pa.DataType:
        """The Arrow type of one value of this type."""
        raise NotImplementedError

    def to_arrow_field(self, name: str, nullable: bool = True) -> pa.Field:
        """An Arrow field holding values of this type, with stretch's field metadata if any."""
        return pa.field(name, self.to_arrow(), nullable=nullable, metadata=self._field_metadata())

    def _field_metadata(self) -> dict[bytes, bytes] | None:
        return None

    def is_fixed_width(self) -> bool:
        """True if values are stored as one fixed-width NumPy scalar (see :meth:`numpy_dtype`)."""
        return self.numpy_dtype() is not None

    def numpy_dtype(self) -> np.dtype | None:
        """NumPy dtype of the fixed-width representation, or None if the type is not fixed width.

        SQL_TIMESTAMP is int64 microseconds since the epoch, SQL_DATE int32 days since the epoch.
        """
        return None

    # -- JSON -------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        """A small JSON-able dict describing this type; :func:`from_json` inverts it."""
        raise NotImplementedError

    @staticmethod
    def from_json(data: dict | str | bytes) -> TypeInformation:
        return from_json(data)

    # -- descriptions -----------------------------------------------------------------------------
    def _expr(self) -> str:
        """The ``Types`` expression that builds this type, e.g. ``Types.LIST(Types.LONG())``."""
        raise NotImplementedError

    def _short(self) -> str:
        """Short name used in error messages: ``LONG`` for basic types, else the expression."""
        return self._expr()


def type_expr(type_info: TypeInformation | None) -> str:
    """Describe a type as the ``Types`` expression that builds it (used in error messages)."""
    return "None" if type_info is None else type_info._expr()


# --------------------------------------------------------------------------------------------------
# basic types
# --------------------------------------------------------------------------------------------------
class BasicType(Enum):
    STRING = "String"
    BYTE = "Byte"
    BOOLEAN = "Boolean"
    SHORT = "Short"
    INT = "Integer"
    LONG = "Long"
    FLOAT = "Float"
    DOUBLE = "Double"
    CHAR = "Char"
    BIG_INT = "BigInteger"
    BIG_DEC = "BigDecimal"
    INSTANT = "Instant"


_BASIC_ARROW: dict[BasicType, pa.DataType] = {
    BasicType.STRING: pa.large_string(),
    BasicType.BYTE: pa.int8(),
    BasicType.BOOLEAN: pa.bool_(),
    BasicType.SHORT: pa.int16(),
    BasicType.INT: pa.int32(),
    BasicType.LONG: pa.int64(),
    BasicType.FLOAT: pa.float32(),
    BasicType.DOUBLE: pa.float64(),
    BasicType.CHAR: pa.string(),
    BasicType.BIG_INT: pa.decimal128(38, 0),
    BasicType.BIG_DEC: pa.decimal128(38, 18),
    BasicType.INSTANT: pa.timestamp("us", tz="UTC"),
}

_BASIC_NUMPY: dict[BasicType, np.dtype] = {
    BasicType.BYTE: np.dtype(np.int8),
    BasicType.BOOLEAN: np.dtype(np.bool_),
    BasicType.SHORT: np.dtype(np.int16),
    BasicType.INT: np.dtype(np.int32),
    BasicType.LONG: np.dtype(np.int64),
    BasicType.FLOAT: np.dtype(np.float32),
    BasicType.DOUBLE: np.dtype(np.float64),
}


class BasicTypeInfo(TypeInformation):
    """Type information for primitive types (int, long, double, byte, ...), String, BigInteger,
    BigDecimal and Instant."""

    def __init__(self, basic_type: BasicType):
        self._basic_type = basic_type

    def _key(self) -> tuple:
        return (self._basic_type,)

    def __eq__(self, other: object) -> bool:
        # InstantTypeInfo is a BasicTypeInfo subclass; compare on the basic type like PyFlink.
        return isinstance(other, BasicTypeInfo) and self._basic_type == other._basic_type

    def __hash__(self) -> int:
        return hash(("BasicTypeInfo", self._basic_type))

    def __repr__(self) -> str:
        return self._basic_type.value

    def to_arrow(self) -> pa.DataType:
        return _BASIC_ARROW[self._basic_type]

    def numpy_dtype(self) -> np.dtype | None:
        return _BASIC_NUMPY.get(self._basic_type)

    def to_json(self) -> dict:
        return {"type": self._basic_type.name}

    def _expr(self) -> str:
        return f"Types.{self._basic_type.name}()"

    def _short(self) -> str:
        return self._basic_type.name

    @staticmethod
    def STRING_TYPE_INFO() -> BasicTypeInfo:
        return BasicTypeInfo(BasicType.STRING)

    @staticmethod
    def BOOLEAN_TYPE_INFO() -> BasicTypeInfo:
        return BasicTypeInfo(BasicType.BOOLEAN)

    @staticmethod
    def BYTE_TYPE_INFO() -> BasicTypeInfo:
        return BasicTypeInfo(BasicType.BYTE)

    @staticmethod
    def SHORT_TYPE_INFO() -> BasicTypeInfo:
        return BasicTypeInfo(BasicType.SHORT)

    @staticmethod
    def INT_TYPE_INFO() -> BasicTypeInfo:
        return BasicTypeInfo(BasicType.INT)

    @staticmethod
    def LONG_TYPE_INFO() -> BasicTypeInfo:
        return BasicTypeInfo(BasicType.LONG)

    @staticmethod
    def FLOAT_TYPE_INFO() -> BasicTypeInfo:
        return BasicTypeInfo(BasicType.FLOAT)

    @staticmethod
    def DOUBLE_TYPE_INFO() -> BasicTypeInfo:
        return BasicTypeInfo(BasicType.DOUBLE)

    @staticmethod
    def CHAR_TYPE_INFO() -> BasicTypeInfo:
        return BasicTypeInfo(BasicType.CHAR)

    @staticmethod
    def BIG_INT_TYPE_INFO() -> BasicTypeInfo:
        return BasicTypeInfo(BasicType.BIG_INT)

    @staticmethod
    def BIG_DEC_TYPE_INFO() -> BasicTypeInfo:
        return BasicTypeInfo(BasicType.BIG_DEC)

    @staticmethod
    def INSTANT_TYPE_INFO() -> InstantTypeInfo:
        return InstantTypeInfo(BasicType.INSTANT)


class InstantTypeInfo(BasicTypeInfo):
    """Type information for :class:`stretch.common.time.Instant` (Arrow ``timestamp[us, UTC]``)."""

    def __init__(self, basic_type: BasicType = BasicType.INSTANT):
        super().__init__(basic_type)

    def need_conversion(self) -> bool:
        return True


# --------------------------------------------------------------------------------------------------
# SQL time types
# --------------------------------------------------------------------------------------------------
class SqlTimeTypeInfo(TypeInformation):
    """Gives access to the SQL time type infos (PyFlink: ``SqlTimeTypeInfo``)."""

    @staticmethod
    def DATE() -> DateTypeInfo:
        return DateTypeInfo()

    @staticmethod
    def TIME() -> TimeTypeInfo:
        return TimeTypeInfo()

    @staticmethod
    def TIMESTAMP() -> TimestampTypeInfo:
        return TimestampTypeInfo()


class DateTypeInfo(TypeInformation):
    """``datetime.date`` values; Arrow ``date32`` (days since the epoch)."""

    def __repr__(self) -> str:
        return "DateTypeInfo"

    def need_conversion(self) -> bool:
        return True

    def to_arrow(self) -> pa.DataType:
        return pa.date32()

    def numpy_dtype(self) -> np.dtype | None:
        return np.dtype(np.int32)

    def to_json(self) -> dict:
        return {"type": "SQL_DATE"}

    def _expr(self) -> str:
        return "Types.SQL_DATE()"

    def _short(self) -> str:
        return "SQL_DATE"


class TimeTypeInfo(TypeInformation):
    """``datetime.time`` values; Arrow ``time64[us]``."""

    def __repr__(self) -> str:
        return "TimeTypeInfo"

    def need_conversion(self) -> bool:
        return True

    def to_arrow(self) -> pa.DataType:
        return pa.time64("us")

    def to_json(self) -> dict:
        return {"type": "SQL_TIME"}

    def _expr(self) -> str:
        return "Types.SQL_TIME()"

    def _short(self) -> str:
        return "SQL_TIME"


class TimestampTypeInfo(TypeInformation):
    """Naive ``datetime.datetime`` values; Arrow ``timestamp[us]`` (wall-clock microseconds)."""

    def __repr__(self) -> str:
        return "TimestampTypeInfo"

    def need_conversion(self) -> bool:
        return True

    def to_arrow(self) -> pa.DataType:
        return pa.timestamp("us")

    def numpy_dtype(self) -> np.dtype | None:
        return np.dtype(np.int64)

    def to_json(self) -> dict:
        return {"type": "SQL_TIMESTAMP"}

    def _expr(self) -> str:
        return "Types.SQL_TIMESTAMP()"

    def _short(self) -> str:
        return "SQL_TIMESTAMP"


# --------------------------------------------------------------------------------------------------
# arrays, lists, maps
# --------------------------------------------------------------------------------------------------
_PRIMITIVE_ELEMENTS = ("BOOLEAN", "BYTE", "SHORT", "INT", "LONG", "FLOAT", "DOUBLE", "CHAR")


def _basic_name(type_info: TypeInformation) -> str | None:
    if isinstance(type_info, BasicTypeInfo) and not isinstance(type_info, InstantTypeInfo):
        return type_info._basic_type.name
    return None


class _ArrayTypeInfo(TypeInformation):
    _kind = ""

    def __init__(self, element_type: TypeInformation):
        if not isinstance(element_type, TypeInformation):
            raise TypeError(
                f"element type must be a TypeInformation, got {misplaced_type_repr(element_type)}"
            )
        self._element_type = element_type

    def get_element_type(self) -> TypeInformation:
        return self._element_type

    def _key(self) -> tuple:
        return (self._element_type,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}<{self._element_type!r}>"

    def to_arrow(self) -> pa.DataType:
        return pa.large_list(self._element_type.to_arrow_field("item"))

    def to_json(self) -> dict:
        return {"type": self._kind, "element": self._element_type.to_json()}

    def _expr(self) -> str:
        return f"Types.{self._kind}({self._element_type._expr()})"


class PrimitiveArrayTypeInfo(_ArrayTypeInfo):
    """Arrays of primitive types; ``Types.PRIMITIVE_ARRAY(Types.BYTE())`` is ``bytes``
    (Arrow ``large_binary``), the others are lists (Arrow ``large_list``)."""

    _kind = "PRIMITIVE_ARRAY"

    def __init__(self, element_type: TypeInformation):
        super().__init__(element_type)
        if _basic_name(element_type) not in _PRIMITIVE_ELEMENTS:
            raise TypeError(f"Invalid element type for a primitive array: {element_type!r}")

    def to_arrow(self) -> pa.DataType:
        if _basic_name(self._element_type) == "BYTE":
            return pa.large_binary()
        return super().to_arrow()


class BasicArrayTypeInfo(_ArrayTypeInfo):
    """Arrays of boxed primitive types or strings; Python lists, Arrow ``large_list``."""

    _kind = "BASIC_ARRAY"

    def __init__(self, element_type: TypeInformation):
        super().__init__(element_type)
        if _basic_name(element_type) not in (*_PRIMITIVE_ELEMENTS, "STRING"):
            raise TypeError(f"Invalid element type for a boxed primitive array: {element_type!r}")


class ObjectArrayTypeInfo(_ArrayTypeInfo):
    """Arrays of any type; Python lists, Arrow ``large_list``."""

    _kind = "OBJECT_ARRAY"


class ListTypeInfo(TypeInformation):
    """Python lists of one element type; Arrow ``large_list``."""

    def __init__(self, element_type: TypeInformation):
        if not isinstance(element_type, TypeInformation):
            raise TypeError(
                f"element type must be a TypeInformation, got {misplaced_type_repr(element_type)}"
            )
        self.elem_type = element_type

    def get_element_type(self) -> TypeInformation:
        return self.elem_type

    def _key(self) -> tuple:
        return (self.elem_type,)

    def __repr__(self) -> str:
        return f"ListTypeInfo<{self.elem_type!r}>"

    def to_arrow(self) -> pa.DataType:
        return pa.large_list(self.elem_type.to_arrow_field("item"))

    def to_json(self) -> dict:
        return {"type": "LIST", "element": self.elem_type.to_json()}

    def _expr(self) -> str:
        return f"Types.LIST({self.elem_type._expr()})"


class MapTypeInfo(TypeInformation):
    """Python dicts; Arrow ``map_`` (keys must not be None)."""

    def __init__(self, key_type_info: TypeInformation, value_type_info: TypeInformation):
        for t in (key_type_info, value_type_info):
            if not isinstance(t, TypeInformation):
                raise TypeError(f"map key/value types must be TypeInformation, got {misplaced_type_repr(t)}")
        self._key_type_info = key_type_info
        self._value_type_info = value_type_info

    def get_key_type(self) -> TypeInformation:
        return self._key_type_info

    def get_value_type(self) -> TypeInformation:
        return self._value_type_info

    def _key(self) -> tuple:
        return (self._key_type_info, self._value_type_info)

    def __repr__(self) -> str:
        return f"MapTypeInfo<{self._key_type_info!r}, {self._value_type_info!r}>"

    def to_arrow(self) -> pa.DataType:
        return pa.map_(
            self._key_type_info.to_arrow_field("key", nullable=False),
            self._value_type_info.to_arrow_field("value"),
        )

    def to_json(self) -> dict:
        return {
            "type": "MAP",
            "key": self._key_type_info.to_json(),
            "value": self._value_type_info.to_json(),
        }

    def _expr(self) -> str:
        return f"Types.MAP({self._key_type_info._expr()}, {self._value_type_info._expr()})"


class PickledBytesTypeInfo(TypeInformation):
    """Any Python object, stored as ``pickle.dumps(obj, protocol=5)`` in a ``large_binary`` field
    marked ``{b"stretch.pickled": b"1"}``."""

    def __repr__(self) -> str:
        return "PickledByteArrayTypeInfo"

    def to_arrow(self) -> pa.DataType:
        return pa.large_binary()

    def _field_metadata(self) -> dict[bytes, bytes] | None:
        return _PICKLED_META

    def to_json(self) -> dict:
        return {"type": "PICKLED_BYTE_ARRAY"}

    def _expr(self) -> str:
        return "Types.PICKLED_BYTE_ARRAY()"

    def _short(self) -> str:
        return "PICKLED_BYTE_ARRAY"

    @staticmethod
    def PICKLED_BYTE_ARRAY_TYPE_INFO() -> PickledBytesTypeInfo:
        return PickledBytesTypeInfo()


# --------------------------------------------------------------------------------------------------
# rows and tuples
# --------------------------------------------------------------------------------------------------
def misplaced_type_repr(value: Any) -> str:
    """A value given where a TypeInformation belongs; ``Types.INT`` (not called) says so."""
    if callable(value) and getattr(value, "__qualname__", "").startswith("Types."):
        return f"{value.__qualname__} (call it: {value.__qualname__}())"
    return repr(value)


def _check_field_types(field_types: Any) -> list[TypeInformation]:
    field_types = list(field_types)
    for t in field_types:
        if not isinstance(t, TypeInformation):
            raise TypeError(f"field types must be TypeInformation instances, got {misplaced_type_repr(t)}")
    return field_types


class RowTypeInfo(TypeInformation):
    """Type information for :class:`stretch.common.Row` (``Types.ROW`` / ``Types.ROW_NAMED``)."""

    def __init__(self, field_types: list[TypeInformation], field_names: list[str] | None = None):
        self._field_types = _check_field_types(field_types)
        if field_names is not None:
            field_names = [str(n) for n in field_names]
            if len(field_names) != len(self._field_types):
                raise ValueError(f"ROW_NAMED got {len(field_names)} names for {len(self._field_types)} types")
            if len(set(field_names)) != len(field_names):
                raise ValueError(f"ROW_NAMED field names must be unique, got {field_names}")
        self._field_names = field_names

    def get_field_names(self) -> list[str]:
        """The field names; an unnamed ROW has Flink's default names ``f0..fn``."""
        if self._field_names is None:
            return [f"f{i}" for i in range(len(self._field_types))]
        return list(self._field_names)

    def get_field_index(self, field_name: str) -> int:
        names = self.get_field_names()
        return names.index(field_name) if field_name in names else -1

    def get_field_types(self) -> list[TypeInformation]:
        return self._field_types

    def is_named(self) -> bool:
        return self._field_names is not None

    def _key(self) -> tuple:
        names = None if self._field_names is None else tuple(self._field_names)
        return (tuple(self._field_types), names)

    def __repr__(self) -> str:
        if self._field_names:
            return "RowTypeInfo({})".format(
                ", ".join(f"{n}: {t!r}" for n, t in zip(self._field_names, self._field_types, strict=False))
            )
        return "RowTypeInfo({})".format(", ".join(repr(t) for t in self._field_types))

    def need_conversion(self) -> bool:
        return True

    def to_arrow(self) -> pa.DataType:
        return pa.struct(
            [t.to_arrow_field(n) for n, t in zip(self.get_field_names(), self._field_types, strict=False)]
        )

    def _field_metadata(self) -> dict[bytes, bytes] | None:
        if self._field_names is None:
            return {KIND_KEY: b"row", NAMED_KEY: b"default"}
        return {KIND_KEY: b"row"}

    def to_json(self) -> dict:
        fields = [t.to_json() for t in self._field_types]
        if self._field_names is None:
            return {"type": "ROW", "fields": fields}
        return {"type": "ROW_NAMED", "names": list(self._field_names), "fields": fields}

    def _expr(self) -> str:
        types = ", ".join(t._expr() for t in self._field_types)
        if self._field_names is None:
            return f"Types.ROW([{types}])"
        return f"Types.ROW_NAMED({self._field_names!r}, [{types}])"


class TupleTypeInfo(TypeInformation):
    """Type information for Python tuples (``Types.TUPLE``); Arrow struct with fields ``f0..fn``."""

    def __init__(self, field_types: list[TypeInformation]):
        self._field_types = _check_field_types(field_types)

    def get_field_types(self) -> list[TypeInformation]:
        return self._field_types

    def get_field_names(self) -> list[str]:
        return [f"f{i}" for i in range(len(self._field_types))]

    def _key(self) -> tuple:
        return tuple(self._field_types)

    def __repr__(self) -> str:
        return "TupleTypeInfo({})".format(", ".join(repr(t) for t in self._field_types))

    def need_conversion(self) -> bool:
        return True

    def to_arrow(self) -> pa.DataType:
        return pa.struct([t.to_arrow_field(f"f{i}") for i, t in enumerate(self._field_types)])

    def _field_metadata(self) -> dict[bytes, bytes] | None:
        return {KIND_KEY: b"tuple"}

    def to_json(self) -> dict:
        return {"type": "TUPLE", "fields": [t.to_json() for t in self._field_types]}

    def _expr(self) -> str:
        return "Types.TUPLE([{}])".format(", ".join(t._expr() for t in self._field_types))


# --------------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------------
def _basic_from_name(name: str) -> TypeInformation:
    basic = BasicType[name]
    return InstantTypeInfo() if basic is BasicType.INSTANT else BasicTypeInfo(basic)


_SIMPLE_JSON: dict[str, Any] = {
    **{b.name: (lambda name=b.name: _basic_from_name(name)) for b in BasicType},
    "SQL_DATE": DateTypeInfo,
    "SQL_TIME": TimeTypeInfo,
    "SQL_TIMESTAMP": TimestampTypeInfo,
    "PICKLED_BYTE_ARRAY": PickledBytesTypeInfo,
}
_ARRAY_JSON = {
    "PRIMITIVE_ARRAY": PrimitiveArrayTypeInfo,
    "BASIC_ARRAY": BasicArrayTypeInfo,
    "OBJECT_ARRAY": ObjectArrayTypeInfo,
    "LIST": ListTypeInfo,
}


def from_json(data: dict | str | bytes) -> TypeInformation:
    """Inverse of :meth:`TypeInformation.to_json`; also accepts the dict serialized as JSON text."""
    if isinstance(data, (str, bytes)):
        data = json.loads(data)
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"not a type description: {data!r}")
    kind = data["type"]
    if kind in _SIMPLE_JSON:
        return _SIMPLE_JSON[kind]()
    if kind in _ARRAY_JSON:
        return _ARRAY_JSON[kind](from_json(data["element"]))
    if kind == "MAP":
        return MapTypeInfo(from_json(data["key"]), from_json(data["value"]))
    if kind == "ROW":
        return RowTypeInfo([from_json(f) for f in data["fields"]])
    if kind == "ROW_NAMED":
        return RowTypeInfo([from_json(f) for f in data["fields"]], list(data["names"]))
    if kind == "TUPLE":
        return TupleTypeInfo([from_json(f) for f in data["fields"]])
    raise ValueError(f"unknown type {kind!r} in type description {data!r}")
