"""Broadcast state (PyFlink's ``BroadcastStream`` and ``BroadcastConnectedStream``).

``rules.broadcast(descriptor)`` makes a BroadcastStream; ``events.connect(rules_broadcast)``
(events keyed or not) connects it to another stream, and ``.process(function)`` runs a
(Keyed)BroadcastProcessFunction over both. As a connected stream's inputs do, both inputs become
one tagged stream in one gate; the broadcast input's elements carry a key that marks them, and
every instance of the operator applies each of them to its own copy of the broadcast state, in
gate order (see ``stretch.runtime.operators.broadcast``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from stretch.common.typeinfo import TypeInformation
from stretch.contracts.functions import (
    BroadcastProcessFunction,
    KeyedBroadcastProcessFunction,
    KeySelector,
)
from stretch.contracts.state import MapStateDescriptor
from stretch.datastream.two_inputs import LEFT, _Tag, key_of, selector_of, union_tagged
from stretch.plan.specs import BroadcastSpec
from stretch.runtime.operators.broadcast import BROADCAST_KEY

if TYPE_CHECKING:
    from stretch.datastream.data_stream import DataStream


class BroadcastStream:
    """A stream whose elements reach every instance of the operator it is connected to, with the
    broadcast states (MapStateDescriptors) that operator keeps of them."""

    def __init__(self, stream: DataStream, descriptors: tuple):
        if not descriptors:
            raise ValueError("broadcast state needs at least one MapStateDescriptor")
        for d in descriptors:
            if not isinstance(d, MapStateDescriptor):
                raise TypeError(f"broadcast() takes MapStateDescriptors, got {d!r}")
        names = [d.get_name() for d in descriptors]
        if len(set(names)) != len(names):
            raise ValueError(f"broadcast state names must differ, got {names}")
        self.stream = stream
        self.descriptors = list(descriptors)

    def get_execution_environment(self):
        return self.stream.get_execution_environment()


class BroadcastConnectedStream:
    """A (keyed or non-keyed) stream connected to a BroadcastStream: ``process(function)``."""

    def __init__(self, stream: DataStream, broadcast_stream: BroadcastStream):
        self.stream = stream
        self.broadcast_stream = broadcast_stream

    def _is_keyed(self) -> bool:
        return self.stream._is_keyed

    def process(self, func, output_type: TypeInformation | None = None) -> DataStream:
        """A KeyedBroadcastProcessFunction (the stream is keyed) or a BroadcastProcessFunction."""
        keyed = self._is_keyed()
        if keyed and not isinstance(func, KeyedBroadcastProcessFunction):
            raise TypeError(
                "a keyed stream connected to a BroadcastStream needs a KeyedBroadcastProcessFunction"
            )
        if not keyed and not isinstance(func, BroadcastProcessFunction):
            raise TypeError("a stream connected to a BroadcastStream needs a BroadcastProcessFunction")
        selector = selector_of(self.stream) if keyed else None
        tagged = union_tagged(self.stream, self.broadcast_stream.stream).key_by(_BroadcastKey(selector))
        spec = BroadcastSpec(func, self.broadcast_stream.descriptors, keyed)
        name = "Co-Process-Broadcast-Keyed" if keyed else "Co-Process-Broadcast"
        return tagged._keyed("broadcast_process", name, {"fn": spec}, output_type)


class _BroadcastKey(KeySelector):
    """A tagged element's key: a broadcast element's marks it; the other input's is its key, or
    (not keyed) a per-producer counter, which spreads its elements over key groups round robin."""

    def __init__(self, selector):
        self.selector = selector
        self.next = None

    def get_key(self, value):
        side, element = value
        if side != LEFT:
            return BROADCAST_KEY
        if self.selector is not None:
            return key_of(self.selector, element)
        n = self.next
        if n is None:  # each producer process starts at its own point (its copy is unpickled there)
            n = int.from_bytes(os.urandom(4), "little")
        self.next = n + 1
        return n


def input_side(fn) -> int | None:
    """The input of a two-input operator that a chained step tags its elements as (``LEFT``: the
    connected stream, ``RIGHT``: the broadcast one), or None for a step that tags nothing. A
    cluster reads it to tell a job's broadcast channels from its keyed ones."""
    return fn.side if isinstance(fn, _Tag) else None


def keyed_input_selector(key_selector):
    """What a broadcast operator's keyed input is keyed by: a field (``key_by(0)``,
    ``key_by("id")``) or a key selector function; None if it is not keyed. A cluster routes the
    input's rows by it."""
    return key_selector.selector if isinstance(key_selector, _BroadcastKey) else None
