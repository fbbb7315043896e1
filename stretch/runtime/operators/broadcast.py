"""The broadcast process operator: a (Keyed)BroadcastProcessFunction over one tagged gate.

Both inputs come through the operator's one gate, as a connected stream's do: ``(0, element)``
keyed by the element's key (a non-keyed input: round robin, as the band join spreads its
elements) and ``(1, broadcast element)`` keyed by ``BROADCAST_KEY``, which marks it. Every
instance reads every record of the gate; it processes the elements of the key groups it owns, as
any keyed operator does. The broadcast state is one copy in shared memory, versioned by gate
position (``stretch.runtime.broadcast_board``): the first instance to reach a run of broadcast
elements applies them, once, and emits what they yield; the others read the version it
published. So an element sees exactly the broadcast elements before it in the gate, whichever
instance processes it, at any parallelism and after any rescale or restore. Each instance keeps
the version it is at unpickled, to read it fast; the owner of ``SAVER_GROUP`` saves it with each
checkpoint.
"""

from __future__ import annotations

import pickle
import time
from itertools import pairwise

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stretch.contracts.functions import BroadcastProcessFunction, KeyedBroadcastProcessFunction
from stretch.contracts.state import BroadcastState, MapStateDescriptor, ReadOnlyBroadcastState
from stretch.plan.specs import BroadcastSpec
from stretch.runtime.batch import CANONICAL_META, KEY_COLUMN, Records, split_outputs
from stretch.runtime.broadcast_board import tag_of
from stretch.runtime.operators.context import InstanceRuntimeContext
from stretch.runtime.operators.process import ProcessOperator
from stretch.runtime.outputs import NO_KEY, StepError
from stretch.state.key_codec import encode_key

BROADCAST_KEY = ("__stretch broadcast element__",)  # the key that marks a broadcast element
SAVER_GROUP = 0  # its owner saves the broadcast state with each checkpoint
_CANONICAL = next(iter(CANONICAL_META.items()))


class _ReadOnlyView(ReadOnlyBroadcastState):
    """A broadcast state as process_element sees it: reads only."""

    __slots__ = ("_map", "_name")

    def __init__(self, name: str, mapping: dict):
        self._name, self._map = name, mapping

    def get(self, key):
        return self._map.get(key)

    def contains(self, key) -> bool:
        return key in self._map

    def items(self):
        return list(self._map.items())

    def keys(self):
        return list(self._map)

    def values(self):
        return list(self._map.values())

    def is_empty(self) -> bool:
        return not self._map

    def _refuse(self, *args) -> None:
        raise RuntimeError(
            f"broadcast state {self._name!r} is read-only here: only process_broadcast_element "
            "may change it (so that every instance's copy stays the same), as in Flink"
        )

    put = put_all = remove = clear = __setitem__ = __delitem__ = _refuse


class _View(_ReadOnlyView, BroadcastState):
    """A broadcast state as process_broadcast_element sees it: reads and writes."""

    __slots__ = ()

    def put(self, key, value) -> None:
        self._map[key] = value

    def put_all(self, dict_value) -> None:
        self._map.update(dict_value)

    def remove(self, key) -> None:
        self._map.pop(key, None)

    def clear(self) -> None:
        self._map.clear()

    def __setitem__(self, key, value):
        self.put(key, value)

    def __delitem__(self, key):
        self.remove(key)


class _Time:
    """What every context of a broadcast function tells: the record's timestamp and the clocks."""

    ts = None
    op: BroadcastProcessOperator

    def timestamp(self):
        return self.ts

    def current_processing_time(self) -> int:
        return time.time_ns() // 1_000_000

    def current_watermark(self) -> int:
        return self.op.watermark


class _BroadcastContext(_Time, BroadcastProcessFunction.Context, KeyedBroadcastProcessFunction.Context):
    """The ``ctx`` of process_broadcast_element: the broadcast states, writable."""

    def __init__(self, op: BroadcastProcessOperator):
        self.op = op

    def get_broadcast_state(self, state_descriptor) -> BroadcastState:
        name = self.op.state_name(state_descriptor)
        return _View(name, self.op.states[name])


