"""Named channels: a running job's input or output that other Python code writes or reads.

``ChannelSource(name)`` makes a job read whatever writers append to the channel until one of them
ends it; writers reach the job through its control socket (see ``stretch.channels``) and then move
data through shared memory directly. ``ChannelSink(name)`` appends the job's results to a durable
log under the job's state directory (``stretch.runtime.channel_log``) that readers read by offset,
during the run and after it.
"""

from __future__ import annotations

from stretch.common.typeinfo import TypeInformation
from stretch.contracts.connectors import Sink, SinkWriter, Source


def check_channel_name(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"a channel name must be a non-empty string without '/', got {name!r}")
    return name


class ChannelSource(Source):
    """The job's input is the channel ``name``; records must match ``type_info`` when given.

    ``durable``: the job logs what writers append under its state directory, in the order it
    reads it (``stretch.runtime.input_logger``); ``False`` saves that copy of every batch.
    """

    seekable = True  # in a checkpointed job its position is an offset of the channel's log
    bounded = False  # writers may append until the channel is ended

    def __init__(self, name: str, type_info: TypeInformation | None = None, durable: bool = True):
        self.channel_name = check_channel_name(name)
        self.type_info = type_info
        self.durable = durable

    def create_reader(self, context=None):
        """Runs in the job's worker, which knows where the channel's gate and log are."""
        return context.read_channel(self.channel_name)


class ChannelSink(Sink):
    """The job's output goes to the channel ``name``: a durable log that readers consume by offset
    (``stretch.channels.open_reader``, or Spark's ``format("stretch")``)."""

    def __init__(self, name: str):
        self.channel_name = check_channel_name(name)

    @property
    def name(self) -> str:
        return self.channel_name

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        raise RuntimeError("the job writes its output channels itself")
