"""Chained stateless steps and the hand-off of records to gates and sinks, inside one stage.

Records move through a chain as whole batches (``runtime.batch.Records``). A ``to_gate`` step is
where a key_by happens: it computes each record's key and key group once, here in the producer
(``runtime.routing``), and appends the batch to the gate of the keyed operator.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np
import pyarrow as pa

from stretch.contracts.functions import Function, KeySelector, ProcessFunction, TimerService
from stretch.plan.stages import KeySpec, Step
from stretch.runtime.batch import TS_COLUMN, Records, resolve_field, split_outputs, take
from stretch.runtime.event_time import CARRIED, MAX_WATERMARK, WatermarkGenerator, judged, timestamps_of
from stretch.runtime.gate import Kind
from stretch.runtime.key_group_runs import block_rows
from stretch.runtime.outputs import NO_KEY, Outputs, StepError, call_of, open_function, per_record
from stretch.runtime.routing import keyed_by_field, keyed_by_selector, not_null


class Chain:
    """Runs a stage's chained steps on each batch and hands results to gates and sinks."""

    def __init__(self, steps: list[Step], stage_name: str, outputs: Outputs):
        self.outputs = outputs
        self.roots = [_make(s, stage_name, outputs) for s in steps]
        self.functions = [f for r in self.roots for f in r.functions()]
        self.nodes = [n for r in self.roots for n in r.walk()]
        self.chained_sinks = [n for n in self.nodes if isinstance(n, _ToChainedSink)]
        self.held_sinks = [n for n in self.nodes if isinstance(n, _ToSink) and n.held is not None]

    def open(self, runtime_context) -> None:
        for n in self.nodes:
            if isinstance(n.step.fn, Function):
                open_function(n.step.fn, runtime_context, n.operator)
        for n in self.nodes:
            n.open()

    def close(self) -> None:
        for f in self.functions:
            f.close()
        for n in self.nodes:
            n.close()

    def update_step(self, step: Step, runtime_context) -> None:
        """A live update of one chained step (``step`` has the new function): close the old
        function, open the new one; the records after this call run through the new one."""
        for n in self.nodes:
            if n.step.name == step.name and n.step.kind == step.kind:
                if isinstance(n.step.fn, Function):
                    n.step.fn.close()
                n.step = dataclasses.replace(n.step, fn=step.fn)
                if isinstance(step.fn, Function):
                    step.fn.open(runtime_context)
        self.functions = [f for r in self.roots for f in r.functions()]

    def push(self, records: Records) -> None:
        if records is None:
            return
        side = records.side
        for r in self.roots:
            if isinstance(r, _Side):
                part = side.get(r.tag.tag_id) if side else None
                if part is not None and len(part):
                    r.forward(part)
            elif len(records):
                r.push(records)

    def flush(self, wait: bool = True) -> None:
        """Chained sinks hand on what they hold back (SinkWriter.flush): at the end of a gate
        entry, and (``wait``: until it was taken) before the instance says it reached an epoch's
        position, so nothing it produced before is still on its way then."""
        for n in self.held_sinks:
            n.flush()
        for n in self.chained_sinks:
            n.writer.flush(wait)

    def emit(self, kind, value: int = 0, producer: int | None = None) -> None:
        """A watermark (or IDLE/LEAVE) of this producer (or of ``producer``, another instance of
        its stage) to every gate the chain feeds; its own watermark to its chained sinks too
        (SinkWriter.watermark), after the records before it."""
        for n in self.nodes:
            if isinstance(n, _ToGate) or (isinstance(n, _ToSink) and n.timed):
                n.control(kind, value, producer)
        if kind == Kind.WATERMARK and producer is None:
            for n in self.chained_sinks:
                n.writer.watermark(value)

    def end_txn(self, txn: int, producers: int) -> None:
        """Input transaction ``txn`` ended here: every gate and sink gate the chain feeds learns it,
        once from each of this stage's ``producers`` instances (see runtime.transactions)."""
        for n in self.held_sinks:  # the transaction's results before its marker
            n.flush()
        for n in self.nodes:
            if isinstance(n, (_ToGate, _ToSink)):
                n.gate.append_control(Kind.MARK, producers, txn)

    def tick(self) -> None:
        """Time passes without records: watermark generators may declare the producer idle."""
        for n in self.nodes:
            if isinstance(n, _Assign):
                n.tick()

    def finish(self) -> None:
        """End of a bounded input: watermarks advance to the maximum, firing everything downstream."""
        for n in self.nodes:
            if isinstance(n, _ToGate):
                n.control(Kind.WATERMARK, MAX_WATERMARK)


