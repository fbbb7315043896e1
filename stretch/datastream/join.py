"""Joins of two streams: Flink's window join, co-group and interval join, and a band join.

Each is built from what the engine already has, as Flink builds its own: both inputs are tagged
``(0, left)`` / ``(1, right)`` and unioned into one stream, keyed by the key selector of the
element's side. The window join and co-group then window that stream (the list window operator)
and pair up each window's tagged elements; the interval join is a KeyedProcessFunction with
Flink's IntervalJoinOperator rules. Their buffers are ordinary keyed state and timers, so they
follow their key groups through live rescales. The band join has no key: see ``BandJoinedStreams``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stretch.common.typeinfo import Types
from stretch.common.wording import a
from stretch.contracts.functions import (
    CoGroupFunction,
    Function,
    JoinFunction,
    KeyedProcessFunction,
    KeySelector,
    ProcessJoinFunction,
    WindowFunction,
)
from stretch.contracts.state import MapStateDescriptor
from stretch.contracts.window import (
    CountSlidingWindowAssigner,
    CountTumblingWindowAssigner,
    WindowAssigner,
    to_millis,
)
from stretch.datastream.two_inputs import LEFT, RIGHT, UnionKey, selector_of, union_tagged
from stretch.datastream.wrapping import Wrapping, replaced
from stretch.plan.specs import BandJoinSpec

if TYPE_CHECKING:
    from stretch.datastream.data_stream import DataStream, KeyedStream

_MIN = -(2**63)


def _check_selector(selector, what: str):
    if isinstance(selector, (KeySelector, str, int)) and not isinstance(selector, bool):
        return selector
    if callable(selector):
        return selector
    raise TypeError(f"{what} needs a KeySelector, a callable or a field, got {selector!r}")


def _method(fn, name: str):
    return getattr(fn, name) if isinstance(fn, Function) else fn


# ---- window join and co-group ---------------------------------------------------------------
class _PairUp(Wrapping, WindowFunction):
    """The window function of a join (every left with every right) or co-group (both lists)."""

    callables = True

    def __init__(self, fn, kind: str):
        super().__init__(fn)
        self.kind = kind

    @property
    def accepts(self) -> tuple:
        return (JoinFunction,) if self.kind == "join" else (CoGroupFunction,)

    def apply(self, key, window, inputs):
        lefts = [v for side, v in inputs if side == LEFT]
        rights = [v for side, v in inputs if side == RIGHT]
        if self.kind == "join":
            join = _method(self.fn, "join")
            return [join(a, b) for a in lefts for b in rights]
        out = _method(self.fn, "co_group")(lefts, rights)
        return [] if out is None else list(out)


class JoinedStreams:
    """``a.join(b).where(ka).equal_to(kb).window(assigner).apply(join_function)``, as in Flink:
    for every key and window, ``join(left, right)`` of each pair of the window's elements."""

    _kind = "join"
    _function = JoinFunction

    def __init__(self, left: DataStream, right: DataStream):
        self._left, self._right = left, right

    def where(self, key_selector, key_type=None) -> Where:
        return Where(self, _check_selector(key_selector, "where"), key_type)


class CoGroupedStreams(JoinedStreams):
    """``a.co_group(b).where(ka).equal_to(kb).window(assigner).apply(co_group_function)``: for
    every key and window that has elements, ``co_group(lefts, rights)`` (either may be empty)."""

    _kind = "co_group"
    _function = CoGroupFunction


class Where:
    def __init__(self, streams: JoinedStreams, key_selector, key_type):
        self._streams, self._key, self._key_type = streams, key_selector, key_type

    def equal_to(self, key_selector) -> EqualTo:
        return EqualTo(self, _check_selector(key_selector, "equal_to"))


class EqualTo:
    def __init__(self, where: Where, key_selector):
        self._where, self._key = where, key_selector

    def window(self, window_assigner) -> WithWindow:

        if not isinstance(window_assigner, WindowAssigner) or isinstance(
            window_assigner, (CountTumblingWindowAssigner, CountSlidingWindowAssigner)
        ):
            raise TypeError(f"a join needs a time window assigner, got {window_assigner!r}")
        return WithWindow(self, window_assigner)


