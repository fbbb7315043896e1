"""Stage transactions: each returns exactly the results its own input caused, once, whatever the
parallelism, the concurrency of transactions, rescales and replays."""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest

from stretch import jobs
from stretch.channels import OutputLog
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource

PAIR = Types.TUPLE([Types.LONG(), Types.LONG()])
SCHEMA = pa.schema([("f0", pa.int64()), ("f1", pa.int64())])


def _start(name: str, direct: bool, parallelism: int = 2):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    src = env.from_source(ChannelSource("in", PAIR), None, "in")
    (src.key_by("f0") if direct else src.key_by(lambda r: r[0])).sum(1).name("sums").sink_to(
        ChannelSink("out")
    )
    return env.execute_async(name)


def _publish(job: jobs.Job, staging: str, records: list, txn: tuple) -> tuple[list, dict]:
    """Stage ``records`` as a Spark task would, publish them as transaction ``txn``; its results."""
    path = os.path.join(staging, f"{uuid.uuid4().hex}.arrows")
    batch = pa.RecordBatch.from_pylist([{"f0": k, "f1": v} for k, v in records], schema=SCHEMA)
    with pa.OSFile(path, "wb") as f, pa.ipc.new_stream(f, SCHEMA) as w:
        w.write_batch(batch)
    reply = job.publish_txn("in", "out", *txn, [path])
    with OutputLog(reply["log"]) as log:
        rows = [
            tuple(r.values()) for o in reply["offsets"] for b in log.read(o, o + 1) for r in b.to_pylist()
        ]
    return rows, reply


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_each_transaction_gets_the_results_of_its_own_input_in_order(direct, parallelism):
    client = _start(f"txn order {direct} {parallelism}", direct, parallelism)
    job = jobs.find(client)
    staging = job.join_channel("in", "writer")["staging"]
    sums: dict = {}
    try:
        for b in range(12):
            records = [((b * 7 + i) % 9, b * 100 + i) for i in range(40)]
            want = []
            for k, v in records:
                sums[k] = sums.get(k, 0) + v
                want.append((k, sums[k]))
            got, _ = _publish(job, staging, records, ("q", b, 0))
            assert sorted(got) == sorted(want)
    finally:
        client.cancel()


def test_a_replayed_transaction_gets_the_first_results_and_changes_no_state():
    client = _start("txn replay", direct=False)
    job = jobs.find(client)
    staging = job.join_channel("in", "writer")["staging"]
    try:
        first, reply = _publish(job, staging, [(1, 5), (2, 7)], ("q", 0, 3))
        assert not reply["duplicate"] and sorted(first) == [(1, 5), (2, 7)]
        again, reply = _publish(job, staging, [(1, 5), (2, 7)], ("q", 0, 3))  # a retried task
        assert reply["duplicate"] and again == first
        later, _ = _publish(job, staging, [(1, 1)], ("q", 1, 3))
        assert later == [(1, 6)]  # the replay was not applied again
        assert not os.listdir(staging)  # every staged file is cleaned up
    finally:
        client.cancel()


def test_concurrent_transactions_under_rescales_are_each_exact():
    client = _start("txn concurrent", direct=False, parallelism=2)
    job = jobs.find(client)
    staging = job.join_channel("in", "writer")["staging"]
    inputs = {p: [(i % 11, p * 1000 + i) for i in range(300)] for p in range(16)}
    stop = threading.Event()

    def rescale() -> None:
        n = 0
        while not stop.is_set():
            client.rescale("sums", [1, 3, 2][n % 3])
            n += 1

    rescaler = threading.Thread(target=rescale)
    rescaler.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            results = dict(
                zip(inputs, pool.map(lambda p: _publish(job, staging, inputs[p], ("q", 0, p))[0], inputs))
            )
    finally:
        stop.set()
        rescaler.join()
        client.cancel()
    for p, records in inputs.items():  # one result per input record, for the records' own keys
        assert sorted(k for k, _ in results[p]) == sorted(k for k, _ in records)
    final: dict = {}
    for rows in results.values():
        for k, v in rows:
            final[k] = max(final.get(k, 0), v)
    want: dict = {}
    for records in inputs.values():
        for k, v in records:
            want[k] = want.get(k, 0) + v
    assert final == want
