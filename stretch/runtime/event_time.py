"""Event time: timestamps on records, watermark generation at producers, tracking at consumers.

Watermarks travel through gates as control records (producer id, timestamp), in order with the
data. Every instance of an operator reads the same records in the same order, so all instances
compute the same watermark at the same gate position: the minimum over the gate's active
producers. A producer that goes idle, or is scaled away, stops holding the others back; the end of
a bounded input advances its watermark to the maximum, which fires everything (as in Flink).
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from stretch.runtime.batch import TS_COLUMN

MIN_WATERMARK = -(2**63)
MAX_WATERMARK = 2**63 - 1
MARK_KEY = b"stretch.watermark"
"""Schema metadata of a zero-row batch in an input channel: the channel's watermark (its decimal
value) or ``idle``, given from outside the job (a cluster node's writers: cluster.node_watermarks).
The channel's source task passes it on to its gates instead of generating watermarks itself."""


def mark_batch(schema: pa.Schema, watermark: int | None) -> pa.RecordBatch:
    """The zero-row batch that sets the channel's watermark (None: the channel is idle)."""
    value = b"idle" if watermark is None else str(int(watermark)).encode()
    return pa.RecordBatch.from_pylist(
        [], schema=schema.with_metadata({**(schema.metadata or {}), MARK_KEY: value})
    )


JUDGE_KEY = b"stretch.judged_by"
"""Schema metadata of rows taken again elsewhere (a cluster node's journal replayed on another
node): the watermark they met when they were first taken. The keyed operator judges them late or
not by it (or by its own, if lower), as the node that first took them did, though its own
watermark has moved on since."""


def judged(batch: pa.RecordBatch, watermark: int) -> pa.RecordBatch:
    return batch.replace_schema_metadata(
        {**(batch.schema.metadata or {}), JUDGE_KEY: str(int(watermark)).encode()}
    )


def judge_of(batch: pa.RecordBatch) -> int | None:
    meta = batch.schema.metadata
    value = meta.get(JUDGE_KEY) if meta else None
    return int(value) if value is not None else None


def mark_of(batch: pa.RecordBatch) -> int | bool | None:
    """The watermark a mark batch sets, None for idle, False for a batch that is no mark."""
    meta = batch.schema.metadata
    value = meta.get(MARK_KEY) if meta else None
    if value is None:
        return False
    return None if value == b"idle" else int(value)


CARRIED = TS_COLUMN
"""The timestamp assigner of records that come with their timestamps (a cluster's forward: the
``__ts`` column of the batches a producing instance sends on): it keeps them."""


def producer_id(stage_id: int, index: int) -> int:
    """A producer's id in watermark records: its stage and instance."""
    return stage_id * 65536 + index


def timestamps_of(column: pa.Array) -> np.ndarray:
    """Epoch milliseconds (int64) from a timestamp, date or integer column."""
    t = column.type
    if pa.types.is_timestamp(t):
        return column.cast(pa.timestamp("ms", tz=t.tz)).cast(pa.int64()).to_numpy(zero_copy_only=False)
    if pa.types.is_integer(t):
        return column.cast(pa.int64()).to_numpy(zero_copy_only=False)
    raise TypeError(f"a timestamp field must be a timestamp or an integer (epoch ms), not {t}")


class WatermarkGenerator:
    """A producer's watermarks from a WatermarkStrategy (Flink's bounded out-of-orderness rule).

    The watermark is the largest timestamp seen minus the allowed out-of-orderness minus 1 ms
    (monotonous timestamps: minus 1 ms). After ``idle_timeout`` without records the producer
    declares itself idle, so it does not hold back the others; its next record makes it active.

    Records that arrive in rounds (a Spark query's micro-batches, whose tasks publish in no order
    among themselves) count once their round is over: the largest timestamp of round n moves the
    watermark when round n+1 begins, or the input ends.
    """

    def __init__(self, strategy):
        self.kind = strategy.kind
        ooo = strategy.max_out_of_orderness
        self.delay = (ooo.to_milliseconds() if ooo is not None else 0) + 1
        idle = strategy.idle_timeout
        self.idle_timeout = idle.to_milliseconds() / 1000 if idle is not None else None
        self.max_ts = MIN_WATERMARK
        self.round: str | None = None  # the round being received, and its largest timestamp so far
        self.round_max = MIN_WATERMARK
        self.emitted = MIN_WATERMARK
        self.idle = False
        self.last_record = time.monotonic()

    def on_timestamps(self, ts: np.ndarray, round: str | None = None) -> int | None:
        """Note a batch's timestamps (``round``: the writer's micro-batch it came in); returns the
        new watermark if it advanced."""
        if not len(ts):
            return None
        self.last_record = time.monotonic()
        was_idle, self.idle = self.idle, False
        if round != self.round:  # the previous round is complete
            self.max_ts = max(self.max_ts, self.round_max)
            self.round, self.round_max = round, MIN_WATERMARK
        if round is None:
            self.max_ts = max(self.max_ts, int(ts.max()))
        else:
            self.round_max = max(self.round_max, int(ts.max()))
        if self.kind == "none":
            return None
        wm = self.max_ts - self.delay if self.max_ts > MIN_WATERMARK + self.delay else MIN_WATERMARK
        if wm > self.emitted or (was_idle and wm > MIN_WATERMARK):
            self.emitted = max(self.emitted, wm)
            return self.emitted
        return None

    def check_idle(self) -> bool:
        """True exactly when the producer has just become idle."""
        if self.idle_timeout is None or self.idle or self.kind == "none":
            return False
        if time.monotonic() - self.last_record >= self.idle_timeout:
            self.idle = True
            return True
        return False


class WatermarkTracker:
    """A consumer's view of its gate's producers: the watermark is the minimum over active ones."""

    def __init__(self, producers=()):
        self.marks: dict[int, int] = {p: MIN_WATERMARK for p in producers}
        self.idle: set[int] = set()
        self.current = MIN_WATERMARK

    def _advance(self) -> int | None:
        active = [w for p, w in self.marks.items() if p not in self.idle]
        if not active:
            if not self.marks:
                return None
            candidate = max(self.marks.values())  # everybody idle: do not hold time back
        else:
            candidate = min(active)
        if candidate > self.current:
            self.current = candidate
            return candidate
        return None

    def watermark(self, producer: int, ts: int) -> int | None:
        """A producer's watermark; returns the consumer's new watermark if it advanced."""
        self.idle.discard(producer)
        self.marks[producer] = max(self.marks.get(producer, MIN_WATERMARK), ts)
        return self._advance()

    def go_idle(self, producer: int) -> int | None:
        self.marks.setdefault(producer, MIN_WATERMARK)
        self.idle.add(producer)
        return self._advance()

    def leave(self, producer: int) -> int | None:
        """A producer scaled away or finished: it never holds the watermark back again."""
        self.marks.pop(producer, None)
        self.idle.discard(producer)
        return self._advance()

    def state(self) -> dict:
        return {"marks": dict(self.marks), "idle": sorted(self.idle), "current": self.current}

    @classmethod
    def from_state(cls, state: dict) -> WatermarkTracker:
        t = cls()
        t.marks = {int(p): int(w) for p, w in state["marks"].items()}
        t.idle = set(state["idle"])
        t.current = int(state["current"])
        return t
