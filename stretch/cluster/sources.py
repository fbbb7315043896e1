"""The sources of a cluster's jobs, as the driver keeps them: each source's splits, who reads each
one and how far it got, and the end of a source's channels once all its splits are read.

As Flink's split enumerator does, the driver hands out splits and readers come for them: the
driver reads the splits of the sources it holds (a collection, a number sequence, a generator:
one split each) in a thread of its own per split; every node runs one reader per job for the
splits of its file sources (one per file), which asks the driver for the next split
(``source_take``) whenever it has read one (``source_done``), and says how far it got
(``source_progress``, at most every ``PROGRESS_EVERY`` seconds). A node that leaves the cluster
stops its reader first, which gives back its split with how far it got; a node that dies leaves
its split at the last progress it reported. Either way another reader goes on from there: the
rows it sends again are micro-batches that their key groups already took (cluster.source_feeder),
so they are dropped. With a checkpoint directory the progress is kept in
``<checkpoint_dir>/sources/<job>.json`` as well, where a restarted driver goes on from it.

Once every split of a source is read, its channels are ended on every node (and on a node that
joins later, as soon as the job runs there): a job of bounded sources finishes by itself. A source
whose chained step fails fails the job (``cluster.failures``, and ``client.wait()`` raises).
"""

from __future__ import annotations

import contextlib
import json
import pickle
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from stretch.cluster.source_feeder import PROGRESS_EVERY, FeedWriters, read_split
from stretch.cluster.source_plans import DRIVER, NODES, SourceFeed
from stretch.common import user_code
from stretch.runtime.state_dir import job_dir_name, write_private


@dataclass
class _Split:
    key: str  # "<feed index>/<split id>"
    feed: int
    where: str  # DRIVER or NODES
    query: str  # the writers' query for its micro-batches
    next: int = 0  # the first item not known to be written whole
    position: int = 0  # the source's position there (records before it)
    reader: str | None = None
    done: bool = False
    read_by: list[str] = field(default_factory=list)  # every reader that took it, in turn