class WithWindow:
    def __init__(self, equal_to: EqualTo, assigner):
        self._equal_to, self._assigner = equal_to, assigner
        self._lateness = 0

    def allowed_lateness(self, time_ms) -> WithWindow:
        """Keep windows this long after the watermark passed them; late elements re-fire them."""

        self._lateness = to_millis(time_ms, "allowed lateness")
        return self

    def apply(self, function, output_type=None) -> DataStream:
        where = self._equal_to._where
        streams = where._streams
        if not (isinstance(function, streams._function) or callable(function)):
            raise TypeError(f"apply needs {a(streams._function.__name__)} or a callable, got {function!r}")
        keyed = union_tagged(streams._left, streams._right).key_by(
            UnionKey(where._key, self._equal_to._key), where._key_type
        )
        windowed = keyed.window(self._assigner)
        if self._lateness:
            windowed.allowed_lateness(self._lateness)
        name = "Window Join" if streams._kind == "join" else "Window CoGroup"
        return windowed.apply(_PairUp(function, streams._kind), output_type).name(name)


# ---- interval join ----------------------------------------------------------------------------
class IntervalJoin:
    """``a.key_by(ka).interval_join(b.key_by(kb))``; ``between`` gives the time bounds."""

    def __init__(self, left: KeyedStream, right: KeyedStream):
        self._left, self._right = left, right

    def between(self, lower_bound, upper_bound) -> IntervalJoined:
        """Join a left element at t with right elements at t + lower .. t + upper (inclusive)."""

        lower, upper = to_millis(lower_bound, "lower bound"), to_millis(upper_bound, "upper bound")
        if lower > upper:
            raise ValueError(f"lower bound {lower} must be <= upper bound {upper}")
        return IntervalJoined(self._left, self._right, lower, upper)


class IntervalJoined:
    """An interval join with its bounds set: choose exclusive bounds and late-data outputs, then
    ``process``."""

    def __init__(self, left: KeyedStream, right: KeyedStream, lower: int, upper: int):
        self._left, self._right = left, right
        self._lower, self._upper = lower, upper
        self._lower_inclusive = self._upper_inclusive = True
        self._late_tags: list = [None, None]

    def lower_bound_exclusive(self) -> IntervalJoined:
        self._lower_inclusive = False
        return self

    def upper_bound_exclusive(self) -> IntervalJoined:
        self._upper_inclusive = False
        return self

    def side_output_left_late_data(self, output_tag) -> IntervalJoined:
        """Left elements dropped as late (timestamp below the watermark) go to this side output."""
        self._late_tags[LEFT] = output_tag
        return self

    def side_output_right_late_data(self, output_tag) -> IntervalJoined:
        self._late_tags[RIGHT] = output_tag
        return self

    def process(self, process_join_function, output_type=None) -> DataStream:
        if not (isinstance(process_join_function, ProcessJoinFunction) or callable(process_join_function)):
            raise TypeError("process needs a ProcessJoinFunction (or a callable(left, right, ctx))")
        # Flink moves exclusive bounds inwards by 1 ms so that the rest only knows inclusive ones
        lower = self._lower if self._lower_inclusive else self._lower + 1
        upper = self._upper if self._upper_inclusive else self._upper - 1
        op = IntervalJoinOperator(process_join_function, lower, upper, tuple(self._late_tags))
        key_type = self._left._t.spec.get("key_type")
        keyed = union_tagged(self._left, self._right).key_by(
            UnionKey(selector_of(self._left), selector_of(self._right)), key_type
        )
        return keyed.process(op, output_type).name("IntervalJoin")


class _JoinContext(ProcessJoinFunction.Context):
    __slots__ = ("left", "out", "right")

    def __init__(self):
        self.left = self.right = _MIN
        self.out: list = []

    def get_left_timestamp(self) -> int:
        return self.left

    def get_right_timestamp(self) -> int:
        return self.right

    def get_timestamp(self) -> int:
        return max(self.left, self.right)

    def output(self, output_tag, value) -> None:
        self.out.append(((output_tag, value), self.get_timestamp()))


