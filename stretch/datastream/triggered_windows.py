"""Windows fired by a Trigger and thinned by an Evictor (Flink's WindowOperator with a custom
trigger, and its EvictingWindowOperator), on keyed state and timers like every window.

A trigger's timers and state are scoped to (key, window), as in Flink: the engine's timers are
per key and time, so the operator keeps, per key, which windows' triggers (or cleanups) each timer
is for, and calls only those; trigger state lives in a map keyed by (window, state name). With an
evictor a pane keeps its elements with their timestamps, and the window's function runs over what
the evictor leaves. Used when ``trigger``/``evictor`` is set or the assigner is GlobalWindows;
other windows keep the plain window operator.

Session windows merge as in Flink's MergingWindowSet: a new window absorbs every session of its key
that it overlaps, their contents and trigger state move to the merged window (the trigger's
``on_merge``, with ``merge_partitioned_state``), and the absorbed windows' triggers are cleared and
their cleanup timers dropped. A purged session stays a window (with no contents) until its cleanup,
so later records still merge into it, as in Flink.
"""

from __future__ import annotations

from stretch.common.typeinfo import Types
from stretch.contracts.evictors import Evictor, TimestampedValue
from stretch.contracts.functions import ProcessWindowFunction, TimeDomain
from stretch.contracts.state import MapStateDescriptor
from stretch.contracts.triggers import Trigger, default_trigger
from stretch.contracts.window import GlobalWindow, TimeWindow
from stretch.datastream.windowing import WindowOperator, _call, _WindowContext

_MAX = 2**63 - 1
_EVENT, _PROCESSING = "event", "processing"
_FIRE, _CLEANUP = 0, 1  # what a timer is for: a window's trigger, or the end of its lateness


def _key_of(window) -> tuple:
    return ("global",) if isinstance(window, GlobalWindow) else (window.start, window.end)


def _window_of(key: tuple):
    return GlobalWindow() if key == ("global",) else TimeWindow(*key)


