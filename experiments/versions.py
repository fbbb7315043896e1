"""The code versions ``update.py`` swaps live, in a module of their own, as a user's rules would be.

Workers import the module of a function they unpickle by reference the first time they meet it: a
version defined in the benchmark's script would have every spare worker's check and every
instance import the whole benchmark (about 40 ms on a busy core) at the first update, which is the
script's weight, not the update's.
"""

from __future__ import annotations

from throughput import CountSum

from stretch.common import Types
from stretch.datastream import KeyedProcessFunction
from stretch.datastream.state import ValueStateDescriptor


class Profile(KeyedProcessFunction):
    """Version A: counts a key's events and keeps a payload (the bulk of the state) per key."""

    def __init__(self, payload: int):
        self.payload = payload

    def open(self, ctx):
        self.count = ctx.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.blob = ctx.get_state(ValueStateDescriptor("blob", Types.PICKLED_BYTE_ARRAY()))

    def process_element(self, value, ctx):
        c = (self.count.value() or 0) + 1
        self.count.update(c)
        if c == 1:
            self.blob.update(bytes(self.payload))
        return ()


class ProfileB(Profile):
    """Version B: the same states, another rule."""

    def process_element(self, value, ctx):
        self.count.update((self.count.value() or 0) + 2)
        return ()


class CountSumB(CountSum):
    """The backlog case's second version: the same states, another rule."""

    def process_element(self, value, ctx):
        c = (self.count.value() or 0) + 2
        s = (self.sum.value() or 0.0) + value[2]
        self.count.update(c)
        self.sum.update(s)
        yield value[0], c, s