class _Node:
    def __init__(self, step: Step, stage_name: str, outputs: Outputs):
        self.step = step
        self.stage_name = stage_name
        self.outputs = outputs
        self.children = [_make(c, stage_name, outputs) for c in step.children]

    @property
    def operator(self) -> str:
        """The name errors give: the step's own (``.name(...)``, else Flink's "Map" and so on)."""
        return self.step.name or self.stage_name

    def gates_below(self) -> list:
        return [n for n in self.walk() if isinstance(n, _ToGate)]

    def functions(self) -> list:
        own = [self.step.fn] if isinstance(self.step.fn, Function) else []
        return own + [f for c in self.children for f in c.functions()]

    def walk(self):
        yield self
        for c in self.children:
            yield from c.walk()

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def forward(self, records: Records) -> None:
        if len(records):
            for c in self.children:
                c.push(records)


class _Map(_Node):
    def push(self, records: Records) -> None:
        f = call_of(self.step.fn, "map")
        items = records.items()
        ts = records.timestamps()
        try:
            out = [f(r) for r in items]
        except Exception:
            out, kept = per_record(items, f, self.operator, "map function", self.outputs)
            ts = take(ts, kept)
        self.forward(
            Records(items=out, type_info=self.step.output_type, timestamps=ts, producer=self.operator)
        )


class _FlatMap(_Node):
    def push(self, records: Records) -> None:
        f = call_of(self.step.fn, "flat_map")
        try:
            flat = self._flat_mapped(records, f)
        except StepError:  # this step's own failure (the children run below, outside the try)
            if self.outputs.dead_letter_gate is None:
                raise
            items = records.items()  # again, record by record, rejecting the ones that fail
            results, kept = per_record(
                items, lambda r: list(f(r) or ()), self.operator, "flat_map function", self.outputs
            )
            ts = records.timestamps()
            out = [x for res in results for x in res]
            out_ts = np.repeat(take(ts, kept), [len(res) for res in results]) if ts is not None else None
            flat = Records(
                items=out, type_info=self.step.output_type, timestamps=out_ts, producer=self.operator
            )
        self.forward(flat)

    def _flat_mapped(self, records: Records, f) -> Records:
        out: list = []
        ext = out.extend
        record = None
        ts = records.timestamps()
        counts = [] if ts is not None else None
        try:
            for record in records.items():
                res = f(record)
                if res is not None:
                    before = len(out)
                    ext(res)
                    if counts is not None:
                        counts.append(len(out) - before)
                elif counts is not None:
                    counts.append(0)
        except Exception as e:
            raise StepError(self.operator, record, NO_KEY, e, "flat_map function") from e
        out_ts = np.repeat(ts, counts) if ts is not None else None
        return Records(items=out, type_info=self.step.output_type, timestamps=out_ts, producer=self.operator)


class _Filter(_Node):
    def push(self, records: Records) -> None:
        f = call_of(self.step.fn, "filter")
        items = records.items()
        try:
            mask = [bool(f(r)) for r in items]
        except Exception:
            results, kept = per_record(
                items, lambda r: bool(f(r)), self.operator, "filter function", self.outputs
            )
            mask = [False] * len(items)  # rejected records do not pass
            for i, ok in zip(kept, results):
                mask[i] = ok
        ts = records.timestamps()
        keep_ts = ts[np.array(mask, dtype=bool)] if ts is not None else None
        if records._batch is not None:
            out = Records(
                batch=records._batch.filter(pa.array(mask)),
                type_info=records.type_info,
                timestamps=keep_ts,
                producer=records.producer,
            )
            out._items = [r for r, m in zip(items, mask) if m]
        else:
            out = Records(
                items=[r for r, m in zip(items, mask) if m],
                type_info=records.type_info,
                timestamps=keep_ts,
                producer=records.producer,  # the records' type is still the one it declared
            )
        self.forward(out)


