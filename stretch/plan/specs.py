"""What the API decided for the operators that are not a user function: the specs a plan's
vectorized windows, band joins and broadcast process functions carry to the runtime operators
that run them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class VectorWindowSpec:
    """What the planner decided: the windows, the aggregates and where late records go."""

    size: int
    slide: int
    offset: int
    aggregates: list  # of BuiltinAggregate
    late_tag: object = None

    @property
    def ring(self) -> int:
        """Initial window slots per key: room for a window's span twice over and a watermark that
        trails the records by a dozen windows; a key that needs more grows its own ring."""
        span = -(-self.size // self.slide)
        return _pow2(max(16, 2 * span + 4))


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass
class BandJoinSpec:
    """What the band join operator (``stretch.runtime.operators.band_join``) runs."""

    bound: int  # join pairs with |t_left - t_right| <= bound
    predicate: Any  # callable(left, right) -> bool, or None
    function: Any  # JoinFunction or callable(left, right)


@dataclass
class BroadcastSpec:
    """What the broadcast process operator (``stretch.runtime.operators.broadcast``) runs: a
    (Keyed)BroadcastProcessFunction over ``(0, element)`` / ``(1, broadcast element)`` records."""

    function: Any  # BroadcastProcessFunction or KeyedBroadcastProcessFunction
    descriptors: list  # the MapStateDescriptors given to broadcast()
    keyed: bool  # the non-broadcast input is keyed (keyed state and timers)
