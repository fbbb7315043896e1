"""A KeyedProcessFunction, run per record over the rows an instance owns, with its key's state
loaded in bulk and written back at the batch's end."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stretch.contracts.functions import TimeDomain
from stretch.runtime.batch import Records, split_outputs
from stretch.runtime.operators.base import KeyedOperator
from stretch.runtime.operators.context import KeyedContext, KeyedTimerService
from stretch.runtime.outputs import StepError, short
from stretch.state.states import StateTypeError
from stretch.state.timers import EVENT


class ProcessOperator(KeyedOperator):
    """A KeyedProcessFunction, called once per record with its key's state in place.

    A call's state is loaded and written back once, so the more records a call gets, the fewer
    times each key's state moves. A caller that commits to records step by step (an instance of
    the operator claiming gate positions, see runtime.frontier) sets ``go_on``: asked with the
    records done so far, it answers how far the call may go; an answer not past them ends the call
    there, and ``stopped_at`` says where. The results so far go to ``emit`` at each step, so a
    long call holds them back no longer than a short one would.
    """

    go_on = None  # a callable: records done -> records the call may reach (None: all of them)
    emit = None  # with go_on: a callable taking the results so far at each of its steps

    def __init__(self, spec, name, table):
        super().__init__(spec, name, table)
        self.stopped_at: int | None = None  # the record the last call ended before, if interrupted
        self.fn = spec.fn
        self.ctx = KeyedContext(self.backend, KeyedTimerService(self.backend, self))
        self.timestamped = getattr(spec.fn, "emits_timestamps", False)  # yields (value, timestamp)

    def open(self, runtime_context) -> None:
        self.fn.open(runtime_context)

    def close(self) -> None:
        self.fn.close()

    def process(self, batch: pa.RecordBatch, kgs: np.ndarray) -> Records | None:
        go_on, self.stopped_at = self.go_on, None
        try:
            col, mode, rows, uidx, first = self.locate(batch, kgs)
        except TypeError as e:  # a key of another type: admit() routes or raises it
            go_on = None  # records no longer match the batch's rows: no early end
            batch, kgs = self.admit(batch, kgs, e)
            if batch is None:
                return None
            col, mode, rows, uidx, first = self.locate(batch, kgs)
        b = self.backend
        b.begin(kgs[first], rows[first], self.python_keys(col, mode, first))
        records_in = Records(batch=batch)
        records = records_in.items()
        ts = records_in.timestamps()
        out: list = []
        pe = self.fn.process_element
        ctx = self.ctx
        ctx.ts = None
        slots = uidx.tolist()
        stamps = ts.tolist() if ts is not None else None
        counts: list[int] = []
        sent = [0, 0]  # records, and outputs, whose results went out already

        def results(upto: int) -> Records | None:
            """The outputs of records [sent, upto)."""
            rec, o = sent
            sent[:] = upto, len(out)
            out_ts = np.repeat(ts[rec:upto], counts[rec:upto]).tolist() if ts is not None else None
            return split_outputs(out[o:], out_ts, self.timestamped, self.spec.output_type, self.name)

        start, n = 0, len(records)
        limit = n if go_on is None else min(n, go_on(0))
        while start < limit:  # resumed after a record that went to dead letters
            start = self._process_from(start, limit, records, slots, stamps, out, counts, pe, ctx)
            if start == limit < n:
                if self.emit is not None:  # what the records so far produced, without waiting
                    self.emit(results(start))  # for the rest of the call
                limit = min(n, go_on(start))
        if start < n:
            self.stopped_at = start
        self.write_back()
        return results(start)

    def _process_from(self, start, stop, records, slots, stamps, out, counts, pe, ctx) -> int:
        """process_element of records[start:stop]; returns where to resume (after a rejected record,
        whose outputs, if it yielded some before it raised, are dropped with it).

        Outputs carry the timestamp of the record that produced them, as in Flink (``counts``:
        how many each record produced, when records have timestamps).
        """
        b = self.backend
        ext = out.extend
        i, before = start, len(out)
        try:
            # i names the record that raised, in the handler below
            if stamps is None:
                for i, (slot, record) in enumerate(zip(slots[start:stop], records[start:stop]), start):  # noqa: B007
                    b.current = slot
                    res = pe(record, ctx)
                    if res is not None:
                        ext(res)
                        before = len(out)
            else:
                for i, (slot, record, ctx.ts) in enumerate(  # noqa: B007
                    zip(slots[start:stop], records[start:stop], stamps[start:stop]), start
                ):
                    b.current = slot
                    res = pe(record, ctx)
                    before = len(out)
                    if res is not None:
                        ext(res)
                    counts.append(len(out) - before)
        except Exception as e:
            del out[before:]  # what the rejected record yielded before it raised
            what = getattr(self.fn, "what", "process_element")
            err = StepError(self.name, records[i], b.keys[slots[i]], e, what)
            err.__cause__ = e
            self.dead_letter(err)  # raises unless the job's policy is dead letters
            if stamps is not None:
                counts.append(0)
            return i + 1
        return stop

    def write_back(self) -> None:
        """End the batch: its state changes go to shared memory. A value the write-back cannot
        store (one of the declared type, but beyond its column's range) fails the job naming the
        operator and the key; values of another type were refused already by update()/add()."""
        b = self.backend
        try:
            b.end()
        except StateTypeError as e:
            raise TypeError(f"operator {self.name!r}, key {short(b.keys[e.slot])}: {e}") from None

    def dead_letter(self, error: StepError) -> None:
        outputs = getattr(self, "outputs", None)
        if outputs is None:
            raise error
        outputs.dead_letter(error)

    def next_timer(self, domain: int) -> int:
        store = self.backend.timer_store(create=False)
        return store.next_due(domain, self.owned_here()) if store is not None else 2**63 - 1

    def fire(self, domain: int, limit: int) -> Records | None:
        store = self.backend.timer_store(create=False)
        owned = self.owned_here()
        if store is None or not len(owned):
            return None
        b, ctx, on_timer = self.backend, self.ctx, self.fn.on_timer
        out: list = []
        out_ts: list = []
        ctx.domain = TimeDomain.EVENT_TIME if domain == EVENT else TimeDomain.PROCESSING_TIME
        while True:  # timers registered while firing fire in the same round if already due
            stamps, kgs, rows = store.pop_due(domain, owned, limit)
            if not len(stamps):
                break
            code = (kgs.astype(np.int64) << 40) | rows
            _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
            b.begin(kgs[first], rows[first], self.table.keys_at(kgs[first], rows[first]))
            u = 0
            slots, times = inverse.tolist(), stamps.tolist()
            left = np.bincount(inverse).tolist()  # each key's timers still to fire this round
            deferred: set[int] = set()
            try:
                for j, (u, ctx.ts) in enumerate(zip(slots, times)):
                    if u in deferred:
                        continue
                    left[u] -= 1
                    b.current = u
                    res = on_timer(ctx.ts, ctx)
                    if res is not None:
                        before = len(out)
                        out.extend(res)
                        out_ts.extend([ctx.ts] * (len(out) - before))
                    if left[u] and b.has_timer_ops(domain, u):
                        # the timer changed its key's timers: put the key's later ones back so the
                        # next round fires them in order with the new ones (or not, if deleted)
                        later = [t for v, t in zip(slots[j + 1 :], times[j + 1 :]) if v == u]
                        b.defer_timers(domain, u, later)
                        deferred.add(u)
            except Exception as e:
                raise StepError(self.name, f"timer at {ctx.ts}", b.keys[u], e, "on_timer") from e
            self.write_back()
        if not out:
            return None
        return split_outputs(out, out_ts, self.timestamped, self.spec.output_type, self.name)
