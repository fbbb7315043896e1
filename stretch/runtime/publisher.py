"""Exactly-once publishing of staged batches into a job's input channels.

Outside writers that may retry (Spark tasks, replayed micro-batches) do not append to a channel
directly: they stage Arrow IPC files in the job's staging directory, and one request per
transaction publishes all of its files in order, or nothing.

- Spark's sink (``format("stretch")``): a commit per micro-batch, named ``(query, batch id)``. A
  transaction with the query's last published batch id is Spark replaying it after a failure: it
  is only cleaned up, so it does not reach the job twice. A lower batch id means the query's
  checkpoint was reset, and is refused rather than dropped.
- The one-query stage (``stretch.spark.stage``): a transaction per task, named ``(query, batch id,
  partition)``, numbered and tagged (``runtime.transactions``); the request returns once the
  transaction's results are in the output channel, with their offsets. A task that Spark retries
  or replays gets the first attempt's results again, and its input never reaches the job twice,
  also after the job's process died and was restored (``restore``; see runtime.transactions).
"""

from __future__ import annotations

import itertools
import shutil
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from pathlib import Path

import pyarrow as pa

from stretch.runtime.channel_writers import ChannelAppender

_KEPT_TXNS = 4096  # stage transactions remembered for replays (a few micro-batches' tasks)


class ChannelPublisher:
    def __init__(self, staging: Path, join_writer, establish_shape):
        """``join_writer(name)`` is the job's reply to a writer joining channel ``name``;
        ``establish_shape(name, schema)`` the shape of an untyped channel (see ChannelAppender)."""
        self.staging = staging
        self._join_writer = join_writer
        self._establish_shape = establish_shape
        self._lock = threading.Lock()
        self._published: dict[tuple[str, str], int] = {}  # (channel, query) -> last batch id
        self._appenders: dict[str, ChannelAppender] = {}
        self._txns: OrderedDict[tuple, Future] = (
            OrderedDict()
        )  # (channel, query, batch, partition) -> results
        self._txn_numbers = itertools.count(time.time_ns() // 1000)  # unique across runs of the job
        self._replayed: dict[tuple, int] = {}  # a restored run's: transactions its input log replays
        self.published_at: deque[float] = deque(maxlen=100_000)  # when recent transactions began

    def create(self) -> None:
        self.staging.mkdir(parents=True, exist_ok=True, mode=0o700)

    def remove(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def publish(self, name: str, query: str, batch_id: int, files: list[str]) -> dict:
        paths = [self._staged(f) for f in files]
        try:
            with self._lock:
                last = self._published.get((name, query), -1)
                if batch_id == last:
                    return {"ok": True, "duplicate": True}  # Spark replays the batch it last committed
                if batch_id < last:
                    raise ValueError(
                        f"query {query!r} went back from micro-batch {last} to {batch_id}: its checkpoint "
                        "was reset; give the restarted query a new name (option 'query') or a new checkpoint"
                    )
                try:
                    appender = self._appender(name)
                except LookupError as e:
                    return {"ok": False, "error": str(e), "type": "LookupError"}
                batches = _read_all(paths)
                self.published_at.append(time.monotonic())
                for batch in batches:
                    appender.write(batch, round=f"{query}/{batch_id}")
                self._published[(name, query)] = batch_id
                return {"ok": True, "duplicate": False}
        finally:
            self.discard(files)

    def restore(self, answered: dict[tuple, dict], replayed: dict[tuple, int]) -> None:
        """A restored run: ``answered`` are the results of transactions its checkpoint covers,
        ``replayed`` the numbers of those its input log replays (keys: channel, query, batch,
        partition)."""
        for key, result in answered.items():
            done = self._txns[key] = Future()
            done.set_result(result)
        self._replayed.update(replayed)

    def publish_txn(
        self, name: str, txn_id: tuple, files: list[str], wait_results, output: str = "", named=None
    ) -> dict:
        """Publish one stage transaction (``txn_id``: query, batch id, partition; its results go
        to channel ``output``) and return what ``wait_results(number)`` says of its results; a
        transaction seen before is answered with the first attempt's results, and its files are
        only cleaned up. ``named(number, key)`` learns each transaction's number before it is
        published."""
        key = (name, *txn_id)
        with self._lock:
            first = self._txns.get(key)
            if first is None:
                first = self._txns[key] = Future()
                while len(self._txns) > _KEPT_TXNS:  # Spark replays only its latest micro-batch
                    self._txns.popitem(last=False)
                mine = True
                replayed = self._replayed.pop(key, None)
            else:
                mine = False
        if not mine:
            self.discard(files)
            return {**first.result(), "duplicate": True}
        try:
            if replayed is not None:  # the restored run replays it from its input log
                self.discard(files)
                result = wait_results(replayed)
                first.set_result(result)
                return {**result, "duplicate": True}
            number = next(self._txn_numbers)
            if named is not None:
                named(number, key)
            self._append_all(name, files, number, (*key, output))
            result = wait_results(number)
        except BaseException as e:
            with self._lock:
                self._txns.pop(key, None)  # nothing of it was published, or the job is ending
                if replayed is not None:
                    self._replayed[key] = replayed
            first.set_exception(e)
            raise
        first.set_result(result)
        return {**result, "duplicate": False}

    def _append_all(self, name: str, files: list[str], txn: int, marker: tuple) -> None:
        paths = [self._staged(f) for f in files]
        try:
            with self._lock:
                appender = self._appender(name)
            batches = _read_all(paths)
            for batch in batches:  # all of it fits, or none of it is published
                appender.check_fits(batch)
            self.published_at.append(time.monotonic())
            for batch in batches:
                appender.write(batch, txn, f"{marker[1]}/{marker[2]}")
            appender.end_txn(txn, marker)
        finally:
            self.discard(files)

    def _appender(self, name: str) -> ChannelAppender:
        appender = self._appenders.get(name)
        if appender is None:
            reply = self._join_writer(name)
            if not reply.get("ok"):
                raise LookupError(reply.get("error", f"no channel {name!r}"))
            appender = self._appenders[name] = ChannelAppender(
                name, reply, lambda schema: self._establish_shape(name, schema)
            )
        return appender

    def discard(self, files: list[str]) -> None:
        """Remove staged files (published, duplicate or aborted)."""
        for f in files:
            self._staged(f).unlink(missing_ok=True)

    def _staged(self, file: str) -> Path:
        path = Path(file).resolve()
        if path.parent != self.staging.resolve():
            raise ValueError(f"{file} is not in the job's staging directory {self.staging}")
        return path


def _read_all(paths: list[Path]) -> list[pa.RecordBatch]:
    """Every staged file's batches, all read before any is appended: all or nothing."""
    batches = []
    for path in paths:
        with pa.memory_map(str(path)) as source:
            batches += list(pa.ipc.open_stream(source))
    return batches
