"""A keyed operator far behind its input: the backlog scenarios of the rescale, update and
elasticity benchmarks share it.

A bounded W1 source (``DataGeneratorSource``) writes as fast as the operator's gate takes it, so
the gate stays full and the source waits with the rest of its input: the work left is known at
any moment (events not yet processed over the operator's rate). The operator is the per-record
KeyedProcessFunction of ``throughput.py`` (a count and a sum per key in two ValueStates): a user
scales it up because it falls behind.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
from throughput import CountSum

from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.datagen import DataGeneratorSource
from stretch.runtime import control_block as cbk

W1_TYPE = Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()])
KEYS = 100_000
OPERATOR = "count-sum"


def w1_rows(start: int, n: int) -> pa.RecordBatch:
    """W1 events start..start+n: keys spread over KEYS, a count of one, a value."""
    idx = np.arange(start, start + n, dtype=np.int64)
    keys = (idx * 2654435761) % KEYS
    return pa.record_batch({"f0": keys, "f1": np.ones(n, np.int64), "f2": (idx % 1000) / 1000.0})


def flat_out_job(
    name: str,
    parallelism: int,
    events: int,
    function=CountSum,
    checkpointing: bool = False,
    restore: bool = False,
    batch_rows: int = 4096,
):
    """The operator behind a source that writes ``events`` W1 events as fast as its gate takes
    them, in batches of ``batch_rows``."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    env.engine_config.spare_workers = 4
    if checkpointing:
        env.enable_checkpointing(None)
    source = DataGeneratorSource(
        batch_function=w1_rows, count=events, batch_rows=batch_rows, type_info=W1_TYPE
    )
    env.from_source(source, None, "w1").key_by(0).process(function(), W1_TYPE).name(OPERATOR).sink_to(
        DiscardingSink()
    )
    return env.execute_async(name, restore=restore)


class Progress(threading.Thread):
    """Samples the operator every millisecond: (time, events processed, parallelism, gate depth)."""

    def __init__(self, client, operator: str = OPERATOR):
        super().__init__(daemon=True)
        self.co = client._coordinator
        self.stage = self.co.plan.stage(operator)
        self.op = self.co.resources.keyed_index[self.stage.id]
        self.stop = threading.Event()
        self.samples: list[tuple[float, int, int, int]] = []

    def processed(self) -> int:
        # every instance slot ever used keeps its count
        return int(self.co.control.instances(self.op)[:, cbk.I_RECORDS_IN].sum())

    def run(self) -> None:
        gate = self.co.gates[self.stage.input_gate]
        while not self.stop.is_set():
            self.samples.append(
                (time.monotonic(), self.processed(), self.co.parallelism_of(self.stage.id), gate.depth())
            )
            time.sleep(0.001)

    def rate(self, t0: float, t1: float) -> float:
        """Events per second processed between two moments (from the samples nearest them)."""
        ts = np.array([s[0] for s in self.samples])
        done = np.array([s[1] for s in self.samples])
        i, j = np.searchsorted(ts, t0), min(np.searchsorted(ts, t1), len(ts) - 1)
        return float((done[j] - done[i]) / (ts[j] - ts[i])) if j > i else 0.0
