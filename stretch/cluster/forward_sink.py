"""The sink a keyed operator's instance writes its re-keyed records into on a cluster: a
ClusterWriter into the job's input channel of that edge (cluster.rekey_plans), each row to the node
owning its key group of the next operator.

It is chained into the producing instance: before an instance says it reached an epoch's position
(a handoff's release at the readers' frontier) every record it produced before is taken by its
next owner. So a released key group's records are there before the key group runs anywhere else
(per-key order holds across the move). Between epochs the records of a gate entry travel while
the instance reads the next, at most ``IN_FLIGHT`` writes ahead: a slow receiving node (a write
waits while its gate is full) slows its senders instead of memory growing without bound.

In a job with event time (``timed``) the records go with their timestamps, and each instance is an
input split of the next operator with the instance's own watermark (Flink's model): every node
hears it (cluster.writer_clock.CarriedClock) after the records before it. An instance's split is
named ``<node>/<instance>`` (``split_name``): the driver announces the splits of the instances a
job starts with before any row comes (cluster.forward_ends), so no node's watermark passes an
instance that has not spoken yet.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque

import pyarrow as pa

from stretch.contracts.connectors import Sink, SinkWriter
from stretch.runtime.batch import TS_COLUMN
from stretch.runtime.chain import HOLD_ROWS  # rows an instance holds before it sends them anyway
from stretch.runtime.event_time import MIN_WATERMARK

IN_FLIGHT = 2  # writes an instance may have on their way before it waits for the first


def split_name(node: str, instance: int) -> str:
    """The input split of the next operator that instance ``instance`` (1-based) of a forward's
    producing operator on ``node`` is."""
    return f"{node}/{instance}"


class ForwardSink(Sink):
    """Writes into input channel ``channel`` of the job on the cluster ``reach`` names (``job``,
    ``address``: its directory or URL, ``secret``, ``tls``: ClusterTLS JSON or None); ``timed``:
    with the records' timestamps and the instances' watermarks. ``node``: the node it runs on,
    set there (cluster.node_job)."""

    runs_in = "instance"

    def __init__(self, channel: str, reach: dict, timed: bool = False):
        self.channel = channel
        self.reach = reach
        self.timed = timed
        self.node = ""

    @property
    def name(self) -> str:
        return f"forward {self.channel}"

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        return _ForwardWriter(self.channel, self.reach, self.timed, self.node)


class _ForwardWriter(SinkWriter):
    """Holds an instance's records until it may be seen past what it read (``flush``), then hands
    them to a sender thread as one write: an operator that emits record by record still forwards
    whole batches, and the instance goes on processing while they travel. At most ``IN_FLIGHT``
    writes are on their way (then the instance waits: backpressure), sent in order, each watermark
    after the writes before it (watermarks in a row go as the last); a flush that waits (an epoch:
    a handoff's frontier) returns once every one was taken."""

    def __init__(self, channel: str, reach: dict, timed: bool = False, node: str = ""):
        self.channel, self.reach, self.timed, self.node = channel, reach, timed, node
        self.producer = 0  # the instance it runs in (``open``)
        self.held: list = []
        self.rows = 0
        self.outbox: deque = deque()  # ("rows", table) and ("watermark", value), in order
        self.writes = 0  # writes in the outbox or being sent
        self.changed = threading.Condition()
        self.sender: threading.Thread | None = None
        self.error: BaseException | None = None

    def open(self, producer: int) -> None:
        self.producer = producer

    def write(self, batch, producer: int) -> None:
        if batch.num_rows:
            self.held.append(batch)
            self.rows += batch.num_rows
            if self.rows >= HOLD_ROWS:
                self.flush(wait=False)

    def write_records(self, records, producer: int) -> None:
        batch = records.data_batch()
        ts = records.timestamps() if self.timed else None
        if ts is not None:
            batch = batch.append_column(TS_COLUMN, pa.array(ts, pa.int64()))
        self.write(batch, producer)

    def watermark(self, value: int) -> None:
        if not self.timed:
            return
        self.flush(wait=False)
        with self.changed:
            if self.outbox and self.outbox[-1][0] == "watermark":
                self.outbox[-1] = ("watermark", value)
            else:
                self._post(("watermark", value))

    def flush(self, wait: bool = True) -> None:
        self._check()
        if self.held:
            batches, self.held, self.rows = self.held, [], 0
            for table in _tables(batches):
                with self.changed:
                    while self.writes >= IN_FLIGHT and self.error is None:
                        self.changed.wait()
                    self.writes += 1
                    self._post(("rows", table))
        if wait:
            with self.changed:
                while self.writes and self.error is None:
                    self.changed.wait()
            self._check()

    def close(self) -> None:
        if self.timed and self.sender is None:  # it never spoke: its split closes all the same
            self.watermark(MIN_WATERMARK)
        self.flush()
        self._stop()

    def abort(self) -> None:
        self.held, self.rows = [], 0
        with self.changed:
            self.outbox.clear()
        self._stop()

    def _post(self, item) -> None:
        """Into the outbox (``changed`` held), the sender started on the first."""
        if self.sender is None:
            self.sender = threading.Thread(target=self._send, name=f"forward {self.channel}", daemon=True)
            self.sender.start()
        self.outbox.append(item)
        self.changed.notify_all()

    def _split(self) -> str | None:
        """This instance's split of the next operator, this time it runs (event time only)."""
        if not self.timed:
            return None
        return f"{split_name(self.node, self.producer)}#{uuid.uuid4().hex[:12]}"

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"forwarding into channel {self.channel!r} failed: {self.error}"
            ) from self.error

    def _stop(self) -> None:
        if self.sender is not None:
            with self.changed:
                self.outbox.append(("stop", None))
                self.changed.notify_all()
            self.sender.join()
            self.sender = None

    def _send(self) -> None:
        """The sender thread: each item of the outbox through a ClusterWriter, in order."""
        from stretch.cluster.tls import ClusterTLS
        from stretch.cluster.writer import ClusterWriter

        tls = self.reach.get("tls")
        writer = None
        try:
            while True:
                with self.changed:
                    while not self.outbox:
                        self.changed.wait()
                    kind, value = self.outbox.popleft()
                if kind == "stop":
                    return
                try:
                    if self.error is None:
                        writer = writer or ClusterWriter(
                            self.reach["address"],
                            self.reach["job"],
                            self.channel,
                            secret=self.reach.get("secret"),
                            tls=ClusterTLS.from_json(tls) if tls else None,
                            split=self._split(),
                        )
                        if kind == "rows":
                            writer.write(value)
                        else:
                            writer.advance(value)
                except BaseException as e:  # the instance raises it at its next flush
                    self.error = e
                finally:
                    with self.changed:
                        self.writes -= kind == "rows"
                        self.changed.notify_all()
        finally:
            if writer is not None:
                writer.close()


def _tables(batches: list) -> list:
    """The batches as few writes as their schemas allow, in order: records with timestamps and
    records without (a processing-time timer's, in a job with event time) go apart."""
    return [
        pa.Table.from_batches(list(run)) for _schema, run in itertools.groupby(batches, lambda b: b.schema)
    ]
