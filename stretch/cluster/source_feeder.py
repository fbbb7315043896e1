"""Reading one split of a source on a cluster: its records through the source's chained steps up
to the cuts, and what reaches each cut through a ClusterWriter into the node plan's input channel
(each row to the node owning its key group).

Each item the split's reader yields is one micro-batch of the writers, named (split's query, item
index): a key group takes it at most once, wherever the key group is by then, so a split read
again from any earlier item (after its reader's node died or left) adds nothing twice. The items
of a stretch source are the same whatever record it starts at, when that is an item's first
record (a file's lines in batches of 4096, a collection's rows in chunks, a sequence's numbers):
a restart seeks to the record (``RecordPositionedSource``); any other source is read again from its
start and the items before skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pyarrow as pa

from stretch.cluster.source_plans import SourceFeed
from stretch.cluster.writer import ClusterWriter
from stretch.contracts.connectors import RecordPositionedSource
from stretch.runtime.batch import Records
from stretch.runtime.chain import Chain
from stretch.runtime.operators import InstanceRuntimeContext
from stretch.runtime.outputs import Outputs

PROGRESS_EVERY = 0.2
"""Seconds between a reader's reports of how far it got: a split that another reader takes over
after its node died is read again from at most this much earlier (and dropped where taken)."""


class _Capture:
    """Where a cut's records land while one item goes through the chain."""

    def __init__(self):
        self.batches: list[pa.RecordBatch] = []

    def append_batch(self, batch: pa.RecordBatch, producer=None, txn: int = 0) -> None:
        self.batches.append(batch)

    def taken(self) -> pa.Table | None:
        batches, self.batches = self.batches, []
        if not batches:
            return None
        if len(batches) == 1:
            return pa.Table.from_batches(batches)
        return pa.concat_tables([pa.Table.from_batches([b]) for b in batches], promote_options="default")


class FeedWriters:
    """The ClusterWriters of a job's source channels, opened as a reader first needs them."""

    def __init__(self, address: str, job: str, secret: str | None = None, tls=None):
        self.address, self.job, self.secret, self.tls = address, job, secret, tls
        self.writers: dict[str, ClusterWriter] = {}
        self.splits: dict[tuple[str, str], ClusterWriter] = {}  # (channel, split's query) -> its writer

    def __getitem__(self, channel: str) -> ClusterWriter:
        w = self.writers.get(channel)
        if w is None:
            w = self.writers[channel] = ClusterWriter(
                self.address, self.job, channel, secret=self.secret, tls=self.tls
            )
        return w

    def write(self, channel: str, table: pa.Table, query: str, batch: int) -> None:
        """One item's records at a cut, as micro-batch (``query``, ``batch``). An event-time
        channel's split has a writer of its own, named by the split's query: an input split with
        its own watermark, as in Flink, whoever reads it."""
        w = self[channel]
        if w.clock is not None:
            w = self.splits.get((channel, query))
            if w is None:
                w = self.splits[(channel, query)] = ClusterWriter(
                    self.address, self.job, channel, secret=self.secret, tls=self.tls, split=query
                )
        w.write(table, query=query, batch=batch)

    def finish(self, query: str) -> None:
        """A split read to its end: it no longer holds the watermarks of its channels back."""
        for key in [k for k in self.splits if k[1] == query]:
            self.splits.pop(key).close()

    def close(self) -> None:
        for w in self.writers.values():
            w.close()
        self.writers.clear()
        for w in self.splits.values():  # splits not read to their end: another reader goes on
            w.close(done=False)
        self.splits.clear()


def read_split(
    feed: SourceFeed,
    source,
    query: str,
    writers: FeedWriters,
    start: int = 0,
    position: int = 0,
    progress: Callable[[int, int], None] = lambda item, position: None,
    stopped: Callable[[], bool] = lambda: False,
) -> bool:
    """Read ``source`` (a split of ``feed``) from item ``start`` (record ``position``) and write
    each item's records at the cuts as micro-batch (``query``, item index). ``progress(item,
    position)`` follows each item written whole. Returns False if ``stopped()`` stopped it first.
    A user function that fails raises (a StepError naming the operator and the record)."""
    captures = {i: _Capture() for i in range(len(feed.channels))}
    outputs = Outputs({}, captures, {}, 1, lambda n: None)
    chain = Chain(feed.steps, feed.name, outputs)
    chain.open(
        InstanceRuntimeContext(
            feed.name, 0, lambda: 1, feed.max_parallelism, job_parameters=feed.job_parameters
        )
    )
    seek = isinstance(source, RecordPositionedSource)
    if not seek:
        position = 0  # read again from the start, skipping the items before ``start``
    reader = source.create_reader(SimpleNamespace(position=position))
    source_type = getattr(source, "type_info", None)
    item_index = start if seek else 0
    try:
        for item in reader:
            if stopped():
                return False
            if item is None:  # the source waits for input
                continue
            if item_index >= start:
                records = (
                    Records(items=item, type_info=source_type)
                    if isinstance(item, list)
                    else Records(batch=item)
                )
                chain.push(records)
                for i, capture in captures.items():
                    table = capture.taken()
                    if table is not None and table.num_rows:
                        writers.write(feed.channels[i], table, query, item_index)
            position = source.advance(position, item)
            item_index += 1
            if item_index > start:
                progress(item_index, position)
    finally:
        close = getattr(reader, "close", None)
        if close is not None:
            close()
        chain.close()
    writers.finish(query)
    return True
