"""One operator instance's access to its operator's keyed state, a batch at a time."""

from __future__ import annotations

import numpy as np

from stretch.common.wording import a
from stretch.state.codecs import storage_entry
from stretch.state.keyed_table import KeyedTable
from stretch.state.states import make_state
from stretch.state.timers import TimerStore
from stretch.state.ttl import WRAPPERS, stamps_descriptor


class KeyedStateBackend:
    """Binds state descriptors to the shared tables and moves values in and out per batch.

    Between ``begin`` and ``end`` the states hold the values of the batch's distinct keys;
    ``current`` is the slot of the key being processed, ``keys[current]`` the key itself.
    """

    def __init__(self, table: KeyedTable):
        self.table = table
        self.current = 0
        self.keys: list = []
        self._states: dict[str, object] = {}
        self._kgs = np.zeros(0, dtype=np.uint16)
        self._rows = np.zeros(0, dtype=np.int64)
        self._touched = np.zeros(0, dtype=np.uint16)
        self._in_batch = False
        self._timers: TimerStore | None = None
        self._timer_ops: dict[int, list] = {}  # (domain, slot) -> [(timestamp, register?)]

    def state(self, descriptor):
        """The state object for a descriptor (the same object for the same name)."""
        existing = self._states.get(descriptor.name)
        if existing is not None:
            if type(existing.descriptor) is not type(descriptor):
                raise ValueError(
                    f"state {descriptor.name!r} is already declared as {a(type(existing.descriptor).__name__)}"
                )
            return existing
        sid = self.table.arena.register_state(storage_entry(descriptor))
        state = make_state(self, sid, descriptor)
        ttl = descriptor._ttl_config
        if ttl is not None and ttl.is_enabled():
            state = WRAPPERS[descriptor.kind](state, self.state(stamps_descriptor(descriptor)), ttl)
        self._states[descriptor.name] = state
        if self._in_batch:
            state._load(self._kgs, self._rows)
        return state

    def current_key(self):
        return self.keys[self.current]

    def timer_store(self, create: bool = True) -> TimerStore | None:
        """The operator's timers (created on first use; found if another instance created them)."""
        if self._timers is None:
            exists = any(e["name"] == "__timers_event" for e in self.table.arena.registry())
            if create or exists:
                self._timers = TimerStore(self.table)
        return self._timers

    def timer_op(self, domain: int, timestamp: int, register: bool) -> None:
        """Register or delete a timer of the current key; applied when the batch ends."""
        if self._timers is None:
            self.timer_store()
        self._timer_ops.setdefault((domain, self.current), []).append((timestamp, register))

    def has_timer_ops(self, domain: int, slot: int) -> bool:
        return (domain, slot) in self._timer_ops

    def defer_timers(self, domain: int, slot: int, stamps: list) -> None:
        """Register popped timers again ahead of the key's pending ops (which may delete them)."""
        ops = self._timer_ops.setdefault((domain, slot), [])
        ops[:0] = [(t, True) for t in stamps]

    def begin(self, kgs: np.ndarray, rows: np.ndarray, keys: list) -> None:
        """Load every state's values for the batch's distinct keys (kgs[i], rows[i], keys[i])."""
        self._kgs = kgs
        self._rows = rows
        self.keys = keys
        self._touched = np.unique(kgs)
        self.table.begin_write(self._touched)
        for state in self._states.values():
            state._load(kgs, rows)
        self._in_batch = True

    def end(self) -> None:
        """Write every changed value back to shared memory; the tables are authoritative again."""
        try:
            for state in self._states.values():
                state._flush(self._kgs, self._rows)
            if self._timer_ops:
                ops, self._timer_ops = self._timer_ops, {}
                for domain in (0, 1):
                    slots = [u for (d, u) in ops if d == domain]
                    if slots:
                        idx = np.array(slots, dtype=np.int64)
                        self._timers.apply(
                            domain, self._kgs[idx], self._rows[idx], [ops[(domain, u)] for u in slots]
                        )
        finally:
            self._in_batch = False
            self.table.end_write(self._touched)
