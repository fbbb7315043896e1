"""A node's readers of its jobs' file sources: one thread per job that asks the cluster's driver for
a split (a file), reads it into the job's source channels through ClusterWriters (each row to the
node owning its key group, this one included), says how far it got, and asks for the next (see
cluster.sources for the driver's side)."""

from __future__ import annotations

import contextlib
import threading
import time

from stretch.cluster.client import ClusterConnection
from stretch.cluster.source_feeder import PROGRESS_EVERY, FeedWriters, read_split
from stretch.cluster.tls import ClusterTLS


class SplitReader(threading.Thread):
    """Reads split after split of one job's file sources, until the driver has none left."""

    def __init__(self, node_id: str, order: dict):
        super().__init__(name=f"stretch-source-reader-{order['job']}", daemon=True)
        self.node_id = node_id
        self.job = order["job"]
        self.feeds = order["feeds"]  # feed index -> SourceFeed
        self.address, self.secret = order["address"], order["secret"]
        self.tls = ClusterTLS.from_json(order["tls"]) if order.get("tls") else None
        self.halt = threading.Event()
        self.current: tuple[str, int, int] | None = None  # (split, next item, position) being read

    def run(self) -> None:
        with contextlib.suppress(Exception):  # the driver went away: the cluster is closing
            self._read()

    def _read(self) -> None:
        driver = ClusterConnection(self.address, self.secret, self.tls)
        writers = FeedWriters(self.address, self.job, self.secret, self.tls)
        ask = {"job": self.job, "reader": self.node_id}
        try:
            while not self.halt.is_set():
                order = driver.driver_action("source_take", ask)
                if order.get("stop") or order.get("done"):
                    return
                if order.get("wait"):  # the others' splits: one comes back if its reader's node dies
                    self.halt.wait(PROGRESS_EVERY)
                    continue
                key = order["split"]
                feed = self.feeds[order["feed"]]
                source = dict(feed.parts)[order["id"]]
                self.current = (key, order["next"], order["position"])
                reported = time.monotonic()

                def progress(item: int, position: int, key=key) -> None:
                    nonlocal reported
                    self.current = (key, item, position)
                    if time.monotonic() - reported >= PROGRESS_EVERY:
                        reported = time.monotonic()
                        reply = driver.driver_action(
                            "source_progress", {**ask, "split": key, "next": item, "position": position}
                        )
                        if reply.get("stop"):
                            self.halt.set()

                try:
                    done = read_split(
                        feed,
                        source,
                        order["query"],
                        writers,
                        order["next"],
                        order["position"],
                        progress,
                        self.halt.is_set,
                    )
                except Exception as e:
                    driver.driver_action(
                        "source_failed", {**ask, "split": key, "error": f"{type(e).__name__}: {e}"}
                    )
                    return
                if not done:
                    return
                driver.driver_action("source_done", {**ask, "split": key})
                self.current = None
        finally:
            writers.close()
            driver.close()

    def stop(self) -> dict:
        """Stop after the item being written; returns how far the split being read got."""
        self.halt.set()
        self.join(60)
        if self.current is None:
            return {}
        key, item, position = self.current
        return {key: [item, position]}


class NodeSources:
    """The split readers of a node's jobs (actions ``source_read``, ``source_stop``)."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        self.readers: dict[str, SplitReader] = {}

    def start(self, order: dict) -> dict:
        old = self.readers.get(order["job"])
        if old is not None and old.is_alive():
            return {"ok": True}
        reader = self.readers[order["job"]] = SplitReader(self.node_id, order)
        reader.start()
        return {"ok": True}

    def stop(self, job: str) -> dict:
        reader = self.readers.pop(job, None)
        return {"progress": reader.stop() if reader is not None else {}}

    def stop_all(self) -> None:
        for job in list(self.readers):
            self.stop(job)
