"""The stretch command stays fast: the commands that talk to a running job (jobs, status, scale,
update, checkpoint, cancel, metrics) import only the control socket's client, never the DataStream API,
the engine, the state store, numba, numpy, pyarrow or Spark (which take a second to import).
Guarded by what a fresh process has imported, not by timing (docs/guides/cli.md has the figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from stretch import channels
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from tests.runtime.test_code_update import OUT, RECORD, Counting, settle

HEAVY = (
    "numba",
    "numpy",
    "pyarrow",
    "pandas",
    "pyspark",
    "cloudpickle",
    "stretch.datastream",
    "stretch.runtime.worker",
    "stretch.runtime.coordinator",
    "stretch.state",
    "stretch.plan",
    "stretch.cluster",
    "stretch.spark",
    "stretch.channels",
)

# Runs the commands one after another in one process; after each, the modules it has imported.
PROBE = """
import contextlib, io, json, sys

import stretch.cli

seen = [["import stretch.cli", None, sorted(sys.modules)]]
for argv in json.loads(sys.argv[1]):
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = stretch.cli.main(argv)
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    seen.append([" ".join(argv), code, sorted(sys.modules)])
print(json.dumps(seen))
"""


def probe(commands: list[list[str]], **env) -> list:
    """[command, exit status, modules imported so far] for ``import stretch.cli`` and each command."""
    run = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).resolve().parents[1],  # this checkout's stretch, as the test's
        env={**os.environ, **env},
    )
    return json.loads(run.stdout)


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def test_importing_the_cli_and_asking_for_jobs_that_are_not_there_imports_nothing_heavy(tmp_path):
    commands = [
        ["jobs"],
        ["jobs", "--json"],
        ["status", "nosuch"],
        ["scale", "nosuch", "op", "2"],
        ["update", "nosuch", "op", "m:F"],
        ["checkpoint", "nosuch"],
        ["metrics", "nosuch"],
        ["cancel", "nosuch"],
    ]
    seen = probe(commands, STRETCH_RUNTIME_DIR=str(tmp_path / "run"))  # no jobs there
    assert [code for _, code, _ in seen] == [None, 0, 0, 1, 1, 1, 1, 1, 1]
    for command, _, modules in seen:
        assert heavy(modules) == [], command
    assert "stretch.jobs" in seen[0][2]


def test_the_commands_against_a_running_job_import_nothing_heavy():
    """Each reply (status, rescale, update, checkpoint, metrics, cancel, and refusals) decodes
    without pyarrow or the API."""
    name = f"cli-imports-{os.getpid()}"
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(None)
    source = env.from_source(ChannelSource("in", RECORD), None, "in")
    source.key_by(lambda r: r[0]).process(Counting(), OUT).name("count").sink_to(DiscardingSink())
    client = env.execute_async(name)
    try:
        channels.open_writer(client, "in").write([(f"k{i % 7}", i, i) for i in range(100)])  # not ended
        settle(client, "count", 100)
        commands = [
            ["jobs"],
            ["jobs", "--json"],
            ["status", name, "--interval", "0.05"],
            ["status", name, "--json", "--interval", "0.05"],
            ["scale", name, "count", "3"],
            ["scale", name, "nosuch", "2"],
            ["update", name, "count", "tests.runtime.test_code_update:Doubling", "--dry-run"],
            ["checkpoint", name],
            ["metrics", name],
            ["cancel", name],
        ]
        seen = probe(commands)
        assert [code for _, code, _ in seen] == [None, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]
        for command, _, modules in seen:
            assert heavy(modules) == [], command
        assert client.describe()["operators"][0]["parallelism"] == 3
        assert client.get_job_status().result().name == "CANCELED"
    finally:
        client.cancel()
