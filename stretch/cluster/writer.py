"""Writing rows into a job on a cluster: what users, Spark's sink and the one-query stage hold.

A writer opens the cluster by its address: its directory on the same host (routing table, node
endpoints, secret in files), or its driver's URL from anywhere (``grpc://host:port``: the driver
answers the routing table, the nodes' endpoints and the jobs' key routes; the caller gives the
secret). Every row goes to the node owning its key group, computed with the job's own key (a
field, or its key selector function: cluster.key_routes), through the one row path
(cluster.row_router). With ``query`` and ``batch`` (a Spark micro-batch), each key group of a
node takes a (query, batch) at most once, so a replayed micro-batch changes nothing wherever its
key groups are now (the marks move with the key groups).
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa

from stretch.cluster.client import ClusterConnection
from stretch.cluster.key_routes import KeyRoute, decode_routes
from stretch.cluster.row_router import REFUSED, RowRouter
from stretch.cluster.tls import ClusterTLS
from stretch.cluster.writer_clock import clock_for
from stretch.common.records import schema_for, to_batch
from stretch.common.typeinfo import TypeInformation
from stretch.runtime.batch import TS_COLUMN

NODES_FOR_S = 1.0  # how long a writer's list of the nodes it sends its watermark to holds


class ClusterWriter:
    """Writes records into input channel ``channel`` of job ``job`` on the cluster at ``address``
    (its directory, or its URL with ``secret`` and, for TLS, ``tls``: see ClusterConnection).

    ``key``: the field to route by, if not the job's own key (the cluster knows the key, field or
    function, of the jobs it was given).

    An event-time channel's writer is an input split with a watermark of its own (cluster
    .writer_clock), fresh per writer unless ``split`` names it: a split of a source read again by
    another reader goes on as the same split.

    A broadcast channel (the rows of a job's ``broadcast(descriptor)`` stream) is not split: every
    node of the broadcast membership (``members.json``) takes the whole batch, each (query, batch)
    at most once per node. A node that joins copies the broadcast state of a member first; from
    then until the membership names it, that member refuses writers of the older membership, which
    load it again and send the rows to the nodes that have not taken them, the new one included.
    """

    def __init__(
        self,
        address: str | Path,
        job: str,
        channel: str,
        key=None,
        retry_for: float = 60.0,
        secret: str | None = None,
        tls: ClusterTLS | None = None,
        split: str | None = None,
    ):
        self.connection = ClusterConnection(address, secret, tls)
        self.job, self.channel = job, channel
        info = self.connection.jobs().get(job, {})
        route = KeyRoute(field=key) if key is not None else decode_routes(info.get("routes")).get(channel)
        self.broadcast = channel in info.get("broadcast", ())  # every node takes every row
        if route is None and not self.broadcast:
            raise LookupError(f"no job {job!r} with input channel {channel!r} on the cluster; give key=")
        declared = info.get("types", {}).get(channel)
        self.type_info = TypeInformation.from_json(declared) if declared else None
        self.schema = schema_for(self.type_info) if self.type_info is not None else None
        self.router = RowRouter(self.connection, job, channel, route, retry_for)
        strategy = route.watermarks if route is not None else None
        self.clock = clock_for(strategy, route.operator, split) if strategy is not None else None
        self._nodes: tuple[float, list[str]] = (-NODES_FOR_S, [])  # (when listed, nodes) progress goes to
        self._wrote = False  # a writer that wrote nothing is no split: it tells no node it closed

    @property
    def refusals(self) -> int:
        """Parts sent again because their key groups had moved (or a broadcast membership changed)."""
        return self.router.refusals

    @property
    def shared(self):
        """The shared-memory segments this writer stages parts in (cluster.shm_transport)."""
        return self.router.shared

    def write(self, data, query: str | None = None, batch: int | None = None) -> None:
        """Send records (a RecordBatch, a Table or a list of tuples/Rows) to their nodes.

        ``query`` and ``batch``: the (query, micro-batch) they belong to; a (query, batch) that a
        key group already took is dropped there, so a replay is exact. Give all rows of a
        micro-batch in one call: a node takes a key group's rows of a micro-batch all at once.
        """
        if (query is None) != (batch is None):
            raise ValueError("give both query and batch (a micro-batch), or neither")
        rows = self._batch(data)
        if rows is None:
            return
        command = {"op": "write", "job": self.job, "channel": self.channel, "query": query, "batch": batch}
        if self.broadcast:
            self.router.deliver_to_every_node(rows, command)
        elif self.clock is None:
            self.router.deliver(rows, command)
        else:  # event time: the watermark before the rows with them, the one after to every node
            ts = self.clock.timestamps(rows)
            self._wrote = True
            self.router.deliver(rows, {**command, "wm": self.clock.before()})
            progress = self.clock.after(ts)
            if progress is not None:
                self._progress(progress)

    def advance(self, watermark: int) -> None:
        """A forward's writer (cluster.forward_sink): its producing instance passed ``watermark``,
        which every node hears."""
        self._wrote = True
        self._progress(self.clock.advance(watermark))

    def _progress(self, progress: dict, fresh: bool = False) -> None:
        """This writer's watermark to every node of the cluster, whether it sent it rows or not
        (the nodes as of a second ago at most, or now if ``fresh``: a node that joined hears of
        a writer that sends it no rows)."""
        now = time.monotonic()
        if fresh or now - self._nodes[0] > NODES_FOR_S:
            self._nodes = (now, sorted(self.connection.locations()))
        body = {"job": self.job, "channel": self.channel, **progress}
        for node in self._nodes[1]:
            try:
                self.connection.action(node, "watermark", body)
            except REFUSED:  # a node gone (removed, or dead and being restored): nothing to tell it
                pass

    def transact(self, data, output: str, query: str, batch: int, partition: int) -> list[pa.Table]:
        """One transaction of the one-query Spark stage (stretch.spark.stage): the rows, named
        (query, micro-batch, partition), go to the nodes owning their key groups, each taking its
        part of it at most once; returns the results the rows caused in output channel
        ``output``, from every node, each part's once (a transaction sent again gets the first
        attempt's results, wherever its key groups are now)."""
        rows = self._batch(data)
        if rows is None:
            return []
        if self.broadcast:
            raise ValueError(f"channel {self.channel!r} is broadcast: a stage writes a keyed channel")
        command = {
            "op": "stage",
            "job": self.job,
            "channel": self.channel,
            "output": output,
            "query": query,
            "batch": int(batch),
            "partition": int(partition),
        }
        results: dict[str, pa.Buffer] = {}
        ts = self.clock.timestamps(rows) if self.clock is not None else None
        for answer in self.router.deliver(rows, command):
            for part, data_ in zip(answer.reply["parts"], answer.results):
                results.setdefault(part["id"], data_)
        if ts is not None and len(ts):  # the micro-batch rule: every node hears of its largest timestamp
            self._progress({"query": query, "round": int(batch), "max": int(ts.max())})
        return [pa.ipc.open_stream(r).read_all() for r in results.values() if r.size]

    def _batch(self, data) -> pa.RecordBatch | None:
        """The records as one batch of the channel's schema (None: no rows)."""
        if isinstance(data, pa.Table):  # one batch: a key group's rows of a micro-batch go together
            parts = data.combine_chunks().to_batches()[:1]
            batch = parts[0] if parts else None
        elif isinstance(data, pa.RecordBatch):
            batch = data
        else:
            batch = to_batch(list(data), self.type_info)
        if batch is None or not batch.num_rows:
            return None
        return self._shaped(batch)

    def _shaped(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """A batch in the channel's declared schema (columns by position: Spark's names and
        Arrow types, such as string for large_string, differ from the job's)."""
        if self.schema is None or batch.schema.equals(self.schema):
            return batch
        if TS_COLUMN in batch.schema.names:  # a forward's rows, with their timestamps beside
            at = batch.schema.get_field_index(TS_COLUMN)
            data = self._shaped(batch.drop_columns([TS_COLUMN]))
            return data.append_column(TS_COLUMN, batch.column(at))
        if batch.num_columns != len(self.schema):
            raise ValueError(
                f"channel {self.channel!r} of job {self.job!r} takes {len(self.schema)} columns "
                f"({self.schema}), got {batch.num_columns} ({batch.schema})"
            )
        columns = [c.cast(f.type) for c, f in zip(batch.columns, self.schema)]
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)

    def close(self, done: bool = True) -> None:
        """Close the connections to the nodes (a ``with`` block does it at its end); a writer of an
        event-time channel tells every node it is gone (unless not ``done``: its split goes on in
        another writer), so it no longer holds their watermark back."""
        if self.clock is not None and self._wrote and done:
            self._progress(self.clock.closing(), fresh=True)
        self.clock = None
        self.router.close()
        self.connection.close()

    def __enter__(self) -> ClusterWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
