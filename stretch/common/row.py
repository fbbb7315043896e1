"""``Row`` and ``RowKind`` with PyFlink's semantics (``pyflink.common.types``, checked against
apache-flink 2.3.0).

A Row holds its values in ``_values`` (a list) and, when it has field names, the names in
``_fields``; a positional Row has no ``_fields`` attribute at all (``hasattr(row, "_fields")`` is
how PyFlink, and stretch, tell the two apart). Other modules duck-type on ``_values``.

As in PyFlink: ``Row(**kwargs)`` keeps the keyword order; ``repr`` is ``Row(name='a', age=1)``
for a named Row and ``<Row('a', 1)>`` for a positional one; ``key in row`` tests the field names
of a named Row and the values of a positional one; ``Row("name", "age")("a", 1)`` makes a named
Row; named Rows are equal when they have the same set of names with the same value per name and
the same row kind (field order does not matter); a named Row never equals a positional one.

Differences: ``Row`` uses ``__slots__`` (setting any other attribute raises AttributeError, as
PyFlink's ``__setattr__`` does); the hash of a named Row does not depend on the field order
(PyFlink hashes the values in field order, so two equal Rows could hash differently); a missing
field name raises :class:`RowFieldError`, which is a KeyError and also the ValueError (missing
name) or AttributeError (positional Row) that PyFlink raises.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = ["Row", "RowKind"]


class RowKind(Enum):
    """What a row means in a changelog: an insert, an update (before and after) or a delete."""

    INSERT = 0
    UPDATE_BEFORE = 1
    UPDATE_AFTER = 2
    DELETE = 3

    def __str__(self) -> str:
        return _ROW_KIND_SHORT[self.value]

    def short_string(self) -> str:
        return _ROW_KIND_SHORT[self.value]


_ROW_KIND_SHORT = ("+I", "-U", "+U", "-D")
_INSERT = RowKind.INSERT


class RowFieldError(KeyError, ValueError, AttributeError):
    """A field name the Row does not have. PyFlink raises ValueError for an unknown name and
    AttributeError when the Row has no names; this is both, and a KeyError like a dict's."""


def _create_row(fields: list | None, values: Any, row_kind: RowKind | None = None) -> Row:
    """Build a Row from field names (or None) and values; the unpickling hook, as in PyFlink."""
    row = Row.__new__(Row)
    row._values = list(values)
    if fields is not None:
        row._fields = list(fields)
    row._row_kind = _INSERT if row_kind is None else row_kind
    return row


