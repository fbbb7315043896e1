"""A checkpointed job's forward (cluster.rekey_plans): exactly once through node failures without
asking the user's functions to be deterministic.

The producing operator's records go into an output channel of the node's job named after the edge
(``ForwardLog``): a log that, like every output of a checkpointed job on a cluster, shows only what
the node's latest checkpoint covers, and that a dead node's recovery cuts back to it
(cluster.failover). A ``Forwarder`` thread of the node sends the log's committed batches, each
named (the node, its offset in the log) as a Spark micro-batch is named (query, batch), into the
forward's input channel. So:

- what a node forwarded is what its checkpoint covers: a restored node's key groups produce again
  exactly what came after, and none of it was sent before;
- a batch sent again (a forwarder that retries, a dead node's log sent by the driver) is dropped by
  every key group that took it (the marks move with the key groups and are in their checkpoints).

With event time the log keeps the records' timestamps and, between them, the node's producing
instances' least watermark (runtime.sink_runner): each node's log is one input split of the next
operator (``split_of``). A dead node's split holds the next operator's watermark where its
committed log left it until the nodes that restored its key groups sent what they produced again
(cluster.failover closes it then), so those records are judged late only if they were.

The price is latency: records cross the re-key once a checkpoint of their node covers them, as a
Flink job's transactional sink commits at checkpoints. Per key order across a handoff needs one
more rule (cluster.handoff): the new owner of a key group forwards nothing while its old owner
still sends what it committed of it (``hold``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from stretch.datastream.connectors.channel import ChannelSink
from stretch.runtime.channel_log import ChannelLog
from stretch.runtime.channel_writers import watermark_of

POLL_S = 0.005  # how often a forwarder looks for newly committed batches
RETRY_S = 0.2  # how long a forwarder waits before it sends again after a failed write
READER = "forwarder"  # the log keeps what its forwarder has not sent (ChannelLog.register)


class ForwardLog(ChannelSink):
    """The output channel a checkpointed job's producing operator writes a forward's records into
    on each node (named as the forward's input channel ``channel``); ``reach``: how the node's
    forwarder reaches the cluster (see ForwardSink)."""

    def __init__(self, channel: str, reach: dict, timed: bool = False):
        super().__init__(channel)
        self.channel = channel
        self.reach = reach
        self.timed = timed  # with event time: timestamps and watermarks go in the log too


def query_of(node: str) -> str:
    """The name a node's forwarded batches go under (with their log offsets): each key group takes
    a batch of it once."""
    return f"forward@{node}"


def split_of(node: str) -> str:
    """With event time, a node's forward log is one input split of the next operator, whose
    watermark is the least of the node's producing instances' (runtime.sink_runner)."""
    return f"{node}/log"


def send(writer, log: ChannelLog, node: str, start: int, end: int, sent=lambda offset: None) -> int:
    """Send batches ``start`` .. ``end`` of node ``node``'s forward log through a ClusterWriter
    (its watermarks as the split's progress), calling ``sent(offset after it)`` after each;
    returns the offset after the last one."""
    query = query_of(node)
    for offset, batch in enumerate(log.read(start, end), start):
        watermark = watermark_of(batch)
        if watermark is None:
            writer.write(batch, query=query, batch=offset)
        else:
            writer.advance(watermark)
        start = offset + 1
        sent(start)
    return start


def send_dead_log(reach: dict, job: str, channel: str, node: str, directory: Path, start: int) -> int:
    """The committed rest of a dead node's forward log (its recovery cut it back to its latest
    checkpoint), sent from ``start`` (its run's first offset) by the driver once the node's key
    groups are restored: whatever was sent before is dropped where it was taken. Returns the
    batches sent."""

    try:
        log = ChannelLog(directory, create=False)
    except LookupError:
        return 0
    try:
        start = max(start, log.start_offset)
        end = log.readable_end
        if end <= start:
            return 0
        writer = _writer(reach, job, channel, node)
        try:
            return send(writer, log, node, start, end) - start
        finally:
            writer.close(done=False)  # its split stays until what its key groups redo is sent
    finally:
        log.close()


def close_split(reach: dict, job: str, channel: str, node: str) -> None:
    """A dead node's forward split (event time) ends for good: its key groups' records since its
    checkpoint came again through the nodes that restored them."""
    writer = _writer(reach, job, channel, node)
    writer.advance(-(2**63))  # it speaks, holding nothing back, then closes
    writer.close()


class Forwarder:
    """Sends what node ``node``'s forward log at ``directory`` holds, once committed, into the
    forward's input channel ``channel`` of ``job``, from ``start`` (where this run of the job
    begins in the log) on; in order, again after a failure (the receivers drop what they took)."""

    def __init__(self, job: str, node: str, channel: str, reach: dict, directory: Path, start: int):
        self.job, self.node, self.channel, self.reach = job, node, channel, reach
        self.directory = directory
        self.sent = start  # every batch before it was taken by its key groups' owners
        self.held = False  # a handoff or a recovery holds it (see the module's docstring)
        self.error: BaseException | None = None  # the latest failed write's, until one succeeds
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"forwarder {channel}", daemon=True)
        self._thread.start()

    def hold(self, held: bool) -> None:
        with self.changed:
            self.held = held
            self.changed.notify_all()

    def drained(self) -> bool:
        """Whether it sent the whole log, which ended (its producing operator ended here)."""
        try:
            log = ChannelLog(self.directory, create=False)
        except LookupError:
            return False
        try:
            return log.ended and self.sent >= log.end_offset
        finally:
            log.close()

    def wait_sent(self, timeout: float) -> None:
        """Return once it sent every batch committed now (TimeoutError after ``timeout``)."""
        try:
            log = ChannelLog(self.directory, create=False)
        except LookupError:
            return
        try:
            target = log.readable_end
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.sent < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"the forwarder of {self.channel!r} on node {self.node} sent up to {self.sent} "
                        f"of {target}: {self.error!r}"
                    )
                self.changed.wait(min(left, 0.05))

    def close(self) -> None:
        self._stop.set()
        with self.changed:
            self.changed.notify_all()
        self._thread.join(30)

    def _sent(self, offset: int) -> None:
        with self.changed:
            self.sent = offset
            self.changed.notify_all()

    def _run(self) -> None:
        log = writer = None
        try:
            while not self._stop.is_set():
                if log is None:
                    try:
                        log = ChannelLog(self.directory, create=False)
                        log.register(READER, self.sent)
                    except LookupError:  # the job's sink has not opened it yet
                        self._stop.wait(POLL_S)
                        continue
                end = log.readable_end
                with self.changed:
                    if self.held or self.sent >= end:
                        self.changed.wait(POLL_S)
                        continue
                try:
                    writer = writer or _writer(self.reach, self.job, self.channel, self.node)
                    send(writer, log, self.node, self.sent, end, self._sent)
                except Exception as e:  # a node gone or restoring: send again (dropped where taken)
                    self.error = e
                    if writer is not None:
                        writer.close(done=False)
                    writer = None
                    self._stop.wait(RETRY_S)
                    continue
                self.error = None
                log.commit(READER, self.sent)
        finally:
            if writer is not None:
                writer.close(done=False)
            if log is not None:
                log.close()


def _writer(reach: dict, job: str, channel: str, node: str):
    """A writer of node ``node``'s forward log (its split, with event time)."""
    from stretch.cluster.tls import ClusterTLS
    from stretch.cluster.writer import ClusterWriter

    tls = reach.get("tls")
    return ClusterWriter(
        reach["address"],
        job,
        channel,
        secret=reach.get("secret"),
        tls=ClusterTLS.from_json(tls) if tls else None,
        split=split_of(node),
    )
