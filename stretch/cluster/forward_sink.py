"""The sink a keyed operator's instance writes its re-keyed records into on a cluster: a
ClusterWriter into the job's input channel of that edge (cluster.rekey_plans), each row to the node
owning its key group of the next operator.

It is chained into the producing instance and writes synchronously: an instance that passed a
gate position has sent every record it produced before it. So when a handoff releases a key group
at the readers' frontier, its records are at their next owner before the key group runs anywhere
else (per-key order holds across the move), and a slow receiving node slows its senders (a write
waits while the node's gate is full) instead of memory growing without bound.
"""

from __future__ import annotations

import pyarrow as pa

from stretch.contracts.connectors import Sink, SinkWriter

HOLD_ROWS = 1 << 16  # rows an instance holds before it sends them whatever it is doing


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
    """Holds an instance's records until it may be seen past what it read (``flush``: the end of
    a gate entry, an epoch; see Chain.flush), then sends them in one write: an operator that emits
    record by record still forwards whole batches."""

    def __init__(self, channel: str, reach: dict):
        self.channel, self.reach = channel, reach
        self.writer = None
        self.held: list = []
        self.rows = 0

    def _open(self):
        from stretch.cluster.tls import ClusterTLS
        from stretch.cluster.writer import ClusterWriter

        tls = self.reach.get("tls")
        self.writer = ClusterWriter(
            self.reach["address"],
            self.reach["job"],
            self.channel,
            secret=self.reach.get("secret"),
            tls=ClusterTLS.from_json(tls) if tls else None,
        )
        return self.writer

    def write(self, batch, producer: int) -> None:
        if batch.num_rows:
            self.held.append(batch)
            self.rows += batch.num_rows
            if self.rows >= HOLD_ROWS:
                self.flush()

    def flush(self) -> None:
        if not self.held:
            return
        batches, self.held, self.rows = self.held, [], 0
        table = pa.Table.from_batches(batches) if len(batches) > 1 else batches[0]
        (self.writer or self._open()).write(table)

    def close(self) -> None:
        self.flush()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def abort(self) -> None:
        self.held, self.rows = [], 0
        if self.writer is not None:
            self.writer.close()
            self.writer = None