class JobSources:
    """The splits of one job's sources and their readers (see the module's docstring)."""

    def __init__(
        self, cluster, job: str, feeds: list[SourceFeed], store: Path | None = None, resume: bool = False
    ):
        self.cluster, self.job, self.feeds, self.store = cluster, job, feeds, store
        self.lock = threading.Lock()
        self.splits: dict[str, _Split] = {}
        for index, feed in enumerate(feeds):
            for split_id, _source in feed.parts:
                key = f"{index}/{split_id}"
                self.splits[key] = _Split(key, index, feed.where, f"{feed.name}/{split_id}")
        if resume and store is not None and store.exists():  # a restarted driver: how far the last got
            for key, (next_, position, done) in json.loads(store.read_text()).items():
                if key in self.splits:
                    split = self.splits[key]
                    split.next, split.position, split.done = next_, position, done
        self._saved_at = 0.0
        self.ended: set[int] = set()  # feeds whose channels were ended on every node
        self.readers: set[str] = set()  # nodes running a reader of this job
        self.stopped = False
        self.threads: list[threading.Thread] = []

    # ---- starting ----------------------------------------------------------------------------
    def start(self) -> None:
        """Read the driver's splits, start a reader on each node, and end at once the channels of
        sources that have nothing (left) to read."""
        for split in self.splits.values():
            if split.where == DRIVER and not split.done:
                split.reader = DRIVER
                split.read_by.append(DRIVER)
                t = threading.Thread(
                    target=self._read_here, args=(split,), name=f"stretch-source-{split.query}", daemon=True
                )
                self.threads.append(t)
                t.start()
        self.ran_on(self.cluster.nodes)
        for index in range(len(self.feeds)):
            self._check_done(index)

    def ran_on(self, nodes: list[str]) -> None:
        """The job runs on ``nodes`` now (it started there, or they joined): each reads splits
        of its file sources, and takes the end of the channels of sources read whole."""
        nodes_feeds = {i: f for i, f in enumerate(self.feeds) if f.where == NODES}
        with self.lock:
            ended = sorted(self.ended)
            pending = any(s.where == NODES and not s.done for s in self.splits.values())
            fresh = [n for n in nodes if n not in self.readers] if pending and not self.stopped else []
            self.readers.update(fresh)
        for node in nodes:
            self._end(node, ended)
        if fresh:
            body = user_code.dumps(
                {
                    "job": self.job,
                    "feeds": nodes_feeds,
                    "address": self._address(),
                    "secret": self.cluster.secret,
                    "tls": self.cluster.tls.to_json() if self.cluster.tls is not None else None,
                }
            )
            for node in fresh:
                self.cluster.connection.action(node, "source_read", body)

    def _address(self) -> str:
        """How a node's reader reaches the cluster: its directory where every node is on this
        host (its writers then send through shared memory where they can), else its URL."""
        return self.cluster.reach(self.job)["address"]

    def _read_here(self, split: _Split) -> None:
        """A split the driver holds, read in this thread."""
        feed = self.feeds[split.feed]
        source = dict(feed.parts)[split.key.split("/", 1)[1]]
        writers = FeedWriters(self.cluster.address, self.job)
        try:
            done = read_split(
                feed,
                source,
                split.query,
                writers,
                split.next,
                split.position,
                lambda item, position: self.progress(split.key, DRIVER, item, position),
                lambda: self.stopped,
            )
            if done:
                self.finished(split.key, DRIVER)
        except Exception as e:
            self.failed(split.key, DRIVER, f"{type(e).__name__}: {e}")
        finally:
            writers.close()

    # ---- what readers say ----------------------------------------------------------------------
    def act(self, kind: str, body: dict) -> dict:
        """A node reader's call to the driver (``source_take``, ``source_progress``,
        ``source_done``, ``source_failed``)."""
        reader = body["reader"]
        if kind == "source_take":
            return self.take(reader)
        if kind == "source_progress":
            return self.progress(body["split"], reader, body["next"], body["position"])
        if kind == "source_done":
            self.finished(body["split"], reader)
            return {"ok": True}
        if kind == "source_failed":
            self.failed(body["split"], reader, body["error"])
            return {"ok": True}
        raise LookupError(f"unknown source call {kind!r}")

    def take(self, reader: str) -> dict:
        """The next split a node's reader reads (``split``, ``feed``, ``id``, ``query``, ``next``,
        ``position``), or ``wait`` (others read the rest: one may come back), ``done`` or ``stop``."""
        with self.lock:
            if self.stopped:
                return {"stop": True}
            for split in self.splits.values():
                if split.where == NODES and not split.done and split.reader is None:
                    split.reader = reader
                    split.read_by.append(reader)
                    return {
                        "split": split.key,
                        "feed": split.feed,
                        "id": split.key.split("/", 1)[1],
                        "query": split.query,
                        "next": split.next,
                        "position": split.position,
                    }
            if all(s.done for s in self.splits.values() if s.where == NODES):
                return {"done": True}
            return {"wait": True}

    def progress(self, key: str, reader: str, next_: int, position: int) -> dict:
        """Items before ``next_`` of split ``key`` are written whole; ``stop`` tells its reader
        to stop (the job was cancelled or failed, or the split is no longer its)."""
        with self.lock:
            split = self.splits[key]
            if split.reader == reader and next_ > split.next:
                split.next, split.position = next_, position
                self._save(force=False)
            return {"stop": self.stopped or split.reader != reader}

    def finished(self, key: str, reader: str) -> None:
        with self.lock:
            split = self.splits[key]
            if split.reader != reader or split.done:
                return
            split.done, split.reader = True, None
            self._save()
        self._check_done(split.feed)

    def failed(self, key: str, reader: str, error: str) -> None:
        """A split could not be read (a chained step failed, the nodes refused its rows): the
        job fails on every node, as when a node's copy of it fails."""
        with self.lock:
            if self.stopped:  # a reader stopped by the failure or cancel before it
                return
            self.stopped = True
        feed = self.feeds[self.splits[key].feed]
        where = "the driver" if reader == DRIVER else f"node {reader}"
        self.cluster.failures.setdefault(
            self.job, {"node": reader, "error": f"its source {feed.name!r} failed, read on {where}: {error}"}
        )
        for node in self.cluster.nodes:
            with contextlib.suppress(Exception):
                self.cluster.connection.action(node, "cancel", {"job": self.job})

    # ---- nodes that go -------------------------------------------------------------------------
    def release(self, node: str, progress: dict | None = None) -> None:
        """``node`` reads no split any more (it left, or died): its split goes to the next reader
        that asks, from the progress its reader gave back on leaving, else the last it reported."""
        with self.lock:
            self.readers.discard(node)
            for key, (next_, position) in (progress or {}).items():
                split = self.splits[key]
                if split.reader == node and next_ > split.next:
                    split.next, split.position = next_, position
            for split in self.splits.values():
                if split.reader == node:
                    split.reader = None
            self._save()

    def stop(self) -> None:
        """No split is read any more (the job was cancelled, or the cluster closes)."""
        with self.lock:
            self.stopped = True
        for t in self.threads:
            t.join(30)

    # ---- the end of a source -------------------------------------------------------------------
    def _check_done(self, index: int) -> None:
        """Every split of source ``index`` read: end its channels on every node the job runs on."""
        with self.lock:
            if index in self.ended or self.stopped:
                return
            if not all(s.done for s in self.splits.values() if s.feed == index):
                return
            self.ended.add(index)
            nodes = self.cluster.nodes
        for node in nodes:
            self._end(node, [index])

    def _end(self, node: str, feeds: list[int]) -> None:
        for index in feeds:
            for channel in self.feeds[index].channels:
                with contextlib.suppress(Exception):  # not there yet (ran_on ends it), or ended
                    self.cluster.connection.action(node, "end", {"job": self.job, "channel": channel})

    def _save(self, force: bool = True) -> None:
        """How far each split got, for a restarted driver (the caller holds the lock): at most
        every ``PROGRESS_EVERY`` seconds as it reads, and whenever a split ends or changes hands."""
        now = time.monotonic()
        if self.store is not None and (force or now - self._saved_at >= PROGRESS_EVERY):
            self._saved_at = now
            state = {k: [s.next, s.position, s.done] for k, s in self.splits.items()}
            write_private(self.store, json.dumps(state))


