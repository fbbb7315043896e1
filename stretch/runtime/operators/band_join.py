"""The band join operator: a non-equi time-band join spread over instances without keys.

ScaleJoin's idea on stretch's shared gate. Every instance reads every record of the gate, but each
buffered element is *stored* in exactly one key group: its producer stamps a running counter
into the record (the ``__key`` column) and the element lives in key group ``counter %
max_parallelism``, so the buffered window is spread evenly, round robin, over key groups and
therefore over instances. Each instance probes every arriving element against the elements stored
in the key groups it owns, then stores the element if it owns the element's key group. Records
are handled in gate order, which every instance shares, so a pair is produced exactly once: by
the owner of the earlier element's key group when the later one arrives. A rescale only changes
which instance owns which key group; the buffers stay where they are in shared memory.

Buffers are a list state per key group (one key per key group: the smallest int that hashes into
it, so the usual key -> key group rule holds). Each instance also keeps the elements of its key
groups decoded and sorted by time, to probe a band by bisection; that copy is dropped for a key
group as soon as ownership of it changes, and shared memory is written at every batch's end.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np
import pyarrow as pa

from stretch.common.typeinfo import Types
from stretch.contracts.functions import Function
from stretch.contracts.state import ListStateDescriptor
from stretch.plan.specs import BandJoinSpec
from stretch.runtime.batch import KEY_COLUMN, Records, split_outputs
from stretch.runtime.event_time import MIN_WATERMARK
from stretch.runtime.operators.base import KeyedOperator
from stretch.runtime.outputs import NO_KEY, StepError
from stretch.state.key_groups import key_groups_of
from stretch.state.keyed_table import KeyMode
from stretch.state.timers import EVENT

BUFFER_STATE = "band join buffer"


def representatives(max_parallelism: int) -> np.ndarray:
    """For each key group, the smallest non-negative int key whose key group it is."""
    n = 4 * max_parallelism
    while True:
        kgs = key_groups_of(np.arange(n, dtype=np.int64), max_parallelism)
        found, first = np.unique(kgs, return_index=True)
        if len(found) == max_parallelism:
            return first.astype(np.int64)
        n *= 2


class BandJoinOperator(KeyedOperator):
    """Sees the whole batch (``process_owned``): probes every record, stores the ones it owns."""

    def __init__(self, spec, name, table):
        self._cache: dict[int, list] = {}  # owned key group -> [(side, ts, value)], as stored
        self._sorted: tuple[list, list] = ([], [])  # per side: (ts, seq, value, kg), by time
        self._resort = False
        super().__init__(spec, name, table)
        self.band: BandJoinSpec = spec.fn
        self.keys = representatives(table.maxp)
        self.buffer = self.backend.state(ListStateDescriptor(BUFFER_STATE, Types.PICKLED_BYTE_ARRAY()))
        self.rows_in = 0
        self._seq = 0
        fn = self.band.function
        self._join = fn.join if isinstance(fn, Function) else fn
        self._functions = [f for f in (fn, self.band.predicate) if isinstance(f, Function)]

    # ---- ownership -------------------------------------------------------------------------
    @property
    def owned(self) -> np.ndarray:
        return self._owned

    @owned.setter
    def owned(self, kgs: np.ndarray) -> None:
        """Set by the task at every epoch: forget what we no longer own (it may change)."""
        self._owned = kgs
        keep = set(kgs.tolist())
        for kg in [kg for kg in self._cache if kg not in keep]:
            del self._cache[kg]
            self._resort = True

    def _sync(self) -> None:
        """Load the key groups we gained (their previous owners have written them back)."""
        missing = [kg for kg in self._owned.tolist() if kg not in self._cache]
        if missing:
            kgs = np.array(missing, dtype=np.uint16)
            self._begin(kgs)
            for u, kg in enumerate(missing):
                self.backend.current = u
                self._cache[kg] = list(self.buffer.get())
            self.backend.end()
            self._resort = True
        if self._resort:
            self._resort = False
            sides: tuple[list, list] = ([], [])
            for kg, elements in self._cache.items():
                for side, ts, value in elements:
                    self._seq += 1
                    sides[side].append((ts, self._seq, value, kg))
            for s in sides:
                s.sort(key=lambda e: (e[0], e[1]))
            self._sorted = sides

    def _begin(self, kgs: np.ndarray) -> None:
        keys = self.keys[kgs]
        rows = self.table.rows(kgs, keys, KeyMode.INT64)
        self.backend.begin(kgs, rows, keys.tolist())

    # ---- records ---------------------------------------------------------------------------
    def open(self, runtime_context) -> None:
        for f in self._functions:
            f.open(runtime_context)

    def close(self) -> None:
        for f in self._functions:
            f.close()

    def process_owned(self, batch: pa.RecordBatch, kgs: np.ndarray, owners: np.ndarray, me: int):
        self._sync()
        records = Records(batch=batch)
        ts = records.timestamps()
        if ts is None:
            raise ValueError(
                "a band join needs record timestamps: use assign_timestamps_and_watermarks "
                "or from_source with a WatermarkStrategy that has a timestamp assigner"
            )
        counters = batch.column(KEY_COLUMN).to_numpy()
        homes = (counters % self.table.maxp).astype(np.int64)  # round robin over key groups
        mine = (owners[homes] == me).tolist()
        bound, predicate, join = self.band.bound, self.band.predicate, self._join
        wm = self.watermark
        stored: dict[int, list] = {}
        out: list = []
        out_ts: list = []
        sides = self._sorted
        pair = None
        try:
            for (side, value), t, kg, own in zip(records.items(), ts.tolist(), homes.tolist(), mine):
                if wm != MIN_WATERMARK and t < wm:
                    continue  # late: dropped, as the interval join drops it
                other = sides[1 - side]
                lo = bisect_left(other, (t - bound,))
                hi = bisect_left(other, (t + bound + 1,))
                for ot, _, ov, _ in other[lo:hi]:
                    pair = (value, ov) if side == 0 else (ov, value)
                    if predicate is None or predicate(*pair):
                        out.append(join(*pair))
                        out_ts.append(max(t, ot))
                if own:
                    self._seq += 1
                    insort(sides[side], (t, self._seq, value, kg), key=lambda e: (e[0], e[1]))
                    stored.setdefault(kg, []).append((side, t, value))
        except Exception as e:
            raise StepError(self.name, pair, NO_KEY, e, "band join function") from e
        self.rows_in = sum(len(v) for v in stored.values())
        if stored:
            self._write(stored, append=True)
        if not out:
            return None
        return split_outputs(out, out_ts, False, self.spec.output_type, self.name)

    def _write(self, lists: dict[int, list], append: bool) -> None:
        order = sorted(lists)
        self._begin(np.array(order, dtype=np.uint16))
        for u, kg in enumerate(order):
            self.backend.current = u
            if append:
                self.buffer.add_all(lists[kg])
                self._cache[kg].extend(lists[kg])
            else:
                self.buffer.update(lists[kg])
                self._cache[kg] = lists[kg]
        self.backend.end()

    # ---- expiry ----------------------------------------------------------------------------
    def fire(self, domain: int, limit: int) -> Records | None:
        """The watermark reached ``limit``: drop what no future (non-late) element can join."""
        if domain != EVENT:
            return None
        self._sync()
        cut = limit - self.band.bound  # elements before it are more than the band below any future one
        touched = set()
        for s in self._sorted:
            i = bisect_left(s, (cut,))
            if i:
                touched.update(e[3] for e in s[:i])
                del s[:i]
        if touched:
            self._write({kg: [e for e in self._cache[kg] if e[1] >= cut] for kg in touched}, append=False)
        return None
