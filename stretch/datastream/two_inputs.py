"""Two inputs in one keyed gate: each element tagged with its side, ``(0, left)`` / ``(1, right)``,
the two streams unioned and keyed by the key selector of the element's side (Flink's
UnionKeySelector). Joins, connected streams and broadcast streams are all built on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stretch.common.typeinfo import Types
from stretch.contracts.functions import KeySelector, MapFunction

if TYPE_CHECKING:
    from stretch.datastream.data_stream import DataStream, KeyedStream

LEFT, RIGHT = 0, 1


class _Tag(MapFunction):
    """Marks which input an element came from."""

    def __init__(self, side: int):
        self.side = side

    def map(self, value):
        return self.side, value


def key_of(selector, value):
    """A side's key: a KeySelector, a callable, or (as in key_by) a field position or name."""
    if isinstance(selector, KeySelector):
        return selector.get_key(value)
    if callable(selector):
        return selector(value)
    if isinstance(selector, int) or not isinstance(value, tuple):
        return value[selector]  # tuple positions, and Row positions and names
    if selector.startswith("f") and selector[1:].isdigit():  # a tuple's fields are f0..fn
        return value[int(selector[1:])]
    raise KeyError(f"a tuple has no field {selector!r}")


class UnionKey(KeySelector):
    """The key of a tagged element: the key selector of its side (Flink's UnionKeySelector)."""

    def __init__(self, left, right):
        self.selectors = (left, right)

    def get_key(self, value):
        side, element = value
        return key_of(self.selectors[side], element)


def union_tagged(left: DataStream, right: DataStream) -> DataStream:
    """``(0, left)`` and ``(1, right)`` elements in one stream (pickled: the sides' types differ)."""
    tag_type = Types.PICKLED_BYTE_ARRAY()
    return left._values().map(_Tag(LEFT), tag_type).union(right._values().map(_Tag(RIGHT), tag_type))


def selector_of(keyed: KeyedStream):
    spec = keyed._t.spec
    return spec["selector"] if "selector" in spec else spec["field"]