class TriggeredWindowOperator(WindowOperator):
    def __init__(self, assigner, mode, fn, window_fn, allowed_lateness, late_tag, trigger, evictor):
        super().__init__(assigner, mode, fn, window_fn, allowed_lateness, late_tag)
        if self.counting:
            raise ValueError(
                "a custom trigger or evictor works with time, session and global windows; count windows "
                "keep their own firing (for a trigger on counts: GlobalWindows with a CountTrigger)"
            )
        if trigger is not None and not isinstance(trigger, Trigger):
            raise TypeError(f"trigger() needs a Trigger, got {trigger!r}")
        if evictor is not None and not isinstance(evictor, Evictor):
            raise TypeError(f"evictor() needs an Evictor, got {evictor!r}")
        self.trigger = trigger if trigger is not None else default_trigger(assigner)
        if assigner.merging and not self.trigger.can_merge():
            raise ValueError(
                f"session windows merge, and the trigger {type(self.trigger).__name__} cannot "
                "(its can_merge() is False): give it can_merge() and on_merge(), as Flink requires"
            )
        self.evictor = evictor

    def open(self, runtime_context) -> None:
        super().open(runtime_context)
        pickled = Types.PICKLED_BYTE_ARRAY()
        # (window, state name) -> value; (domain, time) -> {(_FIRE | _CLEANUP, window)}
        self.trigger_state = runtime_context.get_map_state(
            MapStateDescriptor("__trigger_state", pickled, pickled)
        )
        self.trigger_timers = runtime_context.get_map_state(
            MapStateDescriptor("__trigger_timers", pickled, pickled)
        )

    # ---- elements ------------------------------------------------------------------------
    def process_element(self, value, ctx):
        at, watermark = self._times(ctx)
        ts = ctx.timestamp() if ctx.timestamp() is not None else at  # what triggers and evictors see
        windows = self.assigner.assign_windows(value, at)
        out, live = [], False
        for assigned in windows:
            # sessions merge first: a late record joining a live session is not late
            w = self._merge_sessions(assigned, ctx) if self.assigner.merging else assigned
            if (
                self.assigner.event_time
                and w.max_timestamp() != _MAX
                and w.max_timestamp() + self.lateness <= watermark
            ):
                continue  # late beyond the allowed lateness: skipped
            live = True
            key = _key_of(w)
            contents = self.windows.get(key)
            if self.evictor is not None:
                contents = [*(contents or []), (value, ts)]
            else:
                contents = self._add(contents, value)
            self.windows.put(key, contents)
            scope = _TriggerScope(self, key, ctx)
            out += self._act(self.trigger.on_element(value, ts, w, scope), w, key, ctx)
            cleanup = self._cleanup_time(w)
            if cleanup != _MAX:
                scope.register(self._domain(), cleanup, _CLEANUP)
        if not live and windows and self.late_tag is not None:
            out.append(((self.late_tag, value), ts))
        return out

    def _merge_sessions(self, window: TimeWindow, ctx) -> TimeWindow:
        """The session that ``window`` makes with the key's sessions it overlaps (Flink's
        MergingWindowSet.addWindow and WindowOperator's merge function)."""
        absorbed = [k for k in list(self.windows.keys()) if window.intersects(_window_of(k))]
        merged = window
        for k in absorbed:
            merged = merged.cover(_window_of(k))
        key = _key_of(merged)
        if not absorbed or absorbed == [key]:
            return merged  # a new session, or one inside an existing session: nothing merges
        self.trigger.on_merge(merged, _TriggerScope(self, key, ctx, merging=absorbed))
        contents = None
        for k in absorbed:
            old = _TriggerScope(self, k, ctx)
            self.trigger.clear(_window_of(k), old)
            cleanup = self._cleanup_time(_window_of(k))
            if cleanup != _MAX:
                old.unregister(self._domain(), cleanup, _CLEANUP)
            part = self.windows.get(k)
            if part is not None:
                contents = part if contents is None else self._merge_contents(contents, part)
            self.windows.remove(k)
        self.windows.put(key, contents)  # None: every absorbed session had been purged
        return merged

    def _merge_contents(self, a, b):
        return a + b if self.evictor is not None else self._merge(a, b)

    def _domain(self) -> str:
        return _EVENT if self.assigner.event_time else _PROCESSING

    def _cleanup_time(self, w) -> int:
        if w.max_timestamp() == _MAX:
            return _MAX
        return w.max_timestamp() + (self.lateness if self.assigner.event_time else 0)

    def _act(self, result, w, key, ctx) -> list:
        """What a TriggerResult says to do with the window's pane."""
        out = []
        if result.is_fire():
            contents = self.windows.get(key)
            if contents is not None:
                out = self._emit(ctx.get_current_key(), w, key, contents, ctx)
        if result.is_purge():
            if self.assigner.merging:
                self.windows.put(key, None)  # the session stays (empty) until its cleanup
            else:
                self.windows.remove(key)
        return out

    def _emit(self, k, w, key, contents, ctx) -> list:
        if self.evictor is None:
            return self._results(k, w, contents, ctx)
        elements = [TimestampedValue(v, t) for v, t in contents]
        scope = _TriggerScope(self, key, ctx)
        self.evictor.evict_before(elements, len(elements), w, scope)
        folded = None
        if self.mode == "list":
            folded = [e.value for e in elements]
        else:
            for e in elements:
                folded = self._add(folded, e.value)
        out = self._results(k, w, folded, ctx) if folded is not None else []
        self.evictor.evict_after(elements, len(elements), w, scope)
        self.windows.put(key, [(e.value, e.timestamp) for e in elements])
        return out

    # ---- timers --------------------------------------------------------------------------
    def on_timer(self, timestamp: int, ctx):
        domain = _EVENT if ctx.time_domain() == TimeDomain.EVENT_TIME else _PROCESSING
        entries = self.trigger_timers.get((domain, timestamp)) or set()
        self.trigger_timers.remove((domain, timestamp))
        out = []
        for what, key in sorted(entries):
            w = _window_of(key)
            if self.assigner.merging and not self.windows.contains(key):
                continue  # a session merged away (Flink: no state window any more)
            scope = _TriggerScope(self, key, ctx)
            if what == _FIRE:
                if domain == _EVENT:
                    result = self.trigger.on_event_time(timestamp, w, scope)
                else:
                    result = self.trigger.on_processing_time(timestamp, w, scope)
                out += self._act(result, w, key, ctx)
            else:  # the window's lateness is over: it goes, with its trigger's state
                self.windows.remove(key)
                self.trigger.clear(w, scope)
                for state_key in [s for s in list(self.trigger_state.keys()) if s[0] == key]:
                    self.trigger_state.remove(state_key)
                if isinstance(self.window_fn, ProcessWindowFunction):
                    self.window_fn.clear(_WindowContext(self, w, ctx))
        return out