class _NoTimers(TimerService):
    """The timer service of a non-keyed ProcessFunction: the clock, but no timers (as in Flink)."""

    def current_processing_time(self) -> int:
        return time.time_ns() // 1_000_000

    def current_watermark(self) -> int:
        raise NotImplementedError(
            "current_watermark() is not available in a non-keyed ProcessFunction: it runs chained "
            "into its producer, which has no input watermark of its own; use a KeyedProcessFunction"
        )

    def _refuse(self, timestamp: int) -> None:
        raise RuntimeError("Setting timers is only supported on a keyed stream (as in Flink).")

    register_processing_time_timer = register_event_time_timer = _refuse
    delete_processing_time_timer = delete_event_time_timer = _refuse


class _ProcessContext(ProcessFunction.Context):
    __slots__ = ("ts",)
    _timers = _NoTimers()

    def __init__(self):
        self.ts = None

    def timer_service(self) -> TimerService:
        return self._timers

    def timestamp(self):
        return self.ts


class _Process(_Node):
    """DataStream.process: a ProcessFunction per record, chained. ``ctx.timestamp()`` is the
    record's event timestamp (None without one); outputs keep it, as in Flink, and values yielded
    as ``(output_tag, value)`` go to that side output only."""

    def __init__(self, step, stage_name, outputs):
        super().__init__(step, stage_name, outputs)
        self.ctx = _ProcessContext()

    def push(self, records: Records) -> None:
        pe = self.step.fn.process_element
        ctx = self.ctx
        items = records.items()
        ts = records.timestamps()
        stamps = ts.tolist() if ts is not None else [None] * len(items)
        out: list = []
        out_ts: list = []
        for record, ctx.ts in zip(items, stamps):
            try:
                res = pe(record, ctx)
                produced = list(res) if res is not None else []
            except Exception as e:
                err = StepError(self.operator, record, NO_KEY, e, "process_element")
                err.__cause__ = e
                self.outputs.dead_letter(err)  # raises unless the job's policy is dead letters
                continue
            out.extend(produced)
            out_ts.extend([ctx.ts] * len(produced))
        result = split_outputs(
            out, out_ts if ts is not None else None, False, self.step.output_type, self.operator
        )
        for c in self.children:
            if isinstance(c, _Side):
                part = result.side.get(c.tag.tag_id) if result.side else None
                if part is not None and len(part):
                    c.push(part)
            elif len(result):
                c.push(result)


def _culprit(items: list, f):
    """The first record on which ``f`` raises (re-run only after a failure)."""
    for r in items:
        try:
            f(r)
        except Exception:
            return r
    return None


HELD = "held"
"""A ``to_sink`` step's ``fn`` (as is ``CARRIED``, which also keeps the timestamps): the records an
instance produces from one gate entry go into the sink gate together at the entry's end
(``Chain.flush``), as a few large batches: a checkpointed cluster job's forward log, whose every
batch is a write to other nodes (cluster.forward_log)."""
HOLD_ROWS = 1 << 16  # a held sink hands on what it holds at this many rows, whatever it is doing


