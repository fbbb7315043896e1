"""The window operator, built on keyed state and timers (Flink's WindowOperator semantics).

Each key's windows and their contents (a reduced value, an accumulator, or the elements) are
keyed state; a timer at the window's ``max_timestamp()`` fires it, and with allowed lateness a
second timer cleans it up. Because it is ordinary keyed state and timers, windows follow their key
group through live rescales like everything else.

It yields ``(value, timestamp)`` pairs (results carry the window's ``max_timestamp()``, as in
Flink), which the keyed operator unwraps for functions that set ``emits_timestamps``.
"""

from __future__ import annotations

import time

from stretch.common.typeinfo import Types
from stretch.contracts.functions import (
    AggregateFunction,
    Function,
    KeyedProcessFunction,
    ProcessWindowFunction,
    ReduceFunction,
    TimeDomain,
    WindowFunction,
)
from stretch.contracts.state import MapStateDescriptor, ValueStateDescriptor
from stretch.contracts.window import (
    CountSlidingWindowAssigner,
    CountTumblingWindowAssigner,
    CountWindow,
    TimeWindow,
    WindowAssigner,
)
from stretch.datastream.wrapping import replaced
from stretch.errors import UpdateRefused

_MAX = 2**63 - 1


class _WindowContext(ProcessWindowFunction.Context):
    def __init__(self, operator: WindowOperator, window, ctx):
        self._op, self._window, self._ctx = operator, window, ctx

    def window(self):
        return self._window

    def current_processing_time(self) -> int:
        return time.time_ns() // 1_000_000

    def current_watermark(self) -> int:
        return self._ctx.timer_service().current_watermark()

    def global_state(self):
        return self._op.runtime_context


