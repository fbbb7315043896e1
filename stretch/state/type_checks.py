"""Whether a value fits a state's declared type, checked where the value enters the state.

``update()`` and ``add()`` refuse a value of another type at once, so the error is raised inside
the user's function and the engine's report names the operator, the record and the key (a check
at the batch's write-back could name none of them). On the per-record path the check is one type
comparison: a value of the declared type's own Python type (``int`` for LONG, ``float`` for
DOUBLE, ``str`` for STRING) passes without a closer look, and only other values are examined. An
``int`` beyond an integer column's range is left to the write-back, which converts the batch's
values in bulk and refuses overflows there (``states.StateTypeError``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stretch.common.typeinfo import TypeInformation, Types, type_expr

_REPR_LIMIT = 200


class TypeCheck:
    """The values a state of one declared type can hold. ``fast`` is the Python type that passes
    with no closer look; ``check(value)`` raises ``TypeError`` for a value the state cannot hold.
    None fits a value (it means no value) but not a list's element of a declared type."""

    __slots__ = ("_hi", "_kind", "_lo", "_none", "fast", "subject")

    def __init__(self, type_info: TypeInformation | None, subject: str, none_fits: bool = True):
        self.subject = subject  # e.g. "state 'count' is declared Types.LONG()"
        self._none = none_fits
        self._lo = self._hi = None
        t = None if type_info is None or type_info == Types.PICKLED_BYTE_ARRAY() else type_info.to_arrow()
        if t is None:
            self._kind, self.fast = "any", object
        elif pa.types.is_boolean(t):
            self._kind, self.fast = "bool", bool
        elif pa.types.is_integer(t):
            info = np.iinfo(t.to_pandas_dtype())
            self._kind, self.fast, self._lo, self._hi = "int", int, int(info.min), int(info.max)
        elif pa.types.is_floating(t):
            # ints convert exactly only up to the mantissa's width (pyarrow's safe cast refuses more)
            exact = 2 ** (np.finfo(t.to_pandas_dtype()).nmant + 1)
            self._kind, self.fast, self._lo, self._hi = "float", float, -exact, exact
        elif pa.types.is_string(t) or pa.types.is_large_string(t):
            self._kind, self.fast = "str", str
        elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
            self._kind, self.fast = "bytes", bytes
        else:  # other types are pickled: anything that pickles fits
            self._kind, self.fast = "any", object

    def check(self, value) -> None:
        if self._kind == "any":
            return
        if value is None:
            if self._none:
                return
            reason = "a list's elements of a declared type cannot be None"
        else:
            reason = self._problem(value)
        if reason is not None:
            raise TypeError(f"{self.subject} but was given {_short(value)}: {reason}")

    def _problem(self, value) -> str | None:
        kind = self._kind
        if kind == "bool":
            return None if isinstance(value, (bool, np.bool_)) else _expected("a bool", value)
        if isinstance(value, (bool, np.bool_)) and kind in ("int", "float"):
            return "a bool is not a number here (as in Flink)"
        if kind == "int":
            if not isinstance(value, (int, np.integer)):
                return _expected("an int", value)
            if not self._lo <= value <= self._hi:
                return f"out of range ({self._lo} to {self._hi})"
            return None
        if kind == "float":
            if isinstance(value, (float, np.floating)):
                return None
            if not isinstance(value, (int, np.integer)):
                return _expected("a number", value)
            if not self._lo <= value <= self._hi:
                return f"an int beyond {self._hi} has no exact float value"
            return None
        if kind == "str":
            return None if isinstance(value, str) else _expected("a str", value)
        return None if isinstance(value, (bytes, bytearray, memoryview)) else _expected("bytes", value)


def value_check(descriptor) -> TypeCheck:
    """The check of a value state's (or reducing/aggregating state's) values."""
    t = descriptor.type_info
    return TypeCheck(t, f"state {descriptor.name!r} is declared {type_expr(t)}")


def element_check(descriptor) -> TypeCheck:
    """The check of a list state's elements."""
    t = descriptor.elem_type_info
    return TypeCheck(t, f"list state {descriptor.name!r} holds elements of {type_expr(t)}", none_fits=False)


def _expected(what: str, value) -> str:
    return f"expected {what}, got {type(value).__name__}"


def _short(value) -> str:
    try:
        text = repr(value)
    except Exception as e:  # a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__} object: repr() failed: {type(e).__name__}>"
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."