class _ToSink(_Node):
    """Records into a sink gate (a sink the job runs itself). A sink that carries event time
    (``step.fn == CARRIED``: a checkpointed cluster job's forward log, cluster.forward_log) gets the
    records' timestamps as a ``__ts`` column and the instance's watermarks, as a gate does; it and
    a ``HELD`` one hold the records until the end of the gate entry."""

    def __init__(self, step, stage_name, outputs):
        super().__init__(step, stage_name, outputs)
        self.gate = outputs.sink_gates[step.sink]
        self.timed = step.fn == CARRIED
        self.held: list | None = [] if step.fn in (CARRIED, HELD) else None
        self.held_rows = 0
        self.held_txn = 0  # the input transaction the held records came of

    def control(self, kind, value: int = 0, producer: int | None = None) -> None:
        self.flush()  # after the records before it
        self.gate.append_control(kind, self.outputs.producer_id if producer is None else producer, value)

    def push(self, records: Records) -> None:
        batch = records.data_batch()
        self.outputs.count_out(batch.num_rows)
        ts = records.timestamps() if self.timed else None
        if ts is not None:
            batch = batch.append_column(TS_COLUMN, pa.array(ts, pa.int64()))
        if self.held is None:
            self.gate.append_batch(batch, producer=self.outputs.producer, txn=self.outputs.txn)
            return
        if self.held and self.held_txn != self.outputs.txn:  # one transaction's results a batch
            self.flush()
        self.held.append(batch)
        self.held_txn = self.outputs.txn
        self.held_rows += batch.num_rows
        if self.held_rows >= HOLD_ROWS:
            self.flush()

    def flush(self) -> None:
        """What it holds into the sink gate, a batch per run of one schema (records with and
        without timestamps go apart)."""
        if not self.held:
            return
        held, self.held, self.held_rows = self.held, [], 0
        for _schema, run in itertools.groupby(held, key=lambda b: b.schema):
            table = pa.Table.from_batches(list(run)).combine_chunks()
            self.gate.append_batch(table.to_batches()[0], producer=self.outputs.producer, txn=self.held_txn)

    def close(self) -> None:
        self.flush()
        super().close()


class _Assign(_Node):
    """assign_timestamps_and_watermarks (or a source's strategy): event timestamps for the
    records, and watermarks, per Flink's rule, to the gates downstream of this step."""

    def __init__(self, step, stage_name, outputs):
        super().__init__(step, stage_name, outputs)
        self.strategy = step.fn
        self.generator = WatermarkGenerator(self.strategy)
        self.assigner = self.strategy.timestamp_assigner

    def functions(self) -> list:
        return [f for c in self.children for f in c.functions()]

    def push(self, records: Records) -> None:
        ts = self._timestamps(records)
        if ts is not None:
            records = Records(records._batch, records._items, records.type_info, ts)
        self.forward(records)
        ts = records.timestamps()
        if ts is not None:
            wm = self.generator.on_timestamps(ts, self.outputs.round)
            if wm is not None:
                for g in self.gates_below():
                    g.control(Kind.WATERMARK, wm)

    def _timestamps(self, records: Records) -> np.ndarray | None:
        a = self.assigner
        if a is None:
            return None
        if a == CARRIED:  # a cluster's forward: the records come with the timestamps they had
            return records.timestamps()
        if isinstance(a, str):  # beyond PyFlink: a field holding the timestamp, read as a column
            batch = records.data_batch()
            return timestamps_of(batch.column(resolve_field(batch.schema, a)))
        previous = records.timestamps()
        prev = previous.tolist() if previous is not None else [-(2**63)] * len(records)
        items = records.items()
        try:
            return np.array([a.extract_timestamp(r, p) for r, p in zip(items, prev)], dtype=np.int64)
        except Exception as e:
            culprit = _culprit(items, lambda r: a.extract_timestamp(r, -(2**63)))
            raise StepError(self.operator, culprit, NO_KEY, e, "timestamp assigner") from e

    def tick(self) -> None:
        if self.generator.check_idle():
            for g in self.gates_below():
                g.control(Kind.IDLE)


class _Side(_Node):
    """The start of a side output's chain: receives the records yielded with its OutputTag."""

    def __init__(self, step, stage_name, outputs):
        super().__init__(step, stage_name, outputs)
        self.tag = step.fn

    def push(self, records: Records) -> None:
        self.forward(records)


class _ToChainedSink(_Node):
    """A sink that runs inside the producing instance (e.g. DiscardingSink)."""

    def __init__(self, step, stage_name, outputs):
        super().__init__(step, stage_name, outputs)
        self.spec = outputs.sinks[step.sink]
        self.writer = None

    def open(self) -> None:
        self.writer = self.spec.sink.create_writer(self.spec.upstream_parallelism)
        self.writer.open(self.outputs.producer)

    def close(self) -> None:
        self.writer.close()

    def push(self, records: Records) -> None:
        self.outputs.count_out(len(records))
        self.writer.write_records(records, self.outputs.producer)


