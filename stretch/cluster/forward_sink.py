"""The sink a keyed operator's instance writes its re-keyed records into on a cluster: a
ClusterWriter into the job's input channel of that edge (cluster.rekey_plans), each row to the node
owning its key group of the next operator.

It is chained into the producing instance: before an instance says it reached an epoch's position
(a handoff's release at the readers' frontier) every record it produced before is taken by its
next owner. So a released key group's records are there before the key group runs anywhere else
(per-key order holds across the move). Between epochs the records of a gate entry travel while
the instance reads the next, at most ``IN_FLIGHT`` writes ahead: a slow receiving node (a write
waits while its gate is full) slows its senders instead of memory growing without bound.
"""

from __future__ import annotations

import queue
import threading

import pyarrow as pa

from stretch.contracts.connectors import Sink, SinkWriter

HOLD_ROWS = 1 << 16  # rows an instance holds before it sends them whatever it is doing
IN_FLIGHT = 2  # writes an instance may have on their way before it waits for the first


class ForwardSink(Sink):
    """Writes into input channel ``channel`` of the job on the cluster ``reach`` names (``job``,
    ``address``: its directory or URL, ``secret``, ``tls``: ClusterTLS JSON or None)."""

    runs_in = "instance"

    def __init__(self, channel: str, reach: dict):
        self.channel = channel
        self.reach = reach

    @property
    def name(self) -> str:
        return f"forward {self.channel}"

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        return _ForwardWriter(self.channel, self.reach)


class _ForwardWriter(SinkWriter):
    """Holds an instance's records until it may be seen past what it read (``flush``), then hands
    them to a sender thread as one write: an operator that emits record by record still forwards
    whole batches, and the instance goes on processing while they travel. At most ``IN_FLIGHT``
    writes are on their way (then the instance waits: backpressure), sent in order; a flush that
    waits (an epoch: a handoff's frontier) returns once every one was taken."""

    def __init__(self, channel: str, reach: dict):
        self.channel, self.reach = channel, reach
        self.held: list = []
        self.rows = 0
        self.queue: queue.Queue = queue.Queue(maxsize=IN_FLIGHT)
        self.sender: threading.Thread | None = None
        self.error: BaseException | None = None

    def write(self, batch, producer: int) -> None:
        if batch.num_rows:
            self.held.append(batch)
            self.rows += batch.num_rows
            if self.rows >= HOLD_ROWS:
                self.flush(wait=False)

    def flush(self, wait: bool = True) -> None:
        self._check()
        if self.held:
            batches, self.held, self.rows = self.held, [], 0
            if self.sender is None:
                self.sender = threading.Thread(target=self._send, name=f"forward {self.channel}", daemon=True)
                self.sender.start()
            self.queue.put(pa.Table.from_batches(batches) if len(batches) > 1 else batches[0])
        if wait:
            self.queue.join()
            self._check()

    def close(self) -> None:
        self.flush()
        self._stop()

    def abort(self) -> None:
        self.held, self.rows = [], 0
        self._stop()

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"forwarding into channel {self.channel!r} failed: {self.error}"
            ) from self.error

    def _stop(self) -> None:
        if self.sender is not None:
            self.queue.put(None)
            self.sender.join()
            self.sender = None

    def _send(self) -> None:
        """The sender thread: each handed-over table through a ClusterWriter, in order."""
        from stretch.cluster.tls import ClusterTLS
        from stretch.cluster.writer import ClusterWriter

        tls = self.reach.get("tls")
        writer = None
        try:
            while (table := self.queue.get()) is not None:
                try:
                    if self.error is None:
                        writer = writer or ClusterWriter(
                            self.reach["address"],
                            self.reach["job"],
                            self.channel,
                            secret=self.reach.get("secret"),
                            tls=ClusterTLS.from_json(tls) if tls else None,
                        )
                        writer.write(table)
                except BaseException as e:  # the instance raises it at its next flush
                    self.error = e
                finally:
                    self.queue.task_done()
            self.queue.task_done()  # the None that stopped it
        finally:
            if writer is not None:
                writer.close()
