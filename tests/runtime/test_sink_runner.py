"""Job-side sinks of a checkpointed job hold their output until a checkpoint covers it: what they
hold must survive the sink gate reusing its memory, and any writer (one with a ``commit`` method of
its own included) gets every record once."""

from __future__ import annotations

import random

from stretch.common import Types
from stretch.common.records import from_batch
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import Sink
from stretch.datastream.connectors.base import SinkWriter

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])
N = 200_000


def _env() -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing()  # on demand only: the sinks hold everything until the end
    env.engine_config.sink_gate_bytes = 1 << 20  # the output wraps the sink gate several times
    return env


def _doubled(env):
    return env.from_collection([(i % 13, i) for i in range(N)], PAIR).map(
        lambda r: (r[0], 2 * r[1]), output_type=PAIR
    )


def test_output_held_for_a_checkpoint_survives_the_sink_gate_reusing_its_memory():
    with _doubled(_env()).execute_and_collect(f"held-{random.randrange(1 << 40):x}") as results:
        got = sorted(tuple(r) for r in results)
    assert got == sorted((i % 13, 2 * i) for i in range(N))


class _Committing(SinkWriter):
    """A user's writer with a commit step of its own (as a database writer would have)."""

    def __init__(self, store: dict):
        self.store, self.pending = store, []

    def write(self, batch, producer: int) -> None:
        self.pending.extend(tuple(r) for r in from_batch(batch))

    def commit(self) -> None:
        self.store.setdefault("rows", []).extend(self.pending)
        self.pending = []

    def close(self) -> None:
        self.commit()


class _CommittingSink(Sink):
    def __init__(self):
        self.store: dict = {}

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        return _Committing(self.store)


def test_a_users_writer_with_a_commit_method_of_its_own_is_an_ordinary_sink():
    env = _env()
    sink = _CommittingSink()
    _doubled(env).sink_to(sink)
    assert env.execute_async(f"committing-{random.randrange(1 << 40):x}").wait(60).name == "FINISHED"
    assert sorted(sink.store["rows"]) == sorted((i % 13, 2 * i) for i in range(N))
