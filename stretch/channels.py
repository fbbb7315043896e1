"""Write to a running job's input channels and read its output channels, from any process.

>>> writer = open_writer(job, "clicks")          # job: a JobClient, a job id (prefix) or name
>>> writer.write([("alice", 3), ("bob", 1)])       # records, or a pyarrow RecordBatch / Table
>>> writer.end()                                   # end of stream: the job's input is complete
>>> for record in open_reader(job, "totals"):      # in order, until the job's output ends
...     print(record)

Only the request to join goes through the job's control socket; the data moves through the
channel's shared-memory log directly.
"""

from __future__ import annotations

import json

import pyarrow as pa

from stretch.common.records import from_batch, schema_for, to_batch
from stretch.common.typeinfo import TypeInformation
from stretch.runtime.chain import KG_COLUMN, resolve_field
from stretch.runtime.control_socket import request, runtime_dir
from stretch.runtime.gate import Gate, GateClosed, Kind
from stretch.state import _hash_kernels
from stretch.state.key_groups import key_groups_of


def _socket_of(job) -> str:
    coordinator = getattr(job, "_coordinator", None)
    if coordinator is not None:
        return str(coordinator.socket_path)
    if isinstance(job, str):
        for path in runtime_dir().glob("*.json"):
            try:
                info = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
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
                self._gate.append_batch(batch)
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


class ChannelReader:
    """Iterates over a job's output channel in order; ends when the job's output ends."""

    def __init__(self, job, name: str):
        self.name = name
        self._socket, reply = _join(job, name, "reader")
        self._gate = Gate.attach(reply["segment"])
        self._seq = self._gate.cursor(0)
        self._done = False

    def read_batch(self, timeout: float | None = None) -> pa.RecordBatch | None:
        """The next batch (a copy), None at the end of the stream; TimeoutError if none came in time."""
        while not self._done:
            try:
                if not self._gate.wait(self._seq, timeout=timeout):
                    raise TimeoutError(f"nothing arrived on channel {self.name!r} within {timeout} s")
            except GateClosed:
                raise RuntimeError(
                    f"the job producing channel {self.name!r} stopped before its end"
                ) from None
            entry = self._gate.read(self._seq, copy=True)  # the caller keeps it past the cursor
            batch = entry.batch
            self._seq += 1
            self._gate.advance(0, self._seq)
            if entry.kind is Kind.END_OF_STREAM:
                self._done = True
                request(self._socket, {"op": "channel_done", "name": self.name})
            elif batch is not None:
                return batch
        return None

    def __iter__(self):
        while (batch := self.read_batch()) is not None:
            yield from from_batch(batch)


def open_writer(job, name: str) -> ChannelWriter:
    return ChannelWriter(job, name)


def open_reader(job, name: str) -> ChannelReader:
    return ChannelReader(job, name)