class ClusterSources:
    """The jobs' sources of one cluster (``cluster.sources``): the driver's hooks into them."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.jobs: dict[str, JobSources] = {}

    def store(self, job: str) -> Path:
        """Where a checkpointed job's progress is kept, in the checkpoint directory."""
        directory = Path(self.cluster.checkpoint_dir) / "sources"
        directory.mkdir(mode=0o700, exist_ok=True)
        return directory / f"{job_dir_name(job)}.json"

    def _feeds_file(self, job: str) -> Path:
        """Where a checkpointed job's sources are kept for a restarted driver (next to its spec)."""
        return self.cluster.directory / "jobs" / f"{job_dir_name(job)}.sources"

    def start(self, job: str, feeds: list[SourceFeed], checkpointed: bool) -> None:
        """Start reading a job's sources (it runs on every node already); a checkpointed job's
        are kept, and so is how far they got, for a driver restarted after this one died."""
        if not feeds:
            return
        store = None
        if checkpointed:
            write_private(self._feeds_file(job), user_code.dumps(feeds))
            store = self.store(job)
            store.unlink(missing_ok=True)  # an earlier cluster's run of the name
        sources = self.jobs[job] = JobSources(self.cluster, job, feeds, store)
        sources.start()

    def resume(self, jobs: list[str]) -> None:
        """A restarted driver: the checkpointed jobs' sources go on from how far they got (their
        key groups restored already, so what is read again is dropped where it was taken)."""
        for job in jobs:
            path = self._feeds_file(job)
            if path.exists():
                feeds = pickle.loads(path.read_bytes())
                sources = self.jobs[job] = JobSources(self.cluster, job, feeds, self.store(job), resume=True)
                sources.start()

    def act(self, kind: str, body: dict) -> dict:
        sources = self.jobs.get(body["job"])
        if sources is None:
            return {"stop": True}
        return sources.act(kind, body)

    def ran_on(self, job: str, nodes: list[str]) -> None:
        if job in self.jobs:
            self.jobs[job].ran_on(nodes)

    def leaving(self, node: str) -> None:
        """A node about to be removed: its readers stop and give their splits back."""
        for name, sources in self.jobs.items():
            if node in sources.readers:
                reply = self.cluster.connection.action(node, "source_stop", {"job": name})
                sources.release(node, reply.get("progress"))

    def lost(self, node: str) -> None:
        """A node that died: its splits go to other readers from their last progress."""
        for sources in self.jobs.values():
            sources.release(node)

    def cancel(self, job: str) -> None:
        if job in self.jobs:
            self.jobs[job].stop()

    def close(self) -> None:
        """The cluster closes: no split is read any more; closed after it started (not died), its
        jobs end with it and nothing resumes them, so their kept sources and progress go."""
        for sources in self.jobs.values():
            sources.stop()
        if self.cluster.started and self.cluster.checkpoint_dir is not None:
            for job in self.jobs:
                self._feeds_file(job).unlink(missing_ok=True)
                self.store(job).unlink(missing_ok=True)