class IntervalJoinOperator(KeyedProcessFunction):
    """Flink's IntervalJoinOperator over the tagged union, with bounds already made inclusive.

    Each side's elements wait in a MapState (timestamp -> elements) until a cleanup timer at the
    last watermark that could still bring a partner; elements below the watermark are late and
    dropped (or side-output). Flink keeps the two sides' timers in two namespaces; here both
    share the key's timers, and a timer at T clears both buckets that a T cleans up, which is
    the same: every element of such a bucket registered exactly T.
    """

    emits_timestamps = True

    def __init__(self, fn, lower: int, upper: int, late_tags=(None, None)):
        self.fn, self.lower, self.upper, self.late_tags = fn, lower, upper, late_tags

    def _with_user_function(self, new) -> IntervalJoinOperator:
        return replaced(self, "fn", new, (ProcessJoinFunction,), callables=False)

    def open(self, runtime_context) -> None:
        buffer = Types.PICKLED_BYTE_ARRAY()
        self.buffers = (
            runtime_context.get_map_state(MapStateDescriptor("__join_left", Types.LONG(), buffer)),
            runtime_context.get_map_state(MapStateDescriptor("__join_right", Types.LONG(), buffer)),
        )
        self.ctx = _JoinContext()
        self.call = _method(self.fn, "process_element")
        if isinstance(self.fn, Function):
            self.fn.open(runtime_context)

    def close(self) -> None:
        if isinstance(self.fn, Function):
            self.fn.close()

    def process_element(self, value, ctx):
        side, element = value
        ts = ctx.timestamp()
        if ts is None:
            raise ValueError(
                "an interval join needs record timestamps: use assign_timestamps_and_watermarks "
                "or from_source with a WatermarkStrategy that has a timestamp assigner"
            )
        watermark = ctx.timer_service().current_watermark()
        if watermark != _MIN and ts < watermark:  # Flink's isLate
            tag = self.late_tags[side]
            return [((tag, element), ts)] if tag is not None else []
        ours, other = self.buffers[side], self.buffers[1 - side]
        lo, hi = (self.lower, self.upper) if side == LEFT else (-self.upper, -self.lower)
        bucket = ours.get(ts)
        ours.put(ts, [*bucket, element] if bucket else [element])
        out: list = []
        for t, partners in other.items():
            if ts + lo <= t <= ts + hi:
                for p in partners:
                    if side == LEFT:
                        self._collect(element, p, ts, t, out)
                    else:
                        self._collect(p, element, t, ts, out)
        ctx.timer_service().register_event_time_timer(ts + hi if hi > 0 else ts)
        return out

    def _collect(self, left, right, left_ts: int, right_ts: int, out: list) -> None:
        c = self.ctx
        c.left, c.right, c.out = left_ts, right_ts, out
        result = self.call(left, right, c)
        if result is not None:
            ts = max(left_ts, right_ts)
            out.extend((v, ts) for v in result)

    def on_timer(self, timestamp: int, ctx):
        left, right = self.buffers
        left.remove(timestamp - self.upper if self.upper > 0 else timestamp)
        right.remove(timestamp + self.lower if self.lower <= 0 else timestamp)


# ---- band join --------------------------------------------------------------------------------
class _RoundRobin(KeySelector):
    """A per-producer counter as the "key": consecutive elements go to consecutive key groups.

    Each producer process starts at a random point (its copy is unpickled per process), so that
    producers do not all begin at key group 0; where an element is stored never changes results.
    """

    def __init__(self):
        self.next = None

    def get_key(self, value):
        n = self.next
        if n is None:
            import os

            n = int.from_bytes(os.urandom(4), "little")
        self.next = n + 1
        return n


class BandJoinedStreams:
    """``a.band_join(b).on(predicate).within(bound).apply(join_function)``: a non-equi join.

    Every left/right pair with ``|t_left - t_right| <= bound`` for which ``predicate(left,
    right)`` holds is joined exactly once (output timestamp: the later of the two), except pairs
    with an element that was late on arrival (timestamp below the watermark), which is dropped as
    in the interval join. Elements are not keyed: each is stored in one key group chosen round
    robin and probed by every instance (see ``stretch.runtime.operators.band_join``).
    """

    def __init__(self, left: DataStream, right: DataStream):
        self._left, self._right = left, right
        self._predicate = None
        self._bound: int | None = None

    def on(self, predicate) -> BandJoinedStreams:
        """Which pairs within the bound join: ``predicate(left, right) -> bool``."""
        if not callable(predicate):
            raise TypeError(f"on() needs a callable(left, right) -> bool, got {predicate!r}")
        self._predicate = predicate
        return self

    def within(self, bound) -> BandJoinedStreams:
        """The time band: pairs at most ``bound`` (ms or Time) apart join."""

        self._bound = to_millis(bound, "band")
        if self._bound < 0:
            raise ValueError("the band must not be negative")
        return self

    def apply(self, join_function, output_type=None) -> DataStream:
        if self._bound is None:
            raise ValueError("say how far apart joined elements may be: band_join(...).within(ms)")
        if not (isinstance(join_function, JoinFunction) or callable(join_function)):
            raise TypeError(f"apply needs a JoinFunction or a callable, got {join_function!r}")
        keyed = union_tagged(self._left, self._right).key_by(_RoundRobin())
        spec = BandJoinSpec(self._bound, self._predicate, join_function)
        return keyed._keyed("band_join", "BandJoin", {"fn": spec}, output_type)
