"""What every worker task shares: its assignment, the job's segments it attached, its outputs.

A worker runs a source task (``runtime.source_task``) or one instance of a keyed operator
(``runtime.keyed_instance``); ``runtime.worker`` picks which.
"""

from __future__ import annotations

from dataclasses import dataclass

from stretch.contracts.metrics import MetricGroup
from stretch.plan.stages import StageSpec
from stretch.runtime.broadcast_board import BroadcastBoard
from stretch.runtime.channel_source import read_channel
from stretch.runtime.control_block import ControlBlock
from stretch.runtime.gate import Gate
from stretch.runtime.outputs import Outputs
from stretch.runtime.resources import JobResources
from stretch.state.arena import Arena
from stretch.state.keyed_table import KeyedTable


@dataclass
class Assignment:
    """A task for a worker: which stage, which instance, and the job's segments."""

    resources: JobResources
    stage: StageSpec
    index: int = 0
    epoch: int = 0
    position: int = 0  # where a source restarts: the position its checkpoint recorded (Source.advance)
    start: int = 0  # the gate position where a keyed instance starts reading (runtime.frontier)
    code: int = 0  # a keyed operator's code version where the instance starts reading (live updates)


class Stopped(Exception):
    """The coordinator asked the task to stop."""


class _Attached:
    """Lazily attached segments of one job, shared by the tasks a worker runs."""

    def __init__(self, resources: JobResources):
        self.resources = resources
        self._gates: dict[str, Gate] = {}
        self.control = ControlBlock.attach(resources.control, resources.n_keyed, resources.max_parallelism)
        self._arenas: dict[str, Arena] = {}
        self._tables: dict[str, KeyedTable] = {}
        self._boards: dict[str, BroadcastBoard] = {}

    def attach_all(self) -> None:
        """Map every segment of the job now (spare workers do it before they are needed)."""
        for name in (
            *self.resources.gates.values(),
            *self.resources.sink_gates.values(),
            *self.resources.channels.values(),
        ):
            self.gate(name)
        self.populate()

    def populate(self) -> None:
        """Keep an idle worker's page tables covering the live state (it grows while we idle)."""
        for name in self.resources.arenas.values():
            if name not in self._tables:
                self._tables[name] = KeyedTable(self.arena(name))
            self._tables[name].populate()

    def gate(self, name: str) -> Gate:
        g = self._gates.get(name)
        if g is None:
            g = self._gates[name] = Gate.attach(name)
        return g

    def board(self, name: str) -> BroadcastBoard:
        b = self._boards.get(name)
        if b is None:
            b = self._boards[name] = BroadcastBoard.attach(name)
        return b

    def arena(self, name: str) -> Arena:
        a = self._arenas.get(name)
        if a is None:
            a = self._arenas[name] = Arena.attach(name)
        return a


class Task:
    def __init__(self, assignment: Assignment, attached: _Attached, should_stop):
        self.a = assignment
        self.stage = assignment.stage
        self.res = assignment.resources
        self.attached = attached
        self.should_stop = should_stop
        self.op_index = self.res.keyed_index.get(self.stage.id, -1)
        self._records_out = 0
        self.metrics = MetricGroup()  # the user functions' metrics, which the worker reports

    def outputs(self, producer: int) -> Outputs:
        gates = {g: self.attached.gate(n) for g, n in self.res.gates.items()}
        sink_gates = {s: self.attached.gate(n) for s, n in self.res.sink_gates.items()}
        outputs = Outputs(gates, sink_gates, self.res.sinks, producer, self._count_out)
        if self.res.dead_letter_sink is not None:
            outputs.dead_letter_gate = sink_gates[self.res.dead_letter_sink]
        return outputs

    def channel_gate(self, name: str) -> Gate:
        """An input channel's gate."""
        return self.attached.gate(self.res.channels[name])

    def read_channel(self, name: str):
        """A ChannelSource's batches (see ``runtime.channel_source``)."""
        return read_channel(self, name)

    def _count_out(self, n: int) -> None:
        self._records_out += n
