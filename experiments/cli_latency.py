"""Wall time of the `stretch` command against a running job, each command a fresh process.

    python experiments/cli_latency.py --json

Starts a small keyed job in a process of its own (a channel-fed counter, parallelism 2,
checkpointing enabled, 10,000 records in, then idle), then runs each command ``--runs`` times
(after ``--warmup`` runs) and reports the median and the fastest, in ms: ``stretch jobs``,
``stretch status JOB`` (one status request: the job's own rates over about the last second;
``--interval 0.5`` measures them here instead, waiting 0.5 s, reported as ``status_interval``),
``stretch scale`` (alternately
to 3 and 2: each a real rescale), a refused ``stretch scale`` (an unknown operator, exit 1),
``stretch update`` (a real update: this file's ``Count``; the job makes it durable with a
checkpoint), ``stretch checkpoint`` and ``stretch metrics``. Beside each, ``in_process_ms``: the
same command run in this process (``stretch.cli.main``), i.e. its requests and the job's work
without an interpreter's start and imports; and for scale, ``python -c pass`` (the interpreter's
own start) and ``python -c "import stretch.cli"``.

The command is the ``stretch`` console script beside this Python (not a version manager's shim,
which adds its own start); ``--command "python -m stretch.cli"`` times another. The same figures,
with a public tool: ``hyperfine -N -w 3 -r 20 'stretch jobs' 'stretch checkpoint JOB' ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stretch.common import Types
from stretch.datastream import KeyedProcessFunction
from stretch.datastream.state import ValueStateDescriptor

RECORD = Types.TUPLE([Types.STRING(), Types.LONG()])


class Count(KeyedProcessFunction):
    """Counts each key's records (also the code ``stretch update`` installs, by this file's path)."""

    def open(self, ctx):
        self.count = ctx.get_state(ValueStateDescriptor("count", Types.LONG()))

    def process_element(self, value, ctx):
        count = (self.count.value() or 0) + 1
        self.count.update(count)
        yield value[0], count


def serve(name: str) -> None:
    """The job: runs until this process's standard input closes (the benchmark ended or died)."""
    from stretch import channels
    from stretch.datastream import StreamExecutionEnvironment
    from stretch.datastream.connectors.channel import ChannelSink, ChannelSource

    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(None)  # `stretch checkpoint` only
    counts = env.from_source(ChannelSource("in", RECORD), None, "in").key_by(lambda r: r[0])
    counts.process(Count(), RECORD).name("count").sink_to(ChannelSink("out"))
    client = env.execute_async(name)
    try:
        channels.open_writer(client, "in").write([(f"k{i % 100}", i) for i in range(10_000)])
        print("started", client.get_job_id(), flush=True)
        sys.stdin.read()
    finally:
        client.cancel()


def timed(argv: list[str], expect: int = 0) -> float:
    """Wall time in ms of the command as a process of its own."""
    t0 = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    elapsed = (time.perf_counter() - t0) * 1000
    if run.returncode != expect:
        raise RuntimeError(f"{shlex.join(argv)}: exit {run.returncode}, wanted {expect}: {run.stderr}")
    return elapsed


def in_process(args: list[str]) -> float:
    """Time in ms of ``stretch.cli.main(args)`` in this process: the command's own work (its
    requests to the job, and the job's answers), without an interpreter's start and the imports."""
    from stretch import cli

    t0 = time.perf_counter()
    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
        contextlib.suppress(SystemExit),
    ):
        cli.main(args)
    return (time.perf_counter() - t0) * 1000


def measure(stretch: list[str], commands: dict[str, list], warmup: int, runs: int) -> dict:
    """Each command's median and fastest wall time in ms and, for a stretch command, the median
    of the same command run in this process (``in_process_ms``). ``commands`` maps a name to the
    argument lists taken in turn, each possibly ending with the exit status it must have (an int);
    lists that start with an absolute path are whole commands (the interpreter), the others
    stretch's arguments."""
    out = {}
    for name, given in commands.items():
        plain = given[0][0].startswith("/")
        turns = [
            ([a for a in t if not isinstance(a, int)], t[-1] if isinstance(t[-1], int) else 0) for t in given
        ]
        times, inside = [], []
        for i in range(warmup + runs):
            args, expect = turns[i % len(turns)]
            elapsed = timed(args if plain else [*stretch, *args], expect)
            if i >= warmup:
                times.append(elapsed)
        for i in range(0 if plain else warmup + runs):
            elapsed = in_process(turns[i % len(turns)][0])
            if i >= warmup:
                inside.append(elapsed)
        out[name] = {"median_ms": round(statistics.median(times), 1), "min_ms": round(min(times), 1)}
        if inside:
            out[name]["in_process_ms"] = round(statistics.median(inside), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--command", help="the command to time (default: the stretch script beside this Python)")
    ap.add_argument("--serve", metavar="NAME", help=argparse.SUPPRESS)  # the job's own process
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return
    stretch = shlex.split(args.command) if args.command else [str(Path(sys.executable).parent / "stretch")]
    name = f"cli-latency-{time.time_ns() % 10**9}"
    state = tempfile.TemporaryDirectory(prefix="stretch-cli-latency-")  # the job's checkpoints
    job = subprocess.Popen(
        [sys.executable, __file__, "--serve", name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "STRETCH_STATE_DIR": state.name},
    )
    try:
        line = job.stdout.readline()
        if not line.startswith("started"):
            raise RuntimeError(f"the job did not start (exit {job.wait()})")
        me = f"{Path(__file__).resolve()}:Count"
        commands = {
            "python": [[sys.executable, "-c", "pass"]],
            "import": [[sys.executable, "-c", "import stretch.cli"]],
            "jobs": [["jobs"]],
            "status": [["status", name]],
            "status_interval": [["status", name, "--interval", "0.5"]],
            "scale": [["scale", name, "count", "3"], ["scale", name, "count", "2"]],
            "scale_refused": [["scale", name, "nosuch", "2", 1]],
            "update": [["update", name, "count", me]],
            "checkpoint": [["checkpoint", name]],
            "metrics": [["metrics", name]],
        }
        result = {"command": shlex.join(stretch), "runs": args.runs}
        result.update(measure(stretch, commands, args.warmup, args.runs))
    finally:
        job.stdin.close()
        job.wait(timeout=60)
        state.cleanup()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result.pop('command')}, {result.pop('runs')} runs each (ms):")
        for k, v in result.items():
            inside = f"   in process {v['in_process_ms']:6.1f}" if "in_process_ms" in v else ""
            print(f"  {k:14} median {v['median_ms']:7.1f}   fastest {v['min_ms']:7.1f}{inside}")


if __name__ == "__main__":
    main()