class _ElementContext(_Time, BroadcastProcessFunction.ReadOnlyContext):
    """The ``ctx`` of a non-keyed process_element: the broadcast states, read-only."""

    def __init__(self, op: BroadcastProcessOperator):
        self.op = op

    def get_broadcast_state(self, state_descriptor) -> ReadOnlyBroadcastState:
        name = self.op.state_name(state_descriptor)
        return _ReadOnlyView(name, self.op.states[name])


class _KeyedElementContext(_ElementContext, KeyedBroadcastProcessFunction.OnTimerContext):
    """The ``ctx`` of a keyed process_element and of on_timer: also the key, its timers and
    (on_timer) the time domain, from the keyed operator's own context (``inner``)."""

    inner = None

    def timestamp(self):
        return self.inner.ts

    def timer_service(self):
        return self.inner.timer_service()

    def get_current_key(self):
        return self.inner.get_current_key()

    def time_domain(self):
        return self.inner.time_domain()


class _KeyedSide:
    """What the keyed process operator calls: the keyed input's elements (``(0, element)``) and
    the timers, handed to the user's function with a broadcast-aware context."""

    what = "process_element"  # named in errors

    def __init__(self, op: BroadcastProcessOperator):
        self.user = op.user
        self.ctx = _KeyedElementContext(op)

    def process_element(self, value, ctx):
        self.ctx.inner = ctx
        return self.user.process_element(value[1], self.ctx)

    def on_timer(self, timestamp: int, ctx):
        self.ctx.inner = ctx
        return self.user.on_timer(timestamp, self.ctx)


