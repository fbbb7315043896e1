"""A node's side of the one-query Spark stage: the parts of stage transactions its job took, and
their results, so that a task Spark retries or replays gets exactly the first attempt's results.

A Spark task's transaction (channel, query, micro-batch, partition) reaches each node that owns
key groups of its rows; the rows a node takes become one *part*: a transaction of the node's
engine (numbered, tagged, ended by a marker; see runtime.transactions), whose results the node
keeps as an Arrow IPC stream once its engine produced them all. Each part has an id that stays
the same wherever its record goes (``<node>:<number>``). A task sent again sends each row to the
owner of its key group now; a key group that took the (query, micro-batch) before (its dedup
mark) drops the rows, and its owner answers with the parts that cover it. For that, a part's
record goes with its key groups: a handoff ships the parts of the key groups it moves (the old
owner keeps those of key groups it still owns), a checkpoint keeps them, a recovery loads them, and
rows a dead node took after its checkpoint are replayed from its journal as new parts. The writer
takes each part once, by id, from whichever nodes answer with it.

A part is answered once its results are complete and, for a checkpointed job, once a checkpoint
covers them (results Spark has seen are never rolled back). Records of a query's micro-batches
older than the one before its latest are dropped (Spark replays only its latest micro-batch), and
those of all but the 64 queries heard of last (a batch query's tasks make a query of their own).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import pyarrow as pa

from stretch.runtime.channel_log import ChannelLog

_KEPT_BATCHES = 2  # a query's latest micro-batch and the one before it
_KEPT_QUERIES = 64  # queries whose parts are kept (a batch query's tasks make one of their own)

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("channel", pa.string()),
        ("query", pa.string()),
        ("batch", pa.int64()),
        ("partition", pa.int64()),
        ("output", pa.string()),
        ("key_groups", pa.list_(pa.int32())),
        ("results", pa.large_binary()),
    ]
)
"""A table of part records, as a handoff ships them and a checkpoint keeps them."""


@dataclass(eq=False)
class StagePart:
    """Rows of one stage transaction one node took, and their results (an Arrow IPC stream)."""

    id: str
    name: tuple  # (channel, query, micro-batch, partition)
    output: str
    key_groups: frozenset
    txn: int = 0  # this node's transaction number; 0: a part taken elsewhere (its results came along)
    results: bytes | None = None
    end: int = 0  # the output log offset its results end at here (they are answered once readable)
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class StageParts:
    """The stage transaction parts of one job on one node (``job``: its NodeJob)."""

    def __init__(self, node_id: str, job):
        self.node_id, self.job = node_id, job
        self._numbers = itertools.count(time.time_ns() // 1000)  # unique across runs of the node id
        self._lock = threading.Lock()
        self._parts: dict[tuple, list[StagePart]] = {}  # name -> its parts here
        self._latest: OrderedDict[tuple, int] = OrderedDict()  # (channel, query) -> its latest batch
        self._waiting: queue.Queue[StagePart | None] = queue.Queue()
        self._readers: dict[str, ChannelLog] = {}
        self._completer: threading.Thread | None = None

    # ---- parts taken here -----------------------------------------------------------------------
    def take(self, name: tuple, output: str, rows: pa.RecordBatch, key_groups) -> StagePart:
        """Rows of transaction ``name`` into the job as a new part (the caller holds the node's
        lock and checked the rows' key groups): numbered, tagged and ended in the job's gate."""
        out = self.job.output_channel(output)  # LookupError: no such output channel
        txn = next(self._numbers)
        part = StagePart(f"{self.node_id}:{txn}", name, output, frozenset(key_groups), txn=txn)
        self._record(part)
        channel, query, batch, partition = name
        try:
            self.job.take(channel, rows, f"{query}#{partition}", batch, stage=(txn, (*name, output)))
        except BaseException:
            self._unrecord(part)
            raise
        self._complete_later(part, out)
        return part

    def _complete_later(self, part: StagePart, out) -> None:
        if self._completer is None:
            self._completer = threading.Thread(
                target=self._complete, name=f"stretch-stage-{self.job.name}", daemon=True
            )
            self._completer.start()
        self._waiting.put(part)

    def _complete(self) -> None:
        """Each part taken here, in the order taken: its results, once the engine made them all."""
        while (part := self._waiting.get()) is not None:
            out = self.job.output_channel(part.output)
            try:
                offsets, _generation = out.txns.wait(part.txn)
                batches = []
                if offsets:
                    reader = self._readers.get(part.output)
                    if reader is None:
                        reader = self._readers[part.output] = ChannelLog(out.log.dir, create=False)
                    for offset in offsets:
                        batches.extend(reader.read(offset, offset + 1))
                part.results = _ipc(batches)
                part.end = max(offsets, default=-1) + 1
            except Exception as e:  # the job failed or ended: the part has no results to give
                part.error = f"{type(e).__name__}: {e}"
            part.done.set()

    # ---- parts from elsewhere -------------------------------------------------------------------
    def adopt(self, records: pa.Table) -> None:
        """Parts taken on another node, for key groups this node owns now (a handoff, a recovery)."""
        for r in records.to_pylist():
            name = (r["channel"], r["query"], r["batch"], r["partition"])
            if any(p.id == r["id"] for p in self._parts.get(name, ())):
                continue
            part = StagePart(r["id"], name, r["output"], frozenset(r["key_groups"]), results=r["results"])
            part.done.set()
            self._record(part)

    def settle(self, key_groups=None, timeout: float = 600) -> None:
        """Return once every part taken here (``key_groups``: those covering any of them) has its
        results: a release stops key groups at the readers' frontier, and a transaction's rows
        must not be cut there (its results come from the node that took them, whole)."""
        wanted = None if key_groups is None else {int(kg) for kg in key_groups}
        with self._lock:
            parts = [
                p
                for ps in self._parts.values()
                for p in ps
                if p.txn and not p.done.is_set() and (wanted is None or p.key_groups & wanted)
            ]
        deadline = time.monotonic() + timeout
        for p in parts:
            if not p.done.wait(max(deadline - time.monotonic(), 0)):
                raise TimeoutError(f"stage part {p.id} of {p.name} had no results within {timeout} s")

    def records(self, key_groups) -> pa.Table:
        """The parts that cover any of ``key_groups`` (completed: the caller waited), as a table."""
        wanted = set(key_groups)
        with self._lock:
            parts = [p for ps in self._parts.values() for p in ps if p.key_groups & wanted]
        rows = []
        for p in parts:
            if not p.done.wait(60):
                raise TimeoutError(f"stage part {p.id} of {p.name} had no results within 60 s")
            if p.error is not None:  # its job failed: there is nothing to answer with
                continue
            channel, query, batch, partition = p.name
            rows.append(
                {
                    "id": p.id,
                    "channel": channel,
                    "query": query,
                    "batch": batch,
                    "partition": partition,
                    "output": p.output,
                    "key_groups": sorted(p.key_groups),
                    "results": p.results,
                }
            )
        return pa.Table.from_pylist(rows, schema=SCHEMA)

    def forget(self, owned) -> None:
        """Drop the parts none of whose key groups this node still owns (``owned``: bools)."""
        with self._lock:
            for name, parts in list(self._parts.items()):
                kept = [p for p in parts if any(owned[kg] for kg in p.key_groups)]
                if kept:
                    self._parts[name] = kept
                else:
                    del self._parts[name]

    # ---- answers --------------------------------------------------------------------------------
    def covering(self, name: tuple, key_groups) -> list[StagePart]:
        """The parts of transaction ``name`` recorded here that cover any of ``key_groups``."""
        wanted = set(key_groups)
        with self._lock:
            return [p for p in self._parts.get(name, ()) if p.key_groups & wanted]

    def answer(self, parts: list[StagePart], timeout: float = 600) -> tuple[dict, list[bytes]]:
        """The reply to a writer: each part's id and results, once complete and readable."""
        deadline = time.monotonic() + timeout
        for part in parts:
            if not part.done.wait(max(deadline - time.monotonic(), 0)):
                raise TimeoutError(f"stage part {part.id} of {part.name} had no results within {timeout} s")
            if part.error is not None:
                raise RuntimeError(f"stage part {part.id} of {part.name} failed: {part.error}")
            if part.txn:  # results of this node's log: a checkpointed job's once a checkpoint covers them
                log = self.job.output_channel(part.output).log
                while log.readable_end < part.end:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no checkpoint covered stage part {part.id} within {timeout} s")
                    time.sleep(0.002)
        reply = {"parts": [{"id": p.id} for p in parts]}
        return reply, [p.results or b"" for p in parts]

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _record(self, part: StagePart) -> None:
        channel, query, batch, _partition = part.name
        with self._lock:
            self._parts.setdefault(part.name, []).append(part)
            latest = max(batch, self._latest.get((channel, query), batch))
            self._latest[(channel, query)] = latest
            self._latest.move_to_end((channel, query))
            gone = [n for n in self._parts if n[:2] == (channel, query) and n[2] <= latest - _KEPT_BATCHES]
            while len(self._latest) > _KEPT_QUERIES:  # the query heard of longest ago
                oldest, _ = self._latest.popitem(last=False)
                gone += [n for n in self._parts if n[:2] == oldest]
            for name in gone:
                del self._parts[name]

    def _unrecord(self, part: StagePart) -> None:
        with self._lock:
            parts = self._parts.get(part.name, [])
            if part in parts:
                parts.remove(part)

    def close(self) -> None:
        if self._completer is not None:
            self._waiting.put(None)
            self._completer.join(5)
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


def _ipc(batches: list[pa.RecordBatch]) -> bytes:
    """Result batches as one Arrow IPC stream (b"": none)."""
    if not batches:
        return b""
    table = pa.Table.from_batches(batches)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()
