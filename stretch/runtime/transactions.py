"""Input transactions and the results each one caused (the one-query Spark stage's exactly once).

A transaction is what one Spark task hands the job in one go: its batches enter a channel together,
numbered ``txn`` (in the batches' schema metadata in a channel's gate and log, so the number
survives the input log and a recovery; as ``arg1`` of the entries of gates inside the job),
followed by an end marker. Every task that processes one of its batches tags what it produces with
the number; a stage forwards the end marker (a MARK entry) once each of its instances has seen it
from all its own producers, so when the output channel's sink has the marker from every producer,
every result of the transaction is in the output log, at offsets ``TxnResults`` recorded.

Exactly once across the death of the job's process (a checkpointed job, restored):

- a source takes no checkpoint barrier inside a transaction, so each transaction, its results and
  its end marker lie on one side of every checkpoint;
- the end marker carries the transaction's name, so a restored job finds in its input log the
  transactions it replays (and those whose end the dead run never logged: it skips them, and the
  restarted query publishes them anew);
- a checkpoint records the transactions whose results it covers (each query's latest micro-batch),
  so a restored job answers a replayed task with the first run's results.

Batches from Spark also carry their *round*: the writing query's micro-batch. The tasks of one
micro-batch publish in no order among themselves, so a watermark generator holds back what a round
shows until the next round begins (``runtime.event_time``), as Spark's own watermark advances only
between micro-batches.
"""

from __future__ import annotations

import json
import threading
import time

import pyarrow as pa

TXN_KEY = b"stretch.txn"
TXN_END_KEY = b"stretch.txn_end"
TXN_NAME_KEY = b"stretch.txn_name"
ROUND_KEY = b"stretch.round"


def tagged(batch: pa.RecordBatch, txn: int, round: str | None = None) -> pa.RecordBatch:
    """``batch`` as part of transaction ``txn`` (0: none) and of its writer's ``round``."""
    meta = dict(batch.schema.metadata or {})
    if txn:
        meta[TXN_KEY] = str(txn).encode()
    if round is not None:
        meta[ROUND_KEY] = round.encode()
    return batch.replace_schema_metadata(meta)


def end_marker(schema: pa.Schema, txn: int, name: tuple | None = None) -> pa.RecordBatch:
    """The zero-row batch that ends transaction ``txn`` (named ``name``) in a channel."""
    meta = {**(schema.metadata or {}), TXN_KEY: str(txn).encode(), TXN_END_KEY: b"1"}
    if name is not None:
        meta[TXN_NAME_KEY] = json.dumps(list(name)).encode()
    return pa.RecordBatch.from_pylist([], schema=schema.with_metadata(meta))


def name_of(batch: pa.RecordBatch) -> tuple | None:
    """The name an end marker carries (input channel, query, micro-batch, partition)."""
    meta = batch.schema.metadata
    value = meta.get(TXN_NAME_KEY) if meta else None
    return tuple(json.loads(value)) if value is not None else None


def txn_of(batch: pa.RecordBatch) -> tuple[int, bool]:
    """(the batch's transaction, 0 for none; whether it is the transaction's end marker)."""
    meta = batch.schema.metadata
    if not meta or TXN_KEY not in meta:
        return 0, False
    return int(meta[TXN_KEY]), TXN_END_KEY in meta


def round_of(batch: pa.RecordBatch) -> str | None:
    """The round (a writer's micro-batch) the batch arrived in, if its writer said."""
    meta = batch.schema.metadata
    value = meta.get(ROUND_KEY) if meta else None
    return value.decode() if value is not None else None


class MarkCounter:
    """A stage's side: a transaction ends here once every producer upstream has said so."""

    def __init__(self):
        self._seen: dict[int, int] = {}

    def ended(self, txn: int, expected: int) -> bool:
        n = self._seen.get(txn, 0) + 1
        if n < expected:
            self._seen[txn] = n
            return False
        self._seen.pop(txn, None)
        return True


class TxnResults:
    """An output channel's side: the log offsets of each transaction's results, and when they are
    complete (its end marker arrived from every producer of the sink)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._offsets: dict[int, list[int]] = {}
        self._marks = MarkCounter()
        self._complete: set[int] = set()
        self._failed: str | None = None
        self.generation = 0  # bumped when a recovery drops uncommitted output (it is made again)
        self.tracking = False  # a checkpointed job's: record what each checkpoint covers
        self.names: dict[int, tuple] = {}  # txn -> its name, for checkpoints (see the module doc)
        self._since_barrier: list[tuple[int, list[int]]] = []  # completed since the last barrier
        self._covered: dict[int, list[tuple[int, list[int]]]] = {}  # checkpoint -> completed before it

    def output(self, txn: int, offset: int) -> None:
        with self._cond:
            self._offsets.setdefault(txn, []).append(offset)

    def mark(self, txn: int, expected: int) -> None:
        with self._cond:
            if self._marks.ended(txn, expected):
                self._complete.add(txn)
                if self.tracking:
                    self._since_barrier.append((txn, list(self._offsets.get(txn, ()))))
                self._cond.notify_all()

    def name(self, txn: int, name: tuple) -> None:
        if self.tracking:
            with self._cond:
                self.names[txn] = name

    def barrier(self, checkpoint: int) -> None:
        """The sink reached ``checkpoint``: the transactions completed so far lie before it."""
        if not self.tracking:
            return
        with self._cond:
            self._covered[checkpoint], self._since_barrier = self._since_barrier, []

    def covered(self, checkpoint: int) -> list[tuple[tuple, int, list[int]]]:
        """(name, txn, result offsets) of the named transactions completed before ``checkpoint``
        and after the one before it."""
        with self._cond:
            done = [k for k in self._covered if k <= checkpoint]
            out = []
            for k in sorted(done):
                for txn, offsets in self._covered.pop(k):
                    name = self.names.pop(txn, None)
                    if name is not None:
                        out.append((name, txn, offsets))
            return out

    def reset(self) -> None:
        """A recovery rolled the output back to a checkpoint: the job replays the transactions
        after it, from its input log, and their results arrive again."""
        with self._cond:
            self._offsets.clear()
            self._marks = MarkCounter()
            self._complete.clear()
            self._since_barrier, self._covered = [], {}
            self.generation += 1
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        """The sink stopped: nobody waits for results that will not come."""
        with self._cond:
            self._failed = reason
            self._cond.notify_all()

    def wait(self, txn: int, timeout: float | None = None) -> tuple[list[int], int]:
        """The offsets of ``txn``'s results once complete, and the generation they belong to;
        they are then forgotten here."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while txn not in self._complete:
                if self._failed is not None:
                    raise RuntimeError(self._failed)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"transaction {txn} did not complete within {timeout} s")
                self._cond.wait(left)
            self._complete.discard(txn)
            return self._offsets.pop(txn, []), self.generation