class _TriggerScope(Trigger.OnMergeContext, Evictor.EvictorContext):
    """A trigger's (and evictor's) view of one key and window: timers and partitioned state;
    ``merging``: the windows merged into this one, whose state ``merge_partitioned_state`` takes."""

    def __init__(self, op: TriggeredWindowOperator, window_key: tuple, ctx, merging: list | None = None):
        self.op, self.key, self.timers = op, window_key, ctx.timer_service()
        self.merging = merging or []

    def get_current_processing_time(self) -> int:
        return self.timers.current_processing_time()

    def get_current_watermark(self) -> int:
        return self.timers.current_watermark()

    def register(self, domain: str, time: int, what: int = _FIRE) -> None:
        entries = self.op.trigger_timers.get((domain, time)) or set()
        if (what, self.key) in entries:
            return
        entries.add((what, self.key))
        self.op.trigger_timers.put((domain, time), entries)
        if domain == _EVENT:
            self.timers.register_event_time_timer(time)
        else:
            self.timers.register_processing_time_timer(time)

    def unregister(self, domain: str, time: int, what: int = _FIRE) -> None:
        entries = self.op.trigger_timers.get((domain, time))
        if not entries or (what, self.key) not in entries:
            return
        entries.discard((what, self.key))
        if entries:
            self.op.trigger_timers.put((domain, time), entries)
            return
        self.op.trigger_timers.remove((domain, time))
        if domain == _EVENT:
            self.timers.delete_event_time_timer(time)
        else:
            self.timers.delete_processing_time_timer(time)

    def register_event_time_timer(self, time: int) -> None:
        self.register(_EVENT, time)

    def register_processing_time_timer(self, time: int) -> None:
        self.register(_PROCESSING, time)

    def delete_event_time_timer(self, time: int) -> None:
        self.unregister(_EVENT, time)

    def delete_processing_time_timer(self, time: int) -> None:
        self.unregister(_PROCESSING, time)

    def get_partitioned_state(self, state_descriptor):
        return _WindowState(self.op.trigger_state, (self.key, state_descriptor.name), state_descriptor)

    def merge_partitioned_state(self, state_descriptor) -> None:
        """Move the merged windows' state of ``state_descriptor`` into this window's."""
        if state_descriptor.kind not in ("reducing", "aggregating", "list"):
            raise ValueError(
                f"a trigger can merge reducing, aggregating and list state, not {state_descriptor.kind} state"
            )
        states, target = (
            self.op.trigger_state,
            _WindowState(self.op.trigger_state, (self.key, state_descriptor.name), state_descriptor),
        )
        for k in self.merging:
            source = (k, state_descriptor.name)
            stored = states.get(source)
            if stored is None or k == self.key:
                continue
            states.remove(source)
            target.merge(stored)


class _WindowState:
    """A trigger's state of one window: value, reducing, list or aggregating, by its descriptor."""

    def __init__(self, states, key: tuple, descriptor):
        self.states, self.key, self.descriptor = states, key, descriptor

    def value(self):
        return self.states.get(self.key)

    def update(self, value) -> None:
        self.states.put(self.key, value)

    def get(self):
        stored = self.states.get(self.key)
        if self.descriptor.kind == "aggregating" and stored is not None:
            return self.descriptor.agg_function.get_result(stored)
        return stored

    def add(self, value) -> None:
        kind, stored = self.descriptor.kind, self.states.get(self.key)
        if kind == "reducing":
            new = value if stored is None else _call(self.descriptor.reduce_function, "reduce")(stored, value)
        elif kind == "aggregating":
            fn = self.descriptor.agg_function
            new = fn.add(value, fn.create_accumulator() if stored is None else stored)
        else:
            new = [*(stored or []), value]
        self.states.put(self.key, new)

    def merge(self, stored) -> None:
        """Fold another window's stored value of the same state into this one."""
        kind, mine = self.descriptor.kind, self.states.get(self.key)
        if mine is None:
            new = stored
        elif kind == "reducing":
            new = _call(self.descriptor.reduce_function, "reduce")(mine, stored)
        elif kind == "aggregating":
            new = self.descriptor.agg_function.merge(mine, stored)
        else:
            new = [*mine, *stored]
        self.states.put(self.key, new)

    def clear(self) -> None:
        self.states.remove(self.key)
