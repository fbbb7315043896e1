"""The stretch command: demo, jobs, status, from a second process."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pyarrow.parquet as pq
import pytest

from stretch import jobs
from stretch.cli import main
from stretch.cluster import StretchCluster
from stretch.common import Types
from stretch.common.records import to_batch
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DataGeneratorSource, DiscardingSink, RateLimiterStrategy
from tests.cluster.jobs import PAIR, count_sum_job, reference


def stretch(*args, check=True):
    return subprocess.run(
        [sys.executable, "-m", "stretch.cli", *args], capture_output=True, text=True, timeout=300, check=check
    )


def test_jobs_and_status_of_a_running_job():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    src = DataGeneratorSource(
        lambda i: (i % 10, i),
        count=None,
        rate_limiter_strategy=RateLimiterStrategy.per_second(5000),
        type_info=Types.TUPLE([Types.LONG(), Types.LONG()]),
    )
    env.enable_metrics()
    env.from_source(src, None, "gen").key_by(lambda r: r[0]).sum(1).name("totals").sink_to(DiscardingSink())
    client = env.execute_async("cli test job")
    try:
        listing = stretch("jobs").stdout
        assert client.get_job_id() in listing and "cli test job" in listing
        (job,) = [
            j for j in json.loads(stretch("jobs", "--json").stdout) if j["job_id"] == client.get_job_id()
        ]
        assert job["name"] == "cli test job" and job["status"] == "RUNNING" and job["pid"] == os.getpid()
        assert job["metrics"].startswith("http://127.0.0.1:")
        assert "stretch_parallelism{" in urllib.request.urlopen(job["metrics"], timeout=10).read().decode()
        status = json.loads(stretch("status", client.get_job_id()[:10], "--json").stdout)
        assert status["status"] == "RUNNING"
        (op,) = status["operators"]
        assert op["name"] == "totals" and op["parallelism"] == 2 and op["epoch"] == 0
        rates = [i["rate"] for i in op["instances"]]
        assert 1000 < sum(rates) < 20000  # the source emits 5000 records/s
        assert all(0.0 <= i["busy"] <= 1.0 for i in op["instances"])
        text = stretch("status", "cli test job").stdout
        assert "operator 'totals': parallelism 2" in text
        missing = stretch("status", "no such job", check=False)
        assert missing.returncode != 0 and "no running stretch job" in missing.stderr
    finally:
        client.cancel()


@pytest.mark.long  # the suite keeps within its time: run with -m long
def small_demo(tmp_path, *args):
    """``stretch demo`` on 120 k clicks in 4 files, 2 a trigger, without a plot."""
    return stretch(
        "demo",
        *args,
        "--events",
        "120000",
        "--files",
        "4",
        "--files-per-trigger",
        "2",
        "--work-dir",
        str(tmp_path),
        "--no-plot",
        check=False,
    )


def test_demo_pipeline_spark_to_stretch_to_spark(tmp_path):
    """The demo's results, written by Spark, equal the windows computed here from its input."""
    run = small_demo(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "rescaled live 1 -> 2" in run.stdout and "rescaled live 2 -> 1" in run.stdout
    # quiet by default: Spark's log goes to a file, not into the demo's output
    assert " WARN " not in run.stdout + run.stderr and "log4j" not in run.stderr
    assert (tmp_path / "spark.log").stat().st_size > 0
    clicks = pq.read_table(tmp_path / "clicks").to_pylist()
    want: dict = {}
    for c in clicks:
        key = (c["user"], c["ts"] // 60_000 * 60_000)
        n, total = want.get(key, (0, 0.0))
        want[key] = (n + 1, total + c["amount"])
    # the windows the stream closed, written by the stage's query, and those the end of input closed
    rows = [
        r
        for part in ("streamed", "closed_at_end")
        for r in pq.read_table(tmp_path / "results" / part).to_pylist()
    ]
    got = {(r["key"], r["window_start"]): (r["count"], r["sum_amount"]) for r in rows}
    assert len(got) == len(rows)  # no window twice
    assert got.keys() == want.keys()
    assert all(got[k][0] == want[k][0] and abs(got[k][1] - want[k][1]) < 1e-6 for k in want)


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_demo_pipeline_across_nodes_with_a_node_added_and_one_removed(tmp_path):
    """`stretch demo --nodes 2`: the same query with the job on a local cluster, a node added and
    one removed live; every window once, equal to the windows computed here from the input, and
    those the query streamed a part of them."""
    run = small_demo(tmp_path, "--nodes", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "added a node" in run.stdout and "removed a node" in run.stdout
    assert "results match" in run.stdout
    clicks = pq.read_table(tmp_path / "clicks").to_pylist()
    windows = {(c["user"], c["ts"] // 60_000 * 60_000) for c in clicks}
    streamed = pq.read_table(tmp_path / "results" / "streamed").to_pylist()
    assert {(r["key"], r["window_start"]) for r in streamed} <= windows
    assert f"-> {len(windows):,} per-user windows" in run.stdout


def test_scale_from_a_second_process_and_its_errors():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    src = DataGeneratorSource(
        lambda i: (i % 10, i),
        count=None,
        rate_limiter_strategy=RateLimiterStrategy.per_second(5000),
        type_info=Types.TUPLE([Types.LONG(), Types.LONG()]),
    )
    env.from_source(src, None, "gen").key_by(lambda r: r[0]).sum(1).name("totals").sink_to(DiscardingSink())
    client = env.execute_async("cli scale job")
    job = client.get_job_id()
    try:
        out = stretch("scale", job, "totals", "4").stdout
        assert "rescaled 'totals' 2 -> 4" in out and "0 state bytes copied" in out
        assert client.describe()["operators"][0]["parallelism"] == 4
        for args, message in [
            (("no-such-job", "totals", "2"), "no running stretch job"),
            ((job, "nope", "2"), "no operator named 'nope'"),
            ((job, "totals", "0"), "parallelism must be an int in 1..128"),
            ((job, "totals", "129"), "parallelism must be an int in 1..128"),
        ]:
            result = stretch("scale", *args, check=False)
            assert result.returncode != 0 and message in result.stderr, (args, result.stderr)
            assert result.stderr.startswith("stretch: ") and result.stderr.count("\n") == 1
        unknown = stretch("scale", job, "nope", "2", check=False).stderr
        assert unknown == "stretch: no operator named 'nope' in this job (keyed operators: totals)\n"
    finally:
        client.cancel()
    # ended, its process (this one) alive: the job is known, and says how it ended, in one line
    ended = stretch("scale", job, "totals", "2", check=False)
    assert ended.returncode == 1
    assert ended.stderr == "stretch: job 'cli scale job' was cancelled: it cannot be rescaled\n"
    status = stretch("status", job[:12])  # its final status
    assert f"job {job}  'cli scale job'  CANCELED" in status.stdout
    assert (
        "job 'cli scale job' was cancelled" in status.stdout
        and "operator 'totals': parallelism 4" in status.stdout
    )
    final = json.loads(stretch("status", job, "--json").stdout)
    assert final["status"] == "CANCELED" and final["how"] == "job 'cli scale job' was cancelled"
    (listed,) = [j for j in json.loads(stretch("jobs", "--json").stdout) if j["job_id"] == job]
    assert listed["ended"] == listed["status"] == "CANCELED" and listed["socket"] is None
    (line,) = [line for line in stretch("jobs").stdout.splitlines() if job in line]
    assert "CANCELED" in line and "(ended " in line


def generating_job(name: str):
    """A job that runs until cancelled: a rate-limited generator summed per key."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    src = DataGeneratorSource(
        lambda i: (i % 10, i),
        count=None,
        rate_limiter_strategy=RateLimiterStrategy.per_second(2000),
        type_info=Types.TUPLE([Types.LONG(), Types.LONG()]),
    )
    env.from_source(src, None, "gen").key_by(lambda r: r[0]).sum(1).name("totals").sink_to(DiscardingSink())
    return env.execute_async(name)


def test_cancel_from_a_second_process_and_of_a_job_that_ended():
    client = generating_job("cli cancel job")
    job = client.get_job_id()
    done = stretch("cancel", job[:10])  # by id prefix, as scale and status take it
    assert re.fullmatch(rf"cancelled job 'cli cancel job' \({job}\) in \d+ ms\n", done.stdout), done.stdout
    # it returned once the job's process had let go of the job: it is over, its end recorded
    assert client.get_job_status().result().name == "CANCELED"
    with pytest.raises(jobs.JobNotRunning, match="was cancelled"):
        jobs.find(job)
    again = stretch("cancel", "cli cancel job", check=False)  # by name: it says how the job ended
    assert again.returncode == 1
    assert again.stderr == "stretch: job 'cli cancel job' was cancelled: there is nothing to cancel\n"
    env = StreamExecutionEnvironment.get_execution_environment()
    env.from_collection([1, 2, 3]).sink_to(DiscardingSink())
    finished = env.execute_async("cli finished job")
    assert finished.wait().name == "FINISHED"
    late = stretch("cancel", "cli finished job", check=False)
    assert late.returncode == 1
    assert late.stderr == "stretch: job 'cli finished job' has finished: there is nothing to cancel\n"
    missing = stretch("cancel", "no such job", check=False)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert missing.stderr.startswith("stretch: no running stretch job 'no such job'")


EXECUTE_SCRIPT = """
import sys

from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DataGeneratorSource, DiscardingSink, RateLimiterStrategy

env = StreamExecutionEnvironment.get_execution_environment()
env.set_parallelism(1)
src = DataGeneratorSource(
    lambda i: (i % 10, i),
    count=None,
    rate_limiter_strategy=RateLimiterStrategy.per_second(2000),
    type_info=Types.TUPLE([Types.LONG(), Types.LONG()]),
)
env.from_source(src, None, "gen").key_by(lambda r: r[0]).sum(1).name("totals").sink_to(DiscardingSink())
print("started", flush=True)
env.execute(sys.argv[1])
"""


def test_a_script_whose_job_is_cancelled_by_stretch_cancel_ends_in_one_line(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(EXECUTE_SCRIPT)
    name = f"cli-cancelled-{tmp_path.name}"
    run = subprocess.Popen(
        [sys.executable, "-m", "stretch.cli", "run", str(script), name],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert run.stdout.readline() == "started\n"
        deadline = time.monotonic() + 60
        while not any(j["name"] == name for j in json.loads(stretch("jobs", "--json").stdout)):
            assert time.monotonic() < deadline, "the script's job never started"
            time.sleep(0.1)
        assert stretch("cancel", name).stdout.startswith(f"cancelled job {name!r}")
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
        run.wait()
    assert run.returncode == 1 and "Traceback" not in err
    assert re.fullmatch(rf"stretch: job '{name}' \([0-9a-f]+\) was cancelled\n", err), err


RUN_SCRIPT = """
import sys
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink

env = StreamExecutionEnvironment.get_execution_environment()
env.set_parallelism(1)
if sys.argv[2] == "checkpointed":
    env.enable_checkpointing(None)
if sys.argv[2] == "mistaken":
    {}["a key the script does not have"]
env.from_collection([1, 2, 3]).key_by(lambda x: x % 2).sum(0).sink_to(DiscardingSink())
print(env.execute(sys.argv[1]).get_job_id(), flush=True)
"""


def test_run_says_in_one_line_why_a_restore_is_refused(tmp_path):
    """The job's refusals print one line, what and why and what to do, and exit 1; an error of
    the script itself prints its traceback as python does; a script that is not there is wrong usage."""
    script = tmp_path / "job.py"
    script.write_text(RUN_SCRIPT)
    name = f"cli-run-{tmp_path.name}"
    stretch("run", str(script), name, "checkpointed")  # it finishes: nothing is left to restore
    for args, said in [
        (
            ("checkpointed",),
            rf"stretch: job '{name}' finished \(at [-\d: ]+\): there is nothing to restore; run it "
            "without restore to run it again\n",
        ),
        (("plain",), r"stretch: restore needs checkpointing: call env.enable_checkpointing\(\) first\n"),
    ]:
        refused = stretch("run", "--restore", str(script), name, *args, check=False)
        assert refused.returncode == 1 and re.fullmatch(said, refused.stderr), refused.stderr
    mistaken = stretch("run", str(script), name, "mistaken", check=False)
    assert mistaken.returncode == 1 and "Traceback" in mistaken.stderr and "KeyError" in mistaken.stderr
    missing = stretch("run", str(tmp_path / "nosuch.py"), check=False)
    assert (
        missing.returncode == 2
        and missing.stderr
        == f"stretch run: error: no script {str(tmp_path / 'nosuch.py')!r} (no such file)\n"
    )


def test_wrong_values_and_a_cluster_that_does_not_answer_are_one_line(monkeypatch):
    for args, said in [
        (
            ("status", "some job", "--interval", "-1"),
            "argument --interval: must be more than 0 seconds, got -1",
        ),
        (("demo", "--events", "0"), "argument --events: must be at least 1, got 0"),
        (("demo", "--schedule", "2,x"), "argument --schedule: expected a whole number, got 'x'"),
        (("scale", "some job", "totals", "two"), "argument parallelism: invalid int value: 'two'"),
    ]:
        wrong = stretch(*args, check=False)
        assert wrong.returncode == 2 and wrong.stderr.splitlines()[-1].endswith(said), wrong.stderr
        assert "Traceback" not in wrong.stderr
    with socket.socket() as s:  # a port nobody listens on: a driver that is gone
        s.bind(("127.0.0.1", 0))
        url = f"grpc://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("STRETCH_CLUSTER_SECRET", "a secret")
    for command in (("status", url), ("add-node", url), ("remove-node", url, "node-0")):
        gone = stretch("cluster", *command, check=False)
        assert gone.returncode == 1 and gone.stderr.count("\n") == 1, gone.stderr
        assert gone.stderr.startswith(f"stretch: the driver of the cluster at {url} does not answer")


RESTORE_SCRIPT = """
import sys
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink
from tests.runtime.test_checkpointing import running_sums

env = StreamExecutionEnvironment.get_execution_environment()
env.set_parallelism(int(sys.argv[2]))
env.enable_checkpointing(50)
running_sums(env, 30_000, int(sys.argv[3])).sink_to(ChannelSink("out"))
client = env.execute_async(sys.argv[1])
print("started", flush=True)
client.wait()
print("restored from", client._coordinator.restored_from, "checkpoints", len(client._coordinator.checkpointer.history))
"""


def test_run_a_job_script_kill_it_and_run_it_again_from_its_latest_checkpoint(tmp_path):
    from stretch import channels
    from stretch.runtime.checkpointing import CheckpointStore
    from stretch.runtime.state_dir import job_dir
    from tests.runtime.test_checkpointing import kill_after_checkpoints, running_sums_reference

    script = tmp_path / "job.py"
    script.write_text(RESTORE_SCRIPT)
    name = f"cli-restore-{tmp_path.name}"
    first = subprocess.Popen(
        [sys.executable, "-m", "stretch.cli", "run", str(script), name, "2", "10000"],
        stdout=subprocess.PIPE,
        text=True,
    )
    store = CheckpointStore(job_dir(name) / "checkpoints")
    kill_after_checkpoints(first, store, 1)
    latest = store.latest()
    assert latest["id"] >= 1
    again = stretch("run", "--restore", str(script), name, "3", "200000")
    assert f"restored from {latest['id']} " in again.stdout, again.stderr
    results = sorted(tuple(r) for r in channels.open_reader(name, "out", from_offset=0))
    assert results == sorted(running_sums_reference(30_000))
    # the job finished: a restore has nothing to start from, and says so
    finished = stretch("run", "--restore", str(script), name, "3", "200000", check=False)
    assert finished.returncode != 0 and "there is nothing to restore" in finished.stderr


def test_run_finds_the_scripts_own_modules_as_python_does(tmp_path):
    (tmp_path / "settings.py").write_text("EVENTS = 1234\n")
    (tmp_path / "job.py").write_text("import sys\nfrom settings import EVENTS\nprint(EVENTS, sys.argv[1:])\n")
    assert stretch("run", str(tmp_path / "job.py"), "a", "b").stdout == "1234 ['a', 'b']\n"


def test_cluster_status_add_node_and_remove_node_from_another_process(tmp_path, capsys):
    """Status shows each node's key groups and jobs; the driver moves key groups when a second
    process asks; the job's state stays exact."""
    rows = [[(f"k{(b * 31 + i) % 97}", i % 11) for i in range(200)] for b in range(3)]
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster") as cluster:
        client = count_sum_job().execute_async("cli-nodes", cluster=cluster)
        assert main(["cluster", "status", cluster.address, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["version"] == 0
        assert {n: s["key_groups"] for n, s in shown["nodes"].items()} == {
            n: cluster.table.key_groups_of(n) for n in cluster.nodes
        }
        assert all(s["jobs"]["cli-nodes"]["status"] == "RUNNING" for s in shown["nodes"].values())
        assert main(["cluster", "status", cluster.address]) == 0
        assert "64 key groups" in capsys.readouterr().out
        with client.writer("in") as w:
            w.write(to_batch(rows[0], PAIR), query="q", batch=0)
            added = json.loads(stretch("cluster", "add-node", cluster.address, "--json").stdout)
            assert cluster.nodes == ["node-0", "node-1", "node-2"]
            assert added["key_groups_moved"] == 42 and added["bytes_moved"] > 0  # about 1/3 of 128
            w.write(to_batch(rows[1], PAIR), query="q", batch=1)
            removed = stretch("cluster", "remove-node", cluster.address, "node-0").stdout
            assert removed.startswith("remove-node: moved ") and cluster.nodes == ["node-1", "node-2"]
            w.write(to_batch(rows[2], PAIR), query="q", batch=2)
        with pytest.raises(SystemExit, match="no node 'node-7'"):
            main(["cluster", "remove-node", cluster.address, "node-7"])
        state = client.query_state("counts").to_pylist()
        client.cancel()
    want = reference([r for b in rows for r in b])
    assert {r["key"]: (r["count"], r["sum"]) for r in state} == want
    with pytest.raises(SystemExit, match="no running driver"):
        main(["cluster", "add-node", str(tmp_path / "cluster")])
    with pytest.raises(SystemExit, match="no stretch cluster"):
        main(["cluster", "status", str(tmp_path / "nothing")])


def test_help_has_examples_and_exit_codes_follow_the_conventions():
    top = stretch("--help").stdout
    assert "examples:" in top and "exit status" in top
    for command in ("demo", "scale", "checkpoint", "cancel", "run", "jobs", "status", "metrics", "cluster"):
        assert "example:" in stretch(command, "--help").stdout, command
    for command in ("status", "add-node", "remove-node"):
        assert "example:" in stretch("cluster", command, "--help").stdout, command
    assert stretch("status", "no such job", check=False).returncode == 1  # refused
    assert stretch("scale", "some job", check=False).returncode == 2  # wrong usage


NEW_CODE = """
from tests.runtime.test_code_update import Counting


class Doubled(Counting):
    tag = "v2"

    def step(self, count, total, value):
        return count + 1, total + 2 * value


class Scaled(Counting):
    def __init__(self, factor):
        self.factor = factor
"""


def test_update_from_a_second_process_and_its_refusals(tmp_path):
    from tests.runtime.test_code_update import counting_job, oracle, records_of, settle

    module = tmp_path / "new_code.py"
    module.write_text(NEW_CODE)
    records = records_of(600, 21)
    job = counting_job("cli update job", 2)
    job_id = job.client.get_job_id()
    job.writer.write(records[:300])
    settle(job.client, "count", 300)
    for args, message in [
        (("count", f"{module}:Nope"), "has no 'Nope'"),
        (("count", "no_such_module:X"), "does not import in the job's process"),
        (("count", "builtins:dict"), "runs a KeyedProcessFunction"),
        (("count", f"{module}:Scaled"), "is a class whose constructor needs arguments"),
    ]:
        result = stretch("update", job_id, *args, check=False)
        assert result.returncode == 1 and message in result.stderr, (args, result.stderr)
        assert result.stderr.startswith("stretch: ") and result.stderr.count("\n") == 1, result.stderr
    dry = json.loads(stretch("update", job_id, "count", f"{module}:Doubled", "--dry-run", "--json").stdout)
    assert dry["dry_run"] and dry["version"] == 1
    out = stretch("update", job_id, "count", f"{module}:Doubled").stdout
    assert "updated 'count' to version 1" in out and "queued records run the new code" in out
    job.writer.write(records[300:])
    assert set(job.finish()) == oracle(records, [(0, "v1"), (300, "v2")])


UPDATE_SCRIPT = """
import sys
import time

from stretch import channels
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from tests.runtime.test_code_update import OUT, RECORD, Counting, Doubling, records_of, settle

name, phase = sys.argv[1], sys.argv[2]
records = records_of(600, 5)
env = StreamExecutionEnvironment.get_execution_environment()
env.set_parallelism(2)
env.enable_checkpointing(None)
source = ChannelSource("in", RECORD, durable=True)
counts = env.from_source(source, None, "in").key_by(lambda r: r[0]).process(Counting(), OUT)
counts.name("count").sink_to(ChannelSink("out"))
client = env.execute_async(name)
writer = channels.open_writer(client, "in")
if phase == "first":
    writer.write(records[:300])
    settle(client, "count", 300)
    print("updated to version", client.update("count", Doubling()).version, flush=True)
    time.sleep(600)
writer.write(records[300:])
writer.end()
print("finished", client.wait().name, flush=True)
"""


def test_a_restore_after_a_live_update_runs_the_updated_code_only_when_told(tmp_path):
    from stretch import channels
    from tests.runtime.test_code_update import oracle, records_of

    script = tmp_path / "job.py"
    script.write_text(UPDATE_SCRIPT)
    name = f"cli-update-restore-{tmp_path.name}"
    first = subprocess.Popen(
        [sys.executable, "-m", "stretch.cli", "run", str(script), name, "first"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout.readline().strip() == "updated to version 1"
    finally:
        first.kill()  # SIGKILL: the job's process dies with the update in its latest checkpoint
        first.wait()
    refused = stretch("run", "--restore", str(script), name, "rest", check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("stretch: operator 'count' ran code version 1 at the checkpoint")
    assert "older" in refused.stderr and refused.stderr.count("\n") == 1
    done = stretch("run", "--restore", "--restore-code", "checkpoint", str(script), name, "rest")
    assert "finished FINISHED" in done.stdout
    results = [tuple(r) for r in channels.open_reader(name, "out", from_offset=0)]
    assert set(results) == oracle(records_of(600, 5), [(0, "v1"), (300, "v2")]) and len(results) == 600
