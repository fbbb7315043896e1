"""OutputTag: names a side output (PyFlink: ``pyflink.datastream.OutputTag``)."""

from __future__ import annotations

from stretch.common.typeinfo import TypeInformation


class OutputTag:
    """A side output's name and type; yield ``(tag, value)`` to emit to it, read it with
    ``stream.get_side_output(tag)``."""

    def __init__(self, tag_id: str, type_info: TypeInformation | None = None):
        if not isinstance(tag_id, str) or not tag_id:
            raise ValueError("OutputTag tag_id cannot be empty")
        self.tag_id = tag_id
        self.type_info = type_info

    def __eq__(self, other) -> bool:
        return isinstance(other, OutputTag) and other.tag_id == self.tag_id

    def __hash__(self) -> int:
        return hash(("OutputTag", self.tag_id))

    def __repr__(self) -> str:
        return f"OutputTag({self.tag_id!r})"
