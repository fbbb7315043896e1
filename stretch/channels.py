"""Write to a running job's input channels and read its output channels, from any process.

>>> writer = open_writer(job, "clicks")          # job: a JobClient, a job id (prefix) or name
>>> writer.write([("alice", 3), ("bob", 1)])       # records, or a pyarrow RecordBatch / Table
>>> writer.end()                                   # end of stream: the job's input is complete
>>> for record in open_reader(job, "totals"):      # in order, until the job's output ends
...     print(record)

Only the request to join goes through the job's control socket. Input data moves through the
channel's shared-memory log directly; output channels are durable logs of Arrow files under the
job's state directory (``stretch.runtime.channel_log``), read by offset, with their live end in
shared memory so that readers wake as soon as the job appends.
"""

from __future__ import annotations

import pyarrow as pa

from stretch.common.records import from_batch, schema_for, to_batch
from stretch.common.typeinfo import TypeInformation
from stretch.runtime.chain import KG_COLUMN, resolve_field
from stretch.runtime.channel_log import ChannelLog, LogTail
from stretch.runtime.control_socket import request, running_jobs
from stretch.runtime.gate import Gate, GateClosed
from stretch.runtime.state_dir import channel_dir
from stretch.state import _hash_kernels
from stretch.state.key_groups import key_groups_of


def _socket_of(job) -> str:
    coordinator = getattr(job, "_coordinator", None)
    if coordinator is not None:
        return str(coordinator.socket_path)
    if isinstance(job, str):
        for info in running_jobs():
            if info["job_id"].startswith(job) or info["name"] == job:
                return info["socket"]
        raise LookupError(f"no running stretch job {job!r} on this machine (see `stretch jobs`)")
    raise TypeError(f"job must be a JobClient, a job id or a job name, got {job!r}")


def _join(job, name: str, role: str) -> tuple[str, dict]:
    sock = _socket_of(job)
    try:
        reply = request(sock, {"op": "channel", "name": name, "role": role})
    except (ConnectionError, FileNotFoundError) as e:
        raise LookupError(f"the job at {sock} is not running any more") from e
    if not reply.get("ok"):
        raise LookupError(reply.get("error", "channel refused"))
    return sock, reply


class ChannelAppender:
    """Appends batches to an input channel's gate, given the job's reply to a writer's join."""

    def __init__(self, name: str, reply: dict):
        self.name = name
        self._gate = Gate.attach(reply["segment"])
        self.type_info = TypeInformation.from_json(reply["type"]) if reply["type"] else None
        self.schema = schema_for(self.type_info) if self.type_info is not None else None
        # When the job keys the channel by a field right away, this writer is the keyed operator's
        # producer: it computes the key groups and appends to the operator's gate directly.
        self._key_field = reply.get("key_field")
        self._max_parallelism = reply.get("max_parallelism")
        self._producer = reply.get("producer", 0)
        if self._key_field is not None:
            _hash_kernels.warm_up()  # compile (or load) the key-group kernels now, not on the first write

    def write(self, data) -> None:
        """Append records (a list), or a pyarrow RecordBatch/Table whose schema fits the channel."""
        if isinstance(data, pa.Table):
            for batch in data.to_batches():
                self.write(batch)
            return
        if isinstance(data, pa.RecordBatch):
            batch = data
            if self.schema is not None and not batch.schema.remove_metadata().equals(
                self.schema.remove_metadata()
            ):
                raise ValueError(
                    f"batch schema does not match channel {self.name!r}:\n  batch:   {batch.schema.remove_metadata()}"
                    f"\n  channel: {self.schema.remove_metadata()}"
                )
        else:
            batch = to_batch(list(data), self.type_info)
        if batch.num_rows:
            if self._key_field is not None:
                column = batch.column(resolve_field(batch.schema, self._key_field))
                batch = batch.append_column(
                    KG_COLUMN, pa.array(key_groups_of(column, self._max_parallelism), pa.uint16())
                )
            try:
                self._gate.append_batch(batch, producer=self._producer)
            except GateClosed:
                raise RuntimeError(f"the job reading channel {self.name!r} has stopped") from None


