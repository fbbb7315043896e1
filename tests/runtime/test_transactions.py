"""Stage transactions: each returns exactly the results its own input caused, once, whatever the
parallelism, the concurrency of transactions, rescales and replays."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest

from stretch import channels, jobs
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


STAGE_JOB_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from stretch.datastream import StreamExecutionEnvironment
    from tests.runtime.test_transactions import checkpointed_sums

    client = checkpointed_sums(sys.argv[1], restore=False)
    print("ready", flush=True)
    time.sleep(120)
    """
)


def start_job_script(tmp_path, text: str, name: str) -> subprocess.Popen:
    """Run a job script (``text``) in a process of its own, as a user's driver would be."""
    script = tmp_path / "job.py"
    script.write_text(text)
    return subprocess.Popen(
        [sys.executable, str(script), name],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )


def checkpointed_sums(name: str, restore: bool):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(20)
    env.get_checkpoint_config().set_min_pause_between_checkpoints(0)
    src = env.from_source(ChannelSource("in", PAIR), None, "in")
    src.key_by(lambda r: r[0]).sum(1).name("sums").sink_to(ChannelSink("out"))
    return env.execute_async(name, restore=restore)


@pytest.mark.parametrize("kill_after_ms", [0, 5, 40])
def test_a_restored_job_answers_a_restarted_querys_replay_exactly_once(tmp_path, kill_after_ms):
    """The job's process is killed while a micro-batch's second task publishes (before it is
    logged, part-way, or after); the restored job answers the restarted query's replay of that
    micro-batch: the first task gets its first answer again, the second its input applied once."""
    name = f"txn-restore-{uuid.uuid4().hex[:10]}"
    proc = start_job_script(tmp_path, STAGE_JOB_SCRIPT, name)
    inputs = {
        (b, p): [((b * 5 + p * 3 + i) % 13, 1 + (b + p + i) % 7) for i in range(2000)]
        for b in range(6)
        for p in range(2)
    }
    answers: dict = {}
    try:
        assert proc.stdout.readline().strip() == "ready"
        job = jobs.find(name)
        staging = job.join_channel("in", "writer")["staging"]
        for b in range(3):
            for p in range(2):
                answers[(b, p)] = _publish(job, staging, inputs[(b, p)], ("q", b, p))[0]
        first = answers[(2, 0)]
        del answers[(2, 1)]  # the query had not committed micro-batch 2: it is replayed

        def second_task() -> None:
            try:
                _publish(job, staging, inputs[(2, 1)], ("q", 2, 1))
            except Exception:
                pass  # the job died under it: the task fails

        task = threading.Thread(target=second_task)
        task.start()
        time.sleep(kill_after_ms / 1000)
    finally:
        proc.kill()
        proc.wait(30)
    task.join(60)
    client = checkpointed_sums(name, restore=True)
    try:
        job = jobs.find(client)
        staging = job.join_channel("in", "writer")["staging"]
        for b in range(2, 6):  # the restarted query replays micro-batch 2, then goes on
            for p in range(2):
                answers[(b, p)] = _publish(job, staging, inputs[(b, p)], ("q", b, p))[0]
        assert answers[(2, 0)] == first
        channels.open_writer(client, "in").end()
        assert client.wait(60).name == "FINISHED"
        log = sorted(tuple(r) for r in channels.open_reader(name, "out", from_offset=0))
    finally:
        client.cancel()
    by_key: dict = {}
    for key, records in inputs.items():
        assert sorted(k for k, _ in answers[key]) == sorted(k for k, _ in records)
        for k, v in answers[key]:
            by_key.setdefault(k, []).append(v)
    totals: dict = {}
    for records in inputs.values():
        for k, v in records:
            totals[k] = totals.get(k, 0) + v
    for k, sums in by_key.items():  # running sums: distinct, as many as the key's records, up to its total
        assert len(set(sums)) == len(sums) and max(sums) == totals[k]
    assert log == sorted((k, v) for k, sums in by_key.items() for v in sums)  # the log: each result once


HALF_TXN_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from stretch import channels
    from tests.runtime.test_transactions import checkpointed_sums

    client = checkpointed_sums(sys.argv[1], restore=False)
    writer = channels.open_writer(client, "in")
    writer.write([(1, 10), (2, 20)])  # plain input, then half a transaction: its end never comes
    writer.write([(1, 1000), (3, 3000)], txn=7)
    while client.describe()["operators"][0]["records_in"] < 4:
        time.sleep(0.01)
    print("ready", flush=True)
    time.sleep(120)
    """
)


def test_a_transaction_whose_end_the_dead_run_never_logged_is_not_replayed(tmp_path):
    name = f"txn-half-{uuid.uuid4().hex[:10]}"
    proc = start_job_script(tmp_path, HALF_TXN_SCRIPT, name)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.kill()
        proc.wait(30)
    client = checkpointed_sums(name, restore=True)
    try:
        writer = channels.open_writer(client, "in")
        writer.write([(1, 5)])
        writer.end()
        assert client.wait(60).name == "FINISHED"
        log = sorted(tuple(r) for r in channels.open_reader(name, "out", from_offset=0))
    finally:
        client.cancel()
    assert log == [(1, 10), (1, 15), (2, 20)]
