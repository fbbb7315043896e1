"""The two ends of a forward's channel (cluster.rekey_plans), which the driver gives since a
forward has writers on every node (each instance of its producing operator), so no single writer
can begin or end it as an outside writer does its split.

- Its start, with event time: when the job starts on a node, every node hears of that node's
  instances as splits at the least watermark (placeholders, ``split_name``), before any row
  comes, so no node's watermark passes an instance that has not spoken yet (in Flink every input
  channel holds the watermark back from the start). An instance's writer takes its place.
- Its end: once the operator producing into it ended on every node the job runs on, every
  instance there has sent all it forwarded, so the channel is ended on every node, and the next
  operator ends there once it processed it. The driver asks the nodes a few times a second while
  a job with forwards has some not ended; a node that joins later gets the ends already given.
"""

from __future__ import annotations

import contextlib
import threading

from stretch.cluster.forward_log import split_of
from stretch.cluster.forward_sink import split_name
from stretch.cluster.rekey_plans import Forward
from stretch.runtime.event_time import MIN_WATERMARK

POLL_S = 0.1


class ForwardEnds:
    """The forwards of the jobs of ``cluster`` (a StretchCluster), and which were ended."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.forwards: dict[str, list[Forward]] = {}  # job -> its forwards
        self.ended: dict[str, set[str]] = {}  # job -> the channels of its forwards ended everywhere
        self.lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, job: str, forwards: list[Forward]) -> None:
        """Watch the forwards of ``job``, which started on every node (before any row comes)."""
        if not forwards:
            return
        self._announce(job, forwards, list(self.cluster.nodes))
        with self.lock:
            self.forwards[job], self.ended[job] = list(forwards), set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="stretch-forward-ends", daemon=True)
                self._thread.start()

    def ran_on(self, job: str, nodes: list[str]) -> None:
        """``job`` runs on ``nodes`` now: their splits are announced, and the forwards ended already
        end there too."""
        with self.lock:
            ended = sorted(self.ended.get(job, ()))
            running = [f for f in self.forwards.get(job, ()) if f.channel not in ended]
        self._announce(job, running, nodes)
        for node in nodes:
            for channel in ended:
                self._end(node, job, channel)

    def _announce(self, job: str, forwards: list[Forward], producers: list[str]) -> None:
        """Every node hears of the splits of the instances on ``producers`` of each event-time
        forward, at the least watermark (a node that has heard from an instance already keeps
        what it said)."""
        splits = [
            {"job": job, "channel": f.channel, "writer": split, "watermark": MIN_WATERMARK}
            for f in forwards
            if f.timed
            for producer in producers
            for split in _splits(f, producer)
        ]
        for node in list(self.cluster.nodes) if splits else ():
            for body in splits:
                with contextlib.suppress(Exception):  # a node gone: nothing to hold back there
                    self.cluster.connection.action(node, "watermark", body)

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _watch(self) -> None:
        while not self.cluster.stopping.wait(POLL_S):
            with self.lock:
                pending = {
                    job: [f for f in fs if f.channel not in self.ended[job]]
                    for job, fs in self.forwards.items()
                }
            for job, forwards in pending.items():
                if forwards:
                    self._check(job, forwards)

    def _check(self, job: str, forwards: list[Forward]) -> None:
        """End the forwards of ``job`` whose producing operator ended on every node; stop
        watching a job cancelled or failed anywhere."""
        nodes = list(self.cluster.nodes)
        ended: set[str] | None = None
        for node in nodes:
            try:
                reply = self.cluster.connection.action(node, "ended_operators", {"job": job})
            except Exception:  # a node gone or not up yet: ask again
                return
            if reply["status"] in ("CANCELED", "FAILED"):
                with self.lock:
                    self.forwards.pop(job, None)
                return
            if reply["status"] is None:  # the job is not there yet
                return
            ended = set(reply["ended"]) if ended is None else ended & set(reply["ended"])
        for forward in forwards:
            if ended and forward.source in ended:
                for node in nodes:
                    self._end(node, job, forward.channel)
                with self.lock:
                    self.ended[job].add(forward.channel)

    def _end(self, node: str, job: str, channel: str) -> None:
        with contextlib.suppress(Exception):  # ended already, or the node is gone
            self.cluster.connection.action(node, "end", {"job": job, "channel": channel})


def _splits(forward: Forward, producer: str) -> list[str]:
    """The input splits of the next operator a forward has on node ``producer``: one per
    instance, or one for the node's log (a checkpointed job's: cluster.forward_log)."""
    if forward.logged:
        return [split_of(producer)]
    return [split_name(producer, i) for i in range(1, forward.parallelism + 1)]
