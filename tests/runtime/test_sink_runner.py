"""Job-side sinks of a checkpointed job hold their output until a checkpoint covers it: what they
hold must survive the sink gate reusing its memory, and any writer (one with a ``commit`` method of
its own included) gets every record once."""

from __future__ import annotations

import random

import pytest

from stretch.common import Types
from stretch.common.batch_decoding import from_batch
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import Sink
from stretch.datastream.connectors.base import SinkWriter
from stretch.errors import JobExecutionError

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


class _Failing(SinkWriter):
    """A writer whose storage fails at the ``fail_at``-th batch (counting from 1)."""

    def __init__(self, fail_at: int):
        self.batches, self.fail_at = 0, fail_at

    def write(self, batch, producer: int) -> None:
        self.batches += 1
        if self.batches >= self.fail_at:
            raise OSError("disk on fire")

    def close(self) -> None:
        pass


class _FailingSink(Sink):
    def __init__(self, fail_at: int = 1, at_create: bool = False):
        self.fail_at, self.at_create = fail_at, at_create

    def create_writer(self, upstream_parallelism: int) -> SinkWriter:
        if self.at_create:
            raise ConnectionRefusedError("no database there")
        return _Failing(self.fail_at)


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("name", [None, "orders-db"])
def test_a_failing_sink_is_named_in_the_jobs_error_with_its_cause(checkpointed, name):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    if checkpointed:  # the sink holds its output until a checkpoint: it fails at the commit
        env.enable_checkpointing()
    sink = _doubled(env).sink_to(_FailingSink(fail_at=3))
    if name:
        sink.name(name)
    with pytest.raises(JobExecutionError) as info:
        env.execute(f"failing-sink-{random.randrange(1 << 40):x}")
    assert str(info.value) == f"sink {name or '_FailingSink'!r} failed: OSError: disk on fire"
    assert isinstance(info.value.__cause__, OSError) and str(info.value.__cause__) == "disk on fire"


def test_a_sink_whose_writer_cannot_be_made_is_named():
    env = StreamExecutionEnvironment.get_execution_environment()
    _doubled(env).sink_to(_FailingSink(at_create=True)).name("orders-db")
    with pytest.raises(
        JobExecutionError, match=r"^sink 'orders-db' failed: ConnectionRefusedError: no database"
    ) as info:
        env.execute(f"unmade-sink-{random.randrange(1 << 40):x}")
    assert isinstance(info.value.__cause__, ConnectionRefusedError)