class _ToGate(_Node):
    def __init__(self, step, stage_name, outputs):
        super().__init__(step, stage_name, outputs)
        self.gate = outputs.gates[step.gate]
        self.key: KeySpec = step.key

    def control(self, kind, value: int = 0, producer: int | None = None) -> None:
        self.gate.append_control(kind, self.outputs.producer_id if producer is None else producer, value)

    def _runs(self) -> bool:
        """Lay the batch out in runs of key groups: when several instances read the gate."""
        return self.key.runs and self.gate.instance_readers() > 1

    def _block(self) -> int:
        """The rows of a block of the layout (key_group_runs): about BLOCK_NS of the readers' work."""
        return block_rows(self.gate.read_ns_per_row, self.key.max_parallelism)

    def push(self, records: Records) -> None:
        key = self.key
        if key.field is not None:
            records = self._without_null_keys(records, key.field)
            if not len(records):
                return
            batch = keyed_by_field(
                records.data_batch(),
                key.field,
                key.max_parallelism,
                records.timestamps(),
                self._runs(),
                self._block(),
            )
        else:
            items = records.items()
            keys, kept = self._keys(items)
            if kept is not None:  # records whose key selector failed went to dead letters
                if not kept:
                    return
                items = [items[i] for i in kept]
                records = Records(
                    items=items,
                    type_info=records.type_info,
                    timestamps=take(records.timestamps(), kept),
                    producer=records.producer,
                )
            batch = keyed_by_selector(
                records.data_batch(),
                items,
                keys,
                key.key_type,
                key.max_parallelism,
                self.operator,
                records.timestamps(),
                self._runs(),
                self._block(),
            )
        self.outputs.count_out(batch.num_rows)
        if self.outputs.judge is not None:
            batch = judged(batch, self.outputs.judge)
        self.gate.append_batch(batch, producer=self.outputs.producer, txn=self.outputs.txn)

    def _without_null_keys(self, records: Records, field) -> Records:
        """As in Flink, a key must not be null: such records fail the job, or go to dead letters."""
        batch = records.data_batch()
        valid = batch.column(resolve_field(batch.schema, field)).is_valid()
        if valid.false_count == 0:
            return records
        items = records.items()
        for i in np.flatnonzero(~valid.to_numpy(zero_copy_only=False)):
            cause = ValueError(f"its key field {field!r} is null; keys must not be null (as in Flink)")
            self.outputs.dead_letter(StepError(self.operator, items[i], NO_KEY, cause, "key_by"))
        ts = records.timestamps()
        return Records(
            batch.filter(valid),
            type_info=records.type_info,
            timestamps=None if ts is None else ts[valid.to_numpy(zero_copy_only=False)],
        )

    def _keys(self, items: list) -> tuple[list, list[int] | None]:
        """Each record's key, and which records have one (None: all of them)."""
        get = self.key.selector.get_key if isinstance(self.key.selector, KeySelector) else self.key.selector
        try:
            keys = [get(r) for r in items]
            if None not in keys:
                if list in set(map(type, keys)):
                    keys = [_hashable(k) for k in keys]
                return keys, None
        except Exception:
            pass
        return per_record(
            items, lambda r: not_null(_hashable(get(r))), self.operator, "key selector", self.outputs
        )


def _hashable(key):
    """A list key is the key of its contents, as in Flink (which hashes it by value): a tuple."""
    if type(key) is list:
        return tuple(_hashable(k) for k in key)
    return key


_KINDS = {
    "map": _Map,
    "flat_map": _FlatMap,
    "filter": _Filter,
    "to_sink": _ToSink,
    "to_chained_sink": _ToChainedSink,
    "to_gate": _ToGate,
    "assign": _Assign,
    "stateless_process": _Process,
    "side": _Side,
}


def _make(step: Step, stage_name: str, outputs: Outputs) -> _Node:
    return _KINDS[step.kind](step, stage_name, outputs)