class BroadcastProcessOperator(ProcessOperator):
    """Sees the whole batch (``process_owned``): its own elements, and every broadcast element."""

    def __init__(self, spec, name, table):
        super().__init__(spec, name, table)
        bspec: BroadcastSpec = spec.fn
        self.user = bspec.function
        self.keyed = bspec.keyed
        self.descriptors = [d.get_name() for d in bspec.descriptors]
        self.states: dict[str, dict] = {n: {} for n in self.descriptors}
        self.fn = _KeyedSide(self)  # what ProcessOperator.process and fire call
        self.broadcast_ctx = _BroadcastContext(self)
        self.element_ctx = _ElementContext(self)
        self._mark = pa.scalar(encode_key(BROADCAST_KEY), pa.large_binary())
        self.board = None  # the shared versions (runtime.broadcast_board), bound by the task
        self.position = 0  # the gate position of the entry being processed
        self._slowest = self._waiting = None

    def bind(self, board, slowest, waiting) -> None:
        """The task's board, the slowest reader's gate position (a callable), and what to call
        while a version waits for a free slot (it raises when the task is told to stop)."""
        self.board, self._slowest, self._waiting = board, slowest, waiting

    def open(self, runtime_context) -> None:
        if not self.keyed:  # keyed state is for keyed functions only, as in Flink
            rc = runtime_context
            runtime_context = InstanceRuntimeContext(
                rc.get_task_name(),
                rc._index,
                rc._parallelism,
                rc._max_parallelism,
                metrics=rc.get_metrics_group(),
                job_parameters=rc._job_parameters,
            )
        self.user.open(runtime_context)

    def close(self) -> None:
        self.user.close()

    def state_name(self, descriptor) -> str:
        if not isinstance(descriptor, MapStateDescriptor):
            raise TypeError(f"get_broadcast_state needs a MapStateDescriptor, got {descriptor!r}")
        name = descriptor.get_name()
        if name not in self.states:
            raise ValueError(
                f"operator {self.name!r} has no broadcast state {name!r}; the stream was broadcast "
                f"with {self.descriptors}"
            )
        return name

    # ---- the state's copies: saved at checkpoints, handed to added instances ------------------
    def broadcast_bytes(self) -> bytes:
        return cloudpickle.dumps(self.states)

    def load_broadcast(self, data: bytes | None) -> None:
        """Replace this copy (in place: views the function holds stay valid)."""
        loaded = pickle.loads(data) if data else {}
        for name, mapping in self.states.items():
            mapping.clear()
            mapping.update(loaded.get(name, {}))

    # ---- records -----------------------------------------------------------------------------
    def process_owned(self, batch: pa.RecordBatch, kgs: np.ndarray, owners: np.ndarray, me: int):
        marks = self._marks(batch)
        if marks is None:
            runs = [(0, batch.num_rows, False)]
        else:
            bounds = [0, *(np.flatnonzero(np.diff(marks.astype(np.int8))) + 1).tolist(), len(marks)]
            runs = [(a, b, bool(marks[a])) for a, b in pairwise(bounds)]
        outs = []
        rows_in = 0
        for run, (start, stop, broadcast) in enumerate(runs):
            part = batch if stop - start == batch.num_rows else batch.slice(start, stop - start)
            if broadcast:
                outs.append(self._broadcast(part, tag_of(self.position, run)))
                rows_in += stop - start
                continue
            part_kgs = kgs[start:stop]
            mine = owners[part_kgs] == me
            n = int(np.count_nonzero(mine))
            if not n:
                continue
            if n != len(part_kgs):
                sel = np.flatnonzero(mine)
                part, part_kgs = part.take(sel), part_kgs[sel]
            outs.append(self.process(part, part_kgs) if self.keyed else self._elements(part))
            rows_in += n
        self.rows_in = rows_in
        return [o for o in outs if o is not None] or None

    def _marks(self, batch: pa.RecordBatch) -> np.ndarray | None:
        """Which rows are broadcast elements (None: none is). Their key is stored canonically."""
        i = batch.schema.get_field_index(KEY_COLUMN)
        if i < 0 or (batch.schema.field(i).metadata or {}).get(_CANONICAL[0]) != _CANONICAL[1]:
            return None
        marks = pc.equal(batch.column(i), self._mark).to_numpy(zero_copy_only=False)
        return marks if marks.any() else None

    def _broadcast(self, batch: pa.RecordBatch, tag: int) -> Records | None:
        """The first instance to reach a run of broadcast elements applies them (and emits what
        they yield) and publishes the new version; the others read that version."""
        board = self.board
        data = board.version(tag)
        if data is None:
            board.lock()
            try:
                data = board.version(tag)
                if data is None:
                    out = self._each(batch, self.user.process_broadcast_element, self.broadcast_ctx, True)
                    board.publish(tag, self.broadcast_bytes(), self._slowest(), self._waiting)
                    return out
            finally:
                board.unlock()
        self.load_broadcast(data)
        return None

    def _elements(self, batch: pa.RecordBatch) -> Records | None:
        """A non-keyed input's elements that this instance owns (no keyed state, no timers)."""
        return self._each(batch, self.user.process_element, self.element_ctx, False)

    def _each(self, batch, call, ctx, broadcast: bool) -> Records | None:
        records = Records(batch=batch)
        ts = records.timestamps()
        stamps = ts.tolist() if ts is not None else [None] * len(batch)
        what = "process_broadcast_element" if broadcast else "process_element"
        out: list = []
        out_ts: list = []
        for (_, value), ctx.ts in zip(records.items(), stamps):
            try:
                res = call(value, ctx)
                produced = list(res) if res is not None else []  # a generator runs here
            except Exception as e:
                err = StepError(self.name, value, NO_KEY, e, what)
                err.__cause__ = e
                self.dead_letter(err)  # raises unless the job's policy is dead letters
                continue
            out.extend(produced)
            out_ts.extend([ctx.ts] * len(produced))
        if not out:
            return None
        return split_outputs(out, out_ts if ts is not None else None, False, self.spec.output_type, self.name)
