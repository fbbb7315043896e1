"""Keyed operators as one instance runs them: over the rows of a batch that it owns.

Every operator first maps the batch's keys to rows of the shared key-group tables (``base``), then
runs the user's function per record (``process``; with a broadcast input, ``broadcast``), folds
whole columns with a numba kernel (``aggregate``, ``vector_window``), or probes a band of both
inputs (``band_join``).
"""

from __future__ import annotations

from stretch.plan.stages import OperatorSpec
from stretch.runtime.operators.aggregate import AggregateOperator
from stretch.runtime.operators.band_join import BandJoinOperator
from stretch.runtime.operators.base import KeyedOperator
from stretch.runtime.operators.broadcast import BroadcastProcessOperator
from stretch.runtime.operators.context import InstanceRuntimeContext
from stretch.runtime.operators.process import ProcessOperator
from stretch.runtime.operators.vector_window import VectorWindowOperator
from stretch.state.keyed_table import KeyedTable

_KINDS = {
    "process": ProcessOperator,
    "aggregate": AggregateOperator,
    "vector_window": VectorWindowOperator,
    "band_join": BandJoinOperator,
    "broadcast_process": BroadcastProcessOperator,
}


def make_operator(spec: OperatorSpec, name: str, table: KeyedTable) -> KeyedOperator:
    kind = _KINDS.get(spec.kind)
    if kind is None:
        raise ValueError(f"unknown keyed operator kind {spec.kind!r}")
    return kind(spec, name, table)


__all__ = ["InstanceRuntimeContext", "KeyedOperator", "make_operator"]