class Row:
    """A row with fields accessible by position (``row[0]``), by name (``row.key``,
    ``row["key"]``) and by iteration.

    ::

        >>> row = Row(name="Alice", age=11)
        >>> row
        Row(name='Alice', age=11)
        >>> row.name, row["age"], row[0]
        ('Alice', 11, 'Alice')
        >>> Row("Alice", 11)
        <Row('Alice', 11)>
        >>> Person = Row("name", "age")
        >>> Person("Bob", 3)
        Row(name='Bob', age=3)
    """

    __slots__ = ("_fields", "_from_dict", "_row_kind", "_values")

    def __init__(self, *args: Any, **kwargs: Any):
        if args and kwargs:
            raise ValueError("Can not use both args and kwargs to create Row")
        if kwargs:
            self._fields = list(kwargs)
            self._values = list(kwargs.values())
            self._from_dict = True
        else:
            self._values = list(args)
            self._from_dict = False
        self._row_kind = _INSERT

    # -- PyFlink API ------------------------------------------------------------------------------
    def as_dict(self, recursive: bool = False) -> dict:
        """The fields as a dict of name to value; nested Rows too if ``recursive``."""
        if not hasattr(self, "_fields"):
            raise TypeError("Cannot convert a Row class into dict")
        if recursive:

            def conv(obj: Any) -> Any:
                if isinstance(obj, Row):
                    return obj.as_dict(True)
                if isinstance(obj, list):
                    return [conv(o) for o in obj]
                if isinstance(obj, dict):
                    return {k: conv(v) for k, v in obj.items()}
                return obj

            return dict(zip(self._fields, (conv(o) for o in self._values), strict=False))
        return dict(zip(self._fields, self._values, strict=False))

    def get_row_kind(self) -> RowKind:
        return self._row_kind

    def set_row_kind(self, row_kind: RowKind) -> None:
        self._row_kind = row_kind

    def set_field_names(self, field_names: list) -> None:
        self._fields = list(field_names)

    def get_fields_by_names(self, names: list) -> list:
        """The values for ``names``; a positional Row returns its values as they are."""
        fields = getattr(self, "_fields", None)
        if fields is None or names == fields:
            return self._values
        missing = [n for n in names if n not in fields]
        if missing:
            raise RowFieldError(f"Field names {missing} not exist in {fields}.")
        return [self._values[fields.index(n)] for n in names]

    @staticmethod
    def of_kind(row_kind: RowKind, *args: Any, **kwargs: Any) -> Row:
        row = Row(*args, **kwargs)
        row._row_kind = row_kind
        return row

    def _is_retract_msg(self) -> bool:
        return self._row_kind in (RowKind.UPDATE_BEFORE, RowKind.DELETE)

    def _is_accumulate_msg(self) -> bool:
        return self._row_kind in (RowKind.UPDATE_AFTER, RowKind.INSERT)

    # -- container protocol -----------------------------------------------------------------------
    def __contains__(self, item: Any) -> bool:
        fields = getattr(self, "_fields", None)
        if fields is not None:
            return item in fields
        return item in self._values

    def __call__(self, *args: Any) -> Row:
        """Use a Row of names as a Row class: ``Row("a", "b")(1, 2) == Row(a=1, b=2)``."""
        if len(args) > len(self):
            raise ValueError(
                f"Can not create Row with fields {self}, expected {len(self)} values but got {args}"
            )
        return _create_row(self._values, args, self._row_kind)

    def _index_of(self, name: Any) -> int:
        fields = getattr(self, "_fields", None)
        if fields is None:
            raise RowFieldError(f"{name!r}: Row has no field names")
        try:
            return fields.index(name)
        except ValueError:
            raise RowFieldError(name) from None

    def __getitem__(self, item: Any) -> Any:
        if isinstance(item, (int, slice)):
            return self._values[item]
        return self._values[self._index_of(item)]

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(key, (int, slice)):
            self._values[key] = value
        else:
            self._values[self._index_of(key)] = value

    def __getattr__(self, item: str) -> Any:
        # Only called when normal lookup fails: unset slots and field names.
        if item.startswith("_"):
            raise AttributeError(item)
        try:
            fields = object.__getattribute__(self, "_fields")
            return self._values[fields.index(item)]
        except (AttributeError, ValueError):
            raise AttributeError(item) from None

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    # -- identity ---------------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Row) or self.__class__ != other.__class__:
            return False
        fields = getattr(self, "_fields", None)
        other_fields = getattr(other, "_fields", None)
        if (fields is None) != (other_fields is None) or self._row_kind != other._row_kind:
            return False
        if fields is None or fields == other_fields:
            return self._values == other._values
        names = sorted(fields)
        if names != sorted(other_fields):  # type: ignore[arg-type]
            return False
        return [self._values[fields.index(n)] for n in names] == [
            other._values[other_fields.index(n)]  # type: ignore[union-attr]
            for n in names
        ]

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        fields = getattr(self, "_fields", None)
        if fields is None or len(fields) != len(self._values):
            return hash(tuple(self._values))
        order = sorted(range(len(fields)), key=fields.__getitem__)
        return hash(tuple(self._values[i] for i in order))

    def __reduce__(self):
        return _create_row, (getattr(self, "_fields", None), tuple(self._values), self._row_kind)

    def __repr__(self) -> str:
        fields = getattr(self, "_fields", None)
        if fields is not None:
            pairs = zip(fields, self._values, strict=False)
            return "Row({})".format(", ".join(f"{k}={v!r}" for k, v in pairs))
        return "<Row({})>".format(", ".join(repr(v) for v in self._values))
