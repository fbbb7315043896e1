"""Transformations: the nodes of the job graph the DataStream API records (nothing runs yet)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from stretch.common.typeinfo import TypeInformation

_ids = itertools.count(1)


@dataclass(eq=False)
class Transformation:
    """One step of the job graph; ``kind`` says what it does, ``spec`` holds its function or source.

    Kinds: source, map, flat_map, filter, union, key_by, process (keyed), aggregate (vectorized
    keyed sum/min/max), sink.
    """

    kind: str
    inputs: list[Transformation]
    name: str
    spec: dict[str, Any] = field(default_factory=dict)
    output_type: TypeInformation | None = None
    parallelism: int | None = None
    max_parallelism: int | None = None
    uid: str | None = None
    id: int = field(default_factory=lambda: next(_ids))

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name!r} #{self.id}>"


def reachable(sinks: list[Transformation]) -> list[Transformation]:
    """Every transformation some sink depends on, inputs before their consumers."""
    order: list[Transformation] = []
    seen: set[int] = set()

    def visit(t: Transformation) -> None:
        if t.id in seen:
            return
        seen.add(t.id)
        for i in t.inputs:
            visit(i)
        order.append(t)

    for s in sinks:
        visit(s)
    return order
