"""Fields named by position or name (``key_by("user")``, ``sum(1)``), checked against the stream's
record type where the program names them, so that a misspelt field fails on its line, not when the
job runs (or, for a rolling aggregate over keys seen once, never)."""

from __future__ import annotations

import pyarrow as pa

from stretch.common.typeinfo import RowTypeInfo, TupleTypeInfo, TypeInformation


def check_fields(type_info: TypeInformation | None, fields: list, what: str, numeric: bool = False) -> None:
    """Raise if a field is not one of the records' (known only for Row and tuple types; other
    streams are checked on their records), or (``numeric``) is text or a boolean, which Flink's
    sum refuses too (a pickled field may hold numbers: its records decide)."""
    if not isinstance(type_info, (RowTypeInfo, TupleTypeInfo)):
        return
    names, types = type_info.get_field_names(), type_info.get_field_types()
    for field in fields:
        if isinstance(field, int):
            if not 0 <= field < len(names):
                raise IndexError(
                    f"{what}: field position {field} is out of range for records with {len(names)} fields"
                )
            index = field
        elif field in names:
            index = names.index(field)
        else:
            raise ValueError(f"{what}: records have no field {field!r} (fields: {names})")
        arrow = types[index].to_arrow()
        if numeric and (
            pa.types.is_string(arrow) or pa.types.is_large_string(arrow) or pa.types.is_boolean(arrow)
        ):
            raise TypeError(f"{what}: field {names[index]!r} is {types[index]!r}, not a number")