class ChannelWriter(ChannelAppender):
    """Appends records to a job's input channel (blocking while the channel is full)."""

    def __init__(self, job, name: str):
        self._socket, reply = _join(job, name, "writer")
        super().__init__(name, reply)

    def end(self) -> None:
        """Mark the end of the channel's stream: the job finishes once it has processed it."""
        request(self._socket, {"op": "channel_end", "name": self.name})

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.end()


def _reader_join(job, name: str) -> dict:
    """Where a reader finds the channel: the running job's answer, else the log the job kept."""
    coordinator = getattr(job, "_coordinator", None)
    if coordinator is not None:  # in the job's own process: ask it directly, during or after the run
        reply = coordinator._channel_request("channel", {"name": name, "role": "reader"})
        if not reply.get("ok"):
            raise LookupError(reply.get("error", "channel refused"))
        if coordinator.status.is_globally_terminal_state():
            reply["tail"] = None
        return reply
    if isinstance(job, str):
        job_name = job
        try:
            return _join(job, name, "reader")[1]
        except LookupError as e:
            if "no channel" in str(e):
                raise
    else:
        raise TypeError(f"job must be a JobClient, a job id or a job name, got {job!r}")
    path = channel_dir(job_name, name)
    if not (path / "index").exists():
        raise LookupError(f"no running stretch job {job_name!r} and no channel {name!r} kept for it")
    return {"log": str(path), "tail": None, "run_start": None}


class ChannelReader:
    """Reads a job's output channel in order, by offset: from the first result of the job's
    current run, or from ``from_offset`` (an offset of the channel's log, which outlives runs).

    While the job runs, a reader sleeps on the log's live tail in shared memory; after the run,
    ``job`` may be the job's name and the reader reads what the log retained.
    """

    def __init__(self, job, name: str, from_offset: int | None = None):
        self.name = name
        reply = _reader_join(job, name)
        self.log = ChannelLog(reply["log"], create=False)
        self._tail = None
        if reply["tail"]:
            try:
                self._tail = LogTail.attach(reply["tail"])
            except FileNotFoundError:  # the run ended just now: its log is complete
                pass
        start = reply["run_start"] if reply["run_start"] is not None else self.log.start_offset
        self.offset = start if from_offset is None else from_offset

    def read_batch(self, timeout: float | None = None) -> pa.RecordBatch | None:
        """The next batch, None at the end of the stream; TimeoutError if none came in time."""
        while True:
            if self.offset < self.log.readable_end:
                (batch,) = self.log.read(self.offset, self.offset + 1)
                self.offset += 1
                return batch
            tail = self._tail
            if tail is None or tail.state == LogTail.ENDED:
                if tail is None and not self.log.ended:
                    raise RuntimeError(f"the job producing channel {self.name!r} stopped before its end")
                if self.offset >= self.log.readable_end:
                    return None
                continue
            if tail.state == LogTail.FAILED:
                if self.offset >= self.log.readable_end:
                    raise RuntimeError(f"the job producing channel {self.name!r} stopped before its end")
                continue
            if not tail.wait(self.offset, timeout):
                raise TimeoutError(f"nothing arrived on channel {self.name!r} within {timeout} s")

    def close(self) -> None:
        self.log.close()
        if self._tail is not None:
            self._tail.close()
            self._tail = None

    def __iter__(self):
        try:
            while (batch := self.read_batch()) is not None:
                yield from from_batch(batch)
        finally:
            self.close()


def open_writer(job, name: str) -> ChannelWriter:
    return ChannelWriter(job, name)


def open_reader(job, name: str, from_offset: int | None = None) -> ChannelReader:
    return ChannelReader(job, name, from_offset)
