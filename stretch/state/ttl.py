"""Processing-time TTL of keyed state, with Flink's semantics.

A state with a ``StateTtlConfig`` is wrapped around its plain implementation and a companion
state of last-write timestamps (one per value, per map entry, per list element), both ordinary
keyed state in shared memory, so expiry follows the key through live rescales like the value does.
As in Flink, an expired value is cleared when it is accessed; with ``NeverReturnExpired`` (the
default) it is never seen again, with ``ReturnExpiredIfNotCleanedUp`` that access still returns it.
``OnReadAndWrite`` also refreshes the timestamp on every read of an unexpired value.
"""

from __future__ import annotations

import time

from stretch.common.typeinfo import Types
from stretch.contracts import state as api

TTL_PREFIX = "__ttl__"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class _Ttl:
    """The policy shared by every TTL'd state kind."""

    def __init__(self, inner, stamps, config: api.StateTtlConfig):
        self._inner = inner
        self._stamps = stamps
        self.descriptor = inner.descriptor
        self._ttl_ms = config.get_ttl().to_milliseconds()
        self._on_read = config.get_update_type() is api.StateTtlConfig.UpdateType.OnReadAndWrite
        self._return_expired = (
            config.get_state_visibility() is api.StateTtlConfig.StateVisibility.ReturnExpiredIfNotCleanedUp
        )

    def _load(self, kgs, rows) -> None:  # the stamps are a state of their own, loaded by the backend
        self._inner._load(kgs, rows)

    def _flush(self, kgs, rows) -> None:
        self._inner._flush(kgs, rows)

    def _expired(self, stamp: int | None, now: int) -> bool:
        return stamp is not None and stamp + self._ttl_ms <= now


class TtlValueState(_Ttl, api.ValueState):
    def _check(self):
        """The value unless expired (cleared on access); refreshes the stamp on read if asked."""
        value = self._inner.value()
        if value is None:
            return None
        now = now_ms()
        if self._expired(self._stamps.value(), now):
            self.clear()
            return value if self._return_expired else None
        if self._on_read:
            self._stamps.update(now)
        return value

    def value(self):
        return self._check()

    def update(self, value) -> None:
        if value is None:
            self.clear()
            return
        self._inner.update(value)
        self._stamps.update(now_ms())

    def clear(self) -> None:
        self._inner.clear()
        self._stamps.clear()


class TtlMergingState(_Ttl, api.AppendingState):
    """ReducingState and AggregatingState: adding to an expired value starts afresh."""

    def _live(self) -> bool:
        if self._expired(self._stamps.value(), now_ms()):
            self.clear()
            return False
        return True

    def get(self):
        stamp = self._stamps.value()
        now = now_ms()
        if self._expired(stamp, now):
            result = self._inner.get()
            self.clear()
            return result if self._return_expired else None
        if self._on_read and stamp is not None:
            self._stamps.update(now)
        return self._inner.get()

    def add(self, value) -> None:
        self._live()
        self._inner.add(value)
        self._stamps.update(now_ms())

    def clear(self) -> None:
        self._inner.clear()
        self._stamps.clear()


class TtlReducingState(TtlMergingState, api.ReducingState):
    pass


class TtlAggregatingState(TtlMergingState, api.AggregatingState):
    pass


class TtlMapState(_Ttl, api.MapState):
    """Each entry expires on its own, as in Flink."""

    def _entry(self, key, now: int):
        stamp = self._stamps.get(key)
        if stamp is None:
            return None, False
        if self._expired(stamp, now):
            value = self._inner.get(key)
            self.remove(key)
            return value, self._return_expired
        if self._on_read:
            self._stamps.put(key, now)
        return self._inner.get(key), True

    def get(self, key):
        value, present = self._entry(key, now_ms())
        return value if present else None

    def contains(self, key) -> bool:
        return self._entry(key, now_ms())[1]

    def put(self, key, value) -> None:
        self._inner.put(key, value)
        self._stamps.put(key, now_ms())

    def put_all(self, dict_value) -> None:
        for k, v in dict_value.items():
            self.put(k, v)

    def remove(self, key) -> None:
        self._inner.remove(key)
        self._stamps.remove(key)

    def items(self):
        now = now_ms()
        out = []
        for k in self._stamps:  # a snapshot of the keys: expired entries go as we read
            value, present = self._entry(k, now)
            if present:
                out.append((k, value))
        return out

    def keys(self):
        return [k for k, _ in self.items()]

    def values(self):
        return [v for _, v in self.items()]

    def is_empty(self) -> bool:
        return not self.items()

    def clear(self) -> None:
        self._inner.clear()
        self._stamps.clear()


class TtlListState(_Ttl, api.ListState):
    """Each element expires on its own, as in Flink; expired elements are dropped when read."""

    def get(self):
        values = list(self._inner.get() or [])
        if not values:
            return []
        stamps = list(self._stamps.get() or [])
        now = now_ms()
        live = [i for i, s in enumerate(stamps) if not self._expired(s, now)]
        if len(live) < len(values):
            kept = [values[i] for i in live]
            self._inner.update(kept)
            self._stamps.update([stamps[i] for i in live])
            if self._return_expired:
                return values
            values = kept
        if self._on_read and values:
            self._stamps.update([now] * len(values))
        return values

    def add(self, value) -> None:
        self._inner.add(value)
        self._stamps.add(now_ms())

    def add_all(self, values) -> None:
        values = list(values)
        self._inner.add_all(values)
        self._stamps.add_all([now_ms()] * len(values))

    def update(self, values) -> None:
        values = list(values or [])
        self._inner.update(values)
        self._stamps.update([now_ms()] * len(values))

    def clear(self) -> None:
        self._inner.clear()
        self._stamps.clear()


def stamps_descriptor(descriptor):
    """The companion state holding a TTL'd state's write timestamps."""
    name = TTL_PREFIX + descriptor.name
    if descriptor.kind == "map":
        return api.MapStateDescriptor(name, descriptor.key_type_info, Types.LONG())
    if descriptor.kind == "list":
        return api.ListStateDescriptor(name, Types.LONG())
    return api.ValueStateDescriptor(name, Types.LONG())


WRAPPERS = {
    "value": TtlValueState,
    "reducing": TtlReducingState,
    "aggregating": TtlAggregatingState,
    "map": TtlMapState,
    "list": TtlListState,
}
