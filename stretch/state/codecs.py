"""How a declared state's values are laid out in its shared-memory column.

Numeric and boolean values live in fixed-width columns (Arrow layout: values plus validity);
everything else is a variable-length value in the column's heap, encoded as UTF-8 (STRING), raw
bytes (BYTES) or pickle (composite and PICKLED_BYTE_ARRAY types: written and read only by the
job's own processes; classes of the user's script by value, ``user_code.dumps_value``). List elements are a concatenable stream, so appends never rewrite a list.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from stretch.common.typeinfo import TypeInformation, Types
from stretch.common.user_code import dumps_value

_LEN = struct.Struct("<I")


_NUMERIC = {
    pa.int8(): np.dtype(np.int8),
    pa.int16(): np.dtype(np.int16),
    pa.int32(): np.dtype(np.int32),
    pa.int64(): np.dtype(np.int64),
    pa.float32(): np.dtype(np.float32),
    pa.float64(): np.dtype(np.float64),
}


def numeric_dtype(arrow_type: pa.DataType) -> np.dtype | None:
    """The numpy dtype a fixed-width state column uses for an Arrow type (signed ints, floats)."""
    return _NUMERIC.get(arrow_type)


def fixed_dtype(type_info: TypeInformation | None) -> np.dtype | None:
    """The numpy dtype of a fixed-width column for this type, or None for variable-length storage."""
    if type_info is None or type_info == Types.PICKLED_BYTE_ARRAY():
        return None
    t = type_info.to_arrow()
    if pa.types.is_boolean(t):
        return np.dtype(np.uint8)
    return numeric_dtype(t)


@dataclass(frozen=True)
class ValueCodec:
    """Encode/decode one value of a variable-length column."""

    name: str  # "utf8" | "raw" | "pickle"

    def encode(self, value) -> bytes:
        if self.name == "utf8":
            if not isinstance(value, str):
                raise TypeError(f"expected str, got {type(value).__name__} {value!r}")
            return value.encode()
        if self.name == "raw":
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise TypeError(f"expected bytes, got {type(value).__name__} {value!r}")
            return bytes(value)
        return dumps_value(value)

    def decode(self, data) -> object:
        if self.name == "utf8":
            return bytes(data).decode()
        if self.name == "raw":
            return bytes(data)
        return pickle.loads(data)


def value_codec(type_info: TypeInformation | None) -> ValueCodec:
    if type_info is not None and type_info != Types.PICKLED_BYTE_ARRAY():
        t = type_info.to_arrow()
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return ValueCodec("utf8")
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return ValueCodec("raw")
    return ValueCodec("pickle")


class ElementStream:
    """A list's elements as bytes that can be appended to: raw values, or length-prefixed values."""

    def __init__(self, element_type: TypeInformation | None):
        self.dtype = fixed_dtype(element_type)
        self.codec = value_codec(element_type)
        self.is_bool = element_type is not None and element_type == Types.BOOLEAN()

    def encode(self, elements: list) -> bytes:
        if self.dtype is not None:
            if any(e is None for e in elements):
                raise TypeError("list state elements of a numeric type must not be None")
            return np.asarray(elements, dtype=self.dtype).tobytes()
        enc = self.codec.encode
        parts = []
        for e in elements:
            b = enc(e)
            parts.append(_LEN.pack(len(b)))
            parts.append(b)
        return b"".join(parts)

    def decode(self, data) -> list:
        if self.dtype is not None:
            arr = np.frombuffer(data, dtype=self.dtype)
            return arr.astype(bool).tolist() if self.is_bool else arr.tolist()
        out = []
        dec = self.codec.decode
        view = memoryview(data)
        pos, end = 0, len(view)
        while pos < end:
            (n,) = _LEN.unpack_from(view, pos)
            out.append(dec(view[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        return out


def storage_entry(descriptor) -> dict:
    """The registry entry describing a state: kind, storage and type (for queries from anywhere)."""
    t = descriptor.type_info
    if descriptor.kind in ("list", "map"):
        storage = "var"
    else:
        dtype = fixed_dtype(t)
        storage = dtype.name if dtype is not None else "var"
    return {
        "name": descriptor.name,
        "kind": descriptor.kind,
        "storage": storage,
        "type": t.to_json() if t is not None else None,
    }