class WindowOperator(KeyedProcessFunction):
    """Windows of one keyed stream: assignment, lateness, firing, purging, session merging.

    ``mode`` says what a window holds: "reduce" (the reduced value), "aggregate" (an
    AggregateFunction's accumulator) or "list" (the elements, for process/apply).
    """

    emits_timestamps = True

    def __init__(
        self,
        assigner: WindowAssigner,
        mode: str,
        fn,
        window_fn=None,
        allowed_lateness: int = 0,
        late_tag=None,
    ):
        self.assigner = assigner
        self.mode = mode
        self.fn = fn
        self.window_fn = window_fn
        self.lateness = allowed_lateness
        self.late_tag = late_tag
        self.counting = isinstance(assigner, (CountTumblingWindowAssigner, CountSlidingWindowAssigner))

    def _with_user_function(self, new) -> WindowOperator:
        """A live update: the windows' reduce or aggregate function, or their window function
        (a join's or co-group's pairing function, for window joins)."""
        pairing = getattr(self.window_fn, "_with_user_function", None)
        if pairing is not None and not isinstance(new, (ReduceFunction, AggregateFunction)):
            return replaced(self, "window_fn", pairing(new), (object,))
        if isinstance(new, (WindowFunction, ProcessWindowFunction)) and (
            self.window_fn or self.mode == "list"
        ):
            return replaced(self, "window_fn", new, (WindowFunction, ProcessWindowFunction), callables=False)
        if type(self.fn).__module__.startswith("stretch."):  # built-in aggregates: no user function
            raise UpdateRefused("built-in window aggregates have no user function to update")
        kinds = {"reduce": (ReduceFunction,), "aggregate": (AggregateFunction,)}.get(self.mode, ())
        return replaced(self, "fn", new, kinds or (WindowFunction, ProcessWindowFunction), callables=False)

    # ---- life cycle ----------------------------------------------------------------------
    def open(self, runtime_context) -> None:
        self.runtime_context = runtime_context
        self.windows = runtime_context.get_map_state(
            MapStateDescriptor("__windows", Types.PICKLED_BYTE_ARRAY(), Types.PICKLED_BYTE_ARRAY())
        )
        if self.counting:
            self.count = runtime_context.get_state(ValueStateDescriptor("__window_count", Types.LONG()))
        for f in (self.fn, self.window_fn):
            if isinstance(f, Function):
                f.open(runtime_context)

    def close(self) -> None:
        for f in (self.fn, self.window_fn):
            if isinstance(f, Function):
                f.close()

    # ---- contents ------------------------------------------------------------------------
    def _add(self, contents, value):
        if self.mode == "reduce":
            return value if contents is None else _call(self.fn, "reduce")(contents, value)
        if self.mode == "aggregate":
            acc = self.fn.create_accumulator() if contents is None else contents
            return self.fn.add(value, acc)
        return [value] if contents is None else [*contents, value]

    def _merge(self, a, b):
        if self.mode == "reduce":
            return _call(self.fn, "reduce")(a, b)
        if self.mode == "aggregate":
            return self.fn.merge(a, b)
        return a + b

    def _results(self, key, window, contents, ctx):
        """The outputs of a window firing, each with the window's max timestamp."""
        if self.mode == "reduce":
            inputs = [contents]
        elif self.mode == "aggregate":
            inputs = [self.fn.get_result(contents)]
        else:
            inputs = contents
        ts = window.max_timestamp()
        fn = self.window_fn
        if fn is None:
            out = inputs
        elif isinstance(fn, ProcessWindowFunction):
            out = fn.process(key, _WindowContext(self, window, ctx), inputs)
        else:
            out = _call(fn, "apply")(key, window, inputs)
        return [(v, ts) for v in (out or [])]

    # ---- elements ------------------------------------------------------------------------
    def process_element(self, value, ctx):
        if self.counting:
            return self._count_element(value, ctx)
        timers = ctx.timer_service()
        ts, watermark = self._times(ctx)
        windows = self.assigner.assign_windows(value, ts)
        out = []
        live = False
        for assigned in windows:
            w, key = assigned, (assigned.start, assigned.end)
            if self.assigner.merging:  # Flink merges first: a late record joining a live session is not late
                w, key = self._merge_into_sessions(assigned, timers)
            if self.assigner.event_time and w.max_timestamp() + self.lateness <= watermark:
                continue  # late beyond the allowed lateness: skipped
            live = True
            contents = self._add(self.windows.get(key), value)
            self.windows.put(key, contents)
            if self.assigner.event_time and w.max_timestamp() <= watermark:
                out += self._results(ctx.get_current_key(), w, contents, ctx)  # late but allowed: fire again
            else:
                self._register(timers, w.max_timestamp())
            if self.lateness and self.assigner.event_time:
                self._register(timers, w.max_timestamp() + self.lateness)
        if not live and windows and self.late_tag is not None:
            out.append(((self.late_tag, value), ts))
        return out

    def _times(self, ctx) -> tuple[int, int]:
        """The time that assigns a record's windows (its timestamp, or the wall clock for
        processing-time windows) and the watermark that judges lateness."""
        timers = ctx.timer_service()
        if not self.assigner.event_time:
            return timers.current_processing_time(), -(2**63)
        ts = ctx.timestamp()
        if ts is None:
            raise ValueError(
                "event-time windows need record timestamps: use assign_timestamps_and_watermarks "
                "or from_source with a WatermarkStrategy that has a timestamp assigner"
            )
        return ts, timers.current_watermark()

    def _register(self, timers, ts: int) -> None:
        if self.assigner.event_time:
            timers.register_event_time_timer(ts)
        else:
            timers.register_processing_time_timer(ts)

    def _delete(self, timers, ts: int) -> None:
        if self.assigner.event_time:
            timers.delete_event_time_timer(ts)
        else:
            timers.delete_processing_time_timer(ts)

    def _merge_into_sessions(self, window: TimeWindow, timers):
        """Merge a new session window with the key's overlapping ones (contents and timers)."""
        merged, contents = window, None
        for start, end in list(self.windows.keys()):
            other = TimeWindow(start, end)
            if other.intersects(merged):
                merged = merged.cover(other)
                part = self.windows.get((start, end))
                contents = part if contents is None else self._merge(contents, part)
                self.windows.remove((start, end))
                self._delete_unless_needed(timers, other.max_timestamp())
                if self.lateness and self.assigner.event_time:
                    self._delete_unless_needed(timers, other.max_timestamp() + self.lateness)
        key = (merged.start, merged.end)
        if contents is not None:
            self.windows.put(key, contents)
        return merged, key

    def _delete_unless_needed(self, timers, ts: int) -> None:
        """Delete a merged-away window's timer unless another window of the key fires or ends then.

        Timers are per key and timestamp (not per window, as in Flink), so two windows can share one.
        """
        ends = [end for _, end in self.windows]
        if not any(ts in (end - 1, end - 1 + self.lateness) for end in ends):
            self._delete(timers, ts)

    def _count_element(self, value, ctx):
        n = (self.count.value() or 0) + 1
        a = self.assigner
        if isinstance(a, CountTumblingWindowAssigner):
            contents = self._add(self.windows.get(0), value)
            if n == a.size:
                self.windows.remove(0)
                self.count.clear()
                return self._results(ctx.get_current_key(), CountWindow(0), contents, ctx)
            self.windows.put(0, contents)
            self.count.update(n)
            return []
        # sliding, as PyFlink's CountSlidingWindowAssigner: window i holds the key's records
        # i*slide .. i*slide+size-1 and fires once, when full (never a partial first window)
        elements = ([*self.windows.get(0), value] if self.windows.contains(0) else [value])[-a.size :]
        self.windows.put(0, elements)
        self.count.update(n)
        if n < a.size or (n - a.size) % a.slide:
            return []
        if self.mode == "list":
            contents = elements
        else:
            contents = None
            for e in elements:
                contents = self._add(contents, e)
        return self._results(ctx.get_current_key(), CountWindow((n - a.size) // a.slide), contents, ctx)

    # ---- timers --------------------------------------------------------------------------
    def on_timer(self, timestamp: int, ctx):
        event = ctx.time_domain() == TimeDomain.EVENT_TIME
        out = []
        for start, end in list(self.windows.keys()):
            w = TimeWindow(start, end)
            if w.max_timestamp() == timestamp:
                out += self._results(ctx.get_current_key(), w, self.windows.get((start, end)), ctx)
            cleanup = w.max_timestamp() + (self.lateness if event else 0)
            if cleanup == timestamp:
                self.windows.remove((start, end))
                if isinstance(self.window_fn, ProcessWindowFunction):
                    self.window_fn.clear(_WindowContext(self, w, ctx))
        return out


def _call(fn, method: str):
    """A Function's method, or the function itself if it is a plain callable."""
    return getattr(fn, method, fn)
