"""A job that ended is still known, with how it ended and its final status, while its process
lives: to ``stretch.jobs`` (and so to the command line) as to its own client; its record goes when
the process exits, or at the next sweep of the runtime directory if the process was killed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from stretch import channels, jobs
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.errors import JobEnded
from stretch.runtime import job_info
from stretch.runtime.control_socket import local_jobs, running_jobs, runtime_dir

PAIR = Types.TUPLE([Types.STRING(), Types.LONG()])


def _finished_job(name: str):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    source = env.from_source(ChannelSource("in", PAIR), None, "in")
    source.key_by(lambda r: r[0]).sum(1).name("tot").sink_to(ChannelSink("out"))
    client = env.execute_async(name)
    with channels.open_writer(client, "in") as writer:
        writer.write([("a", 1), ("b", 2), ("a", 3)])
    assert client.wait(60).name == "FINISHED"
    return client


def test_a_finished_job_is_found_ended_saying_how_with_its_final_status():
    client = _finished_job("ended record")
    job_id = client.get_job_id()
    try:
        with pytest.raises(JobEnded, match="it cannot be rescaled") as own:
            client.rescale("tot", 3)
        for named in (job_id, job_id[:10], "ended record"):
            with pytest.raises(jobs.JobNotRunning) as ended:
                jobs.find(named)
            assert str(ended.value) == "job 'ended record' has finished"
            assert isinstance(ended.value, jobs.JobNotFound)  # callers that fall back on a kept log still do
            assert ended.value.info.ended == "FINISHED" and ended.value.info.socket is None
            # the words of the job's own refusal, made in one place
            assert str(own.value) == f"{ended.value.info.how}: it cannot be rescaled"
        (op,) = ended.value.status["operators"]
        assert ended.value.status["status"] == "FINISHED" and op["name"] == "tot"
        assert op["records_in"] == 3 and op["parallelism"] == 2
        assert job_id not in [j.job_id for j in jobs.list_jobs()]
        assert job_id not in [info["job_id"] for info in running_jobs()]
        (listed,) = [j for j in jobs.list_jobs(ended=True) if j.job_id == job_id]
        assert listed.ended == "FINISHED" and listed.ended_at is not None
    finally:
        job_info.forget_ended()
    assert not (runtime_dir() / f"{job_id}.json").exists()


def test_the_latest_run_of_a_name_is_the_one_found():
    first, second = _finished_job("run twice"), _finished_job("run twice")
    try:
        with pytest.raises(jobs.JobNotRunning) as ended:
            jobs.find("run twice")
        assert ended.value.info.job_id == second.get_job_id() != first.get_job_id()
    finally:
        job_info.forget_ended()


def test_a_process_keeps_its_last_ended_records_and_removes_them_at_exit(tmp_path, monkeypatch):
    monkeypatch.setattr(job_info, "KEEP_ENDED", 2)
    paths = [tmp_path / f"{i}.json" for i in range(3)]
    try:
        for i, path in enumerate(paths):
            job_info.keep_ended(path, {"job_id": str(i), "ended": "FINISHED"})
        assert [p.exists() for p in paths] == [False, True, True]
    finally:
        job_info.forget_ended()
    assert not any(p.exists() for p in paths)


SCRIPT = textwrap.dedent(
    """
    import sys
    from tests.runtime.test_job_info import _finished_job

    print(_finished_job(sys.argv[1]).get_job_id(), flush=True)
    sys.stdin.readline()  # the test looks while this process lives
    """
)


def test_the_record_lives_as_long_as_the_process_and_a_dead_processs_is_swept():
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "ended elsewhere"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        job_id = proc.stdout.readline().strip()
        record = runtime_dir() / f"{job_id}.json"
        info = json.loads(record.read_text())
        assert info["ended"] == "FINISHED" and info["how"] == "job 'ended elsewhere' has finished"
        assert "socket" not in info
        with pytest.raises(jobs.JobNotRunning, match="has finished"):
            jobs.find("ended elsewhere")
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(60) == 0
        assert not record.exists()  # removed at exit
        record.write_text(json.dumps(info))  # as a killed process leaves it
        assert job_id not in [i["job_id"] for i in local_jobs()]
        assert not record.exists()  # swept: its process is dead
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
