"""Exactly-once publishing of staged batches into a job's input channels (Spark's sink commits).

Outside writers that may retry (Spark tasks, replayed micro-batches) do not append to a channel
directly: they stage Arrow IPC files in the job's staging directory, and one commit request per
transaction, named ``(query, batch id)``, publishes all of its files in order. A transaction with
the query's last published batch id is Spark replaying it after a failure: it is only cleaned up,
so it does not reach the job twice. A lower batch id means the query's checkpoint was reset, and
is refused rather than dropped.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import deque
from pathlib import Path

import pyarrow as pa

from stretch.runtime.channel_writers import ChannelAppender


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
                appender = self._appenders.get(name)
                if appender is None:
                    reply = self._join_writer(name)
                    if not reply.get("ok"):
                        return reply
                    appender = self._appenders[name] = ChannelAppender(
                        name, reply, lambda schema: self._establish_shape(name, schema)
                    )
                batches = []  # every file read before any batch is appended: all or nothing
                for path in paths:
                    with pa.memory_map(str(path)) as source:
                        batches += [b for b in pa.ipc.open_stream(source)]
                self.published_at.append(time.monotonic())
                for batch in batches:
                    appender.write(batch)
                self._published[(name, query)] = batch_id
                return {"ok": True, "duplicate": False}
        finally:
            self.discard(files)

    def discard(self, files: list[str]) -> None:
        """Remove staged files (published, duplicate or aborted)."""
        for f in files:
            self._staged(f).unlink(missing_ok=True)

    def _staged(self, file: str) -> Path:
        path = Path(file).resolve()
        if path.parent != self.staging.resolve():
            raise ValueError(f"{file} is not in the job's staging directory {self.staging}")
        return path
