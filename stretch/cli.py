"""The ``stretch`` command: run the demo or a job script, list, describe, rescale, update,
checkpoint and cancel the jobs on this machine, and look at or change a stretch cluster.

Errors a user can cause (a job that is not there or has ended, a refused request, a script that is
not there, a refused restore, a cluster that does not answer) print one line, ``stretch: ...``,
and exit 1 (2 for wrong usage): never a traceback.

The commands that talk to a running job (jobs, status, scale, update, checkpoint, cancel, metrics)
import only ``stretch.jobs`` and its control socket client, so that each takes little more than
the interpreter's start and the job's answer (figures in docs/guides/cli.md;
tests/test_cli_imports.py guards it); a command that needs more (the DataStream API, pyarrow,
Spark) imports it in its own function.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from stretch import jobs
from stretch.errors import job_ended


def _jobs() -> list[dict]:
    """This user's jobs on this machine with their status: the running ones, and those that ended
    in a process that still runs (``ended`` says how: FINISHED, CANCELED, FAILED)."""
    found = []
    for info in jobs.list_jobs(ended=True):
        if info.ended:
            found.append({**vars(info), "status": info.ended})
            continue
        try:
            status = jobs.Job(info.job_id, info.name, socket=info.socket).request(
                {"op": "status"}, timeout=2.0
            )
        except (OSError, ValueError):
            continue  # a job that ended between listing and asking
        found.append({**vars(info), "status": status.get("status")})
    return found


def _find(job: str, what: str | None = None) -> jobs.Job:
    """The running job the command names; one that ended is refused saying how, and ``what`` it
    cannot be ("rescaled") in the words its own client uses."""
    try:
        return jobs.find(job)
    except jobs.JobNotRunning as e:
        raise SystemExit(f"stretch: {_ended(e, what)}") from None
    except LookupError as e:
        raise SystemExit(f"stretch: {e}") from None


def _ended(e: jobs.JobNotRunning, what: str | None) -> Exception:
    return job_ended(e.info.how, what) if what and e.info.how else e


def _ask(job: jobs.Job, method, *args, what: str | None = None, **kw):
    """A request to the job; its refusal, or its end, as the command's error."""
    try:
        return method(*args, **kw)
    except jobs.JobGone:
        try:
            jobs.find(job.job_id)
        except jobs.JobNotRunning as e:  # it ended while asked, and has said how by now
            raise SystemExit(f"stretch: {_ended(e, what)}") from None
        except LookupError:
            pass
        raise SystemExit(f"stretch: job {job.name!r} ended before answering") from None
    except (LookupError, ValueError, TypeError, RuntimeError, TimeoutError) as e:
        raise SystemExit(f"stretch: {e}") from None


def cmd_jobs(args) -> int:
    jobs = _jobs()
    if args.json:  # each job's info (id, name, pid, control socket, metrics URL if served) and status
        print(json.dumps(jobs, indent=2))
        return 0
    if not jobs:
        print("no running stretch jobs")
        return 0
    print(f"{'JOB ID':34} {'STATUS':10} {'PID':>8}  NAME")
    for j in jobs:
        status = j["status"] or "-"  # a job that refused to say (its reply on `stretch status`)
        ended = f"  (ended {_clock(j['ended_at'])}; its process still runs)" if j["ended"] else ""
        print(f"{j['job_id']:34} {status:10} {j['pid']:>8}  {j['name']}{ended}")
    return 0


def _clock(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def cmd_metrics(args) -> int:
    job = _find(args.job)
    print(_ask(job, job.metrics), end="")
    return 0


def cmd_status(args) -> int:
    try:
        job = jobs.find(args.job)
    except jobs.JobNotRunning as e:  # what it was at its end
        return _show_status(_final_status(e), {}, args.json)
    except LookupError as e:
        raise SystemExit(f"stretch: {e}") from None
    status = _ask(job, job.status)
    instances = [i for op in status["operators"] for i in op["instances"]]
    if args.interval is None and all(i.get("rate") is not None for i in instances):
        # the job's own rates, over about the last second
        rates = {
            (op["name"], i["index"]): {"rate": i["rate"], "busy": i["busy"]}
            for op in status["operators"]
            for i in op["instances"]
        }
    else:  # asked for, or a job too young to have its own: measured here
        before = status
        t0 = time.monotonic()
        time.sleep(0.5 if args.interval is None else args.interval)
        status = _ask(job, job.status)
        rates = _rates(before, status, time.monotonic() - t0)
    return _show_status(status, rates, args.json)


def _final_status(e: jobs.JobNotRunning) -> dict:
    """An ended job's status at its end, with how it ended; its instances process nothing now."""
    info = e.info
    status = e.status or {"job_id": info.job_id, "name": info.name, "status": info.ended, "operators": []}
    for op in status["operators"]:
        for inst in op["instances"]:
            inst.update(rate=0.0, busy=0.0)
    return {**status, "how": info.how, "ended_at": info.ended_at}


def _show_status(status: dict, rates: dict, as_json: bool) -> int:
    if as_json:
        for op in status["operators"]:
            for inst in op["instances"]:
                inst.update(rates.get((op["name"], inst["index"]), {}))
        print(json.dumps(status, indent=2))
        return 0
    print(f"job {status['job_id']}  {status['name']!r}  {status['status']}")
    if status.get("how"):
        print(f"  ended {_clock(status.get('ended_at'))}: {status['how']}")
    ck = status.get("checkpoints")
    if ck is not None:
        latest = ck["latest"]
        line = (
            f"checkpoint {latest['id']} ({latest['duration_ms']:.0f} ms, {latest['bytes'] / 1e6:,.1f} MB, "
            f"{time.time() - latest['completed_at']:.1f} s ago)"
            if latest
            else "none yet"
        )
        restored = ck["restored_from"]
        if restored is not None:
            line += f"; restored from {f'checkpoint {restored}' if restored else 'the start of the run that died'}"
        print(
            f"  checkpoints: {line}; {ck['completed']} completed, {ck['failed']} failed, {ck['recoveries']} recoveries"
        )
    for op in status["operators"]:
        print(
            f"  operator {op['name']!r}: parallelism {op['parallelism']}, epoch {op['epoch']}, "
            f"code version {op['code_version']}, "
            f"gate depth {op['gate_depth']}, state {op['state_bytes'] / 1e6:,.1f} MB"
        )
        for inst in op["instances"]:
            r = rates.get((op["name"], inst["index"]), {})
            print(
                f"    #{inst['index']}: {r.get('rate', 0.0):>12,.0f} records/s  busy {r.get('busy', 0.0):5.1%}  "
                f"({inst['records_in']:,} in, {inst['records_out']:,} out)"
            )
    return 0


def _rates(before: dict, after: dict, dt: float) -> dict:
    """Per instance: records per second and busy fraction over the interval between two samples."""
    old = {(op["name"], i["index"]): i for op in before["operators"] for i in op["instances"]}
    out = {}
    for op in after["operators"]:
        for i in op["instances"]:
            prev = old.get((op["name"], i["index"]))
            if prev is not None and dt > 0:
                out[(op["name"], i["index"])] = {
                    "rate": (i["records_in"] - prev["records_in"]) / dt,
                    "busy": min(max((i["busy_ns"] - prev["busy_ns"]) / (dt * 1e9), 0.0), 1.0),
                }
    return out


def cmd_scale(args) -> int:
    job = _find(args.job, "rescaled")
    reply = _ask(
        job, job.rescale, args.operator, args.parallelism, what="rescaled", on_progress=_waiting("rescale")
    )
    print(
        f"rescaled {reply['operator']!r} {reply['old_parallelism']} -> {reply['new_parallelism']} "
        f"in {reply['elapsed_ms']:.2f} ms (epoch {reply['epoch']}, {reply['state_bytes_copied']} state bytes copied, "
        f"{reply.get('queued', 0)} records queued behind it)"
    )
    return 0


def cmd_update(args) -> int:
    job = _find(args.job, "updated")
    reply = _ask(
        job,
        job.update,
        args.operator,
        args.function,
        dry_run=args.dry_run,
        drop_orphaned=args.drop_orphaned,
        what="updated",
        on_progress=_waiting("update"),
    )
    if args.json:
        print(json.dumps(reply))
        return 0
    states = f"states added {reply['states_added'] or 'none'}, orphaned {reply['states_orphaned'] or 'none'}"
    if reply["dry_run"]:
        print(f"update of {reply['operator']!r} to version {reply['version']} would be accepted ({states})")
    else:
        queued = (
            "" if reply.get("queued") is None else f"; {reply['queued']:,} queued records run the new code"
        )
        print(
            f"updated {reply['operator']!r} to version {reply['version']} in {reply['elapsed_ms']:.2f} ms "
            f"({states}{queued})"
        )
    return 0


def _waiting(what: str):
    """Progress of a long operation, on stderr once it takes more than a few seconds."""

    def show(progress: dict) -> None:
        if progress.get("elapsed_ms", 0) >= 3000:
            print(f"stretch: {what} under way for {progress['elapsed_ms'] / 1000:.0f} s ...", file=sys.stderr)

    return show


def cmd_checkpoint(args) -> int:
    job = _find(args.job, "checkpointed")
    reply = _ask(job, job.checkpoint, what="checkpointed", on_progress=_waiting("checkpoint"))
    print(f"checkpoint {reply['id']} complete in {reply['duration_ms']:.1f} ms ({reply['bytes']:,} bytes)")
    return 0


def cmd_cancel(args) -> int:
    """Cancel a running job, as its JobClient.cancel() does; returns once its process has let go
    of everything the job held (its directory too: a restore may follow at once)."""
    try:
        job = jobs.find(args.job)
    except jobs.JobNotRunning as e:
        raise SystemExit(f"stretch: {e}: there is nothing to cancel") from None
    except LookupError as e:
        raise SystemExit(f"stretch: {e}") from None
    t0 = time.monotonic()
    try:
        reply = job.cancel(on_progress=_waiting("cancel"))
    except jobs.JobGone:  # it ended as it answered, the cancel with it, or on its own
        reply = None
    except (LookupError, ValueError, RuntimeError, TimeoutError) as e:
        raise SystemExit(f"stretch: {e}") from None
    ended = _gone(job)
    if reply is not None and reply["status"] != "CANCELED":
        raise SystemExit(f"stretch: {reply['how']}: it was not cancelled")
    if reply is None and ended is not None and ended.ended != "CANCELED":
        raise SystemExit(f"stretch: {ended.how}: it was not cancelled")
    print(f"cancelled job {job.name!r} ({job.job_id}) in {(time.monotonic() - t0) * 1000:.0f} ms")
    return 0


def _gone(job: jobs.Job, timeout: float = 60.0) -> jobs.JobInfo | None:
    """Once the job's process has let go of it: its ended record (None if the process exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            jobs.find(job.job_id)
        except jobs.JobNotRunning as e:
            return e.info
        except LookupError:
            return None
        time.sleep(0.02)
    raise SystemExit(
        f"stretch: job {job.name!r} was cancelled but its process has not let go of it after {timeout:.0f} s"
    )


def cmd_run(args) -> int:
    """Run a job script; with --restore its job starts from its latest complete checkpoint. The
    job's own refusals and ends (a refused restore, a failure, a cancel, a function that does not
    ship) print their message, not the script's traceback; the script's own errors print theirs,
    as python does."""
    import runpy

    from stretch.datastream.stream_execution_environment import RESTORE_CODE_ENV, RESTORE_ENV
    from stretch.errors import JobExecutionError, RestoreRefused, UnpicklableFunction

    if not os.path.isfile(args.script):
        print(f"stretch run: error: no script {args.script!r} (no such file)", file=sys.stderr)
        return 2
    if args.restore:
        os.environ[RESTORE_ENV] = "1"
    if args.restore_code:
        os.environ[RESTORE_CODE_ENV] = args.restore_code
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))  # as `python script.py` does
    try:
        runpy.run_path(args.script, run_name="__main__")
    except (RestoreRefused, JobExecutionError, UnpicklableFunction) as e:
        raise SystemExit(f"stretch: {e}") from None
    return 0


def cmd_demo(args) -> int:
    import shutil

    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        raise SystemExit("stretch: the demo runs Spark, which needs Java 17: install it, or set JAVA_HOME")
    from stretch import demo  # Spark and matplotlib: only for the demo

    if args.nodes:
        from stretch import demo_nodes

        summary = demo_nodes.run(
            nodes=args.nodes,
            events=args.events,
            files=args.files,
            files_per_trigger=args.files_per_trigger,
            work_dir=args.work_dir,
            plot=not args.no_plot,
            verbose=args.verbose,
        )
        return 0 if summary["results_match_reference"] and summary["status"] == "FINISHED" else 1
    summary = demo.run(
        events=args.events,
        files=args.files,
        files_per_trigger=args.files_per_trigger,
        parallelism=args.parallelism,
        schedule=args.schedule,
        work_dir=args.work_dir,
        plot=not args.no_plot,
        verbose=args.verbose,
    )
    return 0 if summary["results_match_reference"] and summary["status"] == "FINISHED" else 1


def cmd_cluster(args) -> int:
    """status / add-node / remove-node (stretch.cluster.commands)."""
    from stretch.cluster import commands  # pyarrow.flight: only for the cluster commands

    return commands.status(args) if args.cluster_command == "status" else commands.change(args)


def cmd_ui(args) -> int:
    """Serve the web UI for this user's jobs on this machine (and a cluster's) until interrupted."""
    import signal
    import threading

    from stretch.ui.config import UIConfig
    from stretch.ui.server import UIServer
    from stretch.ui.sources import LocalJobs

    sources = [LocalJobs()]
    secret = args.secret or os.environ.get("STRETCH_UI_SECRET")
    if args.cluster:
        from stretch.cluster.commands import connect
        from stretch.cluster.ui_source import ClusterJobs

        connection = connect(args.cluster)
        sources.append(ClusterJobs(connection))
        secret = secret or connection.secret  # who may call the cluster's nodes may rescale here
    try:
        config = UIConfig(
            args.host,
            args.port,
            certfile=args.certfile,
            keyfile=args.keyfile,
            **({"secret": secret} if secret else {}),
        )
        server = UIServer(sources, config).start()
    except (OSError, ImportError, ValueError) as e:
        for source in sources:
            source.close()
        raise SystemExit(f"stretch: {e}") from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"stretch UI at {server.url}", flush=True)
    print(f"  (to look only: {server.address}; Ctrl-C stops it)", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


_EXAMPLES = """examples:
  stretch demo                            the demo pipeline (Spark -> stretch -> Spark)
  stretch jobs                            running jobs (--json for scripts)
  stretch status clicks                   a job by name, id or unique id prefix
  stretch scale clicks totals 4           rescale operator 'totals' live
  stretch checkpoint clicks               a checkpoint now
  stretch update clicks totals fns:V2     swap the function of operator 'totals', live
  stretch metrics clicks                  its metrics, in Prometheus' text format
  stretch cancel clicks                   cancel it
  stretch run --restore my_job.py         a job script, from its job's latest checkpoint
  stretch ui                              a web page of the running jobs (port 8081)
  stretch cluster status DIR              the nodes of a stretch cluster (its directory, or its URL)

exit status: 0 done; 1 refused or failed (the reason on standard error); 2 wrong usage"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="stretch",
        description="Elastic stateful stream processing: run the demo or a job script; list, describe, "
        "rescale, update, checkpoint and cancel the stretch jobs running on this machine; look at and change "
        "a cluster.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str, example: str):
        return sub.add_parser(
            name,
            help=summary,
            description=summary,
            epilog=f"example:\n  {example}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    p = command(
        "demo",
        "run the demo pipeline: one Spark query with a stretch job as its stage, on generated clicks",
        "stretch demo --events 500000",
    )
    p.add_argument("--events", type=_count, default=2_000_000, help="click events to generate")
    p.add_argument("--files", type=_count, default=20, help="Parquet files to spread them over")
    p.add_argument(
        "--files-per-trigger",
        type=_count,
        default=4,
        help="files Spark reads per micro-batch (maxFilesPerTrigger)",
    )
    p.add_argument(
        "--parallelism", type=_count, default=1, help="the window operator's parallelism at the start"
    )
    p.add_argument(
        "--schedule",
        type=_schedule,
        default=(2, 1),
        help="parallelisms to rescale to, live, during the run (comma-separated; empty: none)",
    )
    p.add_argument(
        "--nodes",
        type=_count,
        default=0,
        help="run the job on a local stretch cluster of this many nodes instead, adding one node and "
        "removing one live (--parallelism and --schedule then do not apply)",
    )
    p.add_argument("--work-dir", help="keep the clicks, checkpoints and results here (default: a temp dir)")
    p.add_argument("--no-plot", action="store_true", help="do not write stretch-demo.png")
    p.add_argument("--verbose", action="store_true", help="show Spark's log (else it goes to spark.log)")
    p.set_defaults(func=cmd_demo)
    p = command(
        "scale", "change a running operator's parallelism, live", "stretch scale clicks 'per-user windows' 4"
    )
    p.add_argument("job", help="job id (or a unique prefix) or job name")
    p.add_argument("operator", help="operator name")
    p.add_argument("parallelism", type=int)
    p.set_defaults(func=cmd_scale)
    p = command(
        "update",
        "swap a running keyed operator's function, live, keeping its state",
        "stretch update clicks totals my_functions:TotalsV2",
    )
    p.add_argument("job", help="job id (or a unique prefix) or job name")
    p.add_argument("operator", help="operator name")
    p.add_argument(
        "function",
        help="module:Name importable in the job's process, or path/to/file.py:Name (a class is instantiated)",
    )
    p.add_argument("--dry-run", action="store_true", help="only check the new code; change nothing")
    p.add_argument(
        "--drop-orphaned", action="store_true", help="clear the states the new code no longer declares"
    )
    p.add_argument("--json", action="store_true", help="machine-readable: the update's report as JSON")
    p.set_defaults(func=cmd_update)
    p = command("checkpoint", "take a checkpoint of a running job now", "stretch checkpoint clicks")
    p.add_argument("job", help="job id (or a unique prefix) or job name")
    p.set_defaults(func=cmd_checkpoint)
    p = command(
        "cancel",
        "cancel a running job: it stops at once, as JobClient.cancel() does",
        "stretch cancel clicks",
    )
    p.add_argument("job", help="job id (or a unique prefix) or job name")
    p.set_defaults(func=cmd_cancel)
    p = command("run", "run a job script (a Python file)", "stretch run --restore my_job.py")
    p.add_argument("script")
    p.add_argument("--restore", action="store_true", help="start from the job's latest complete checkpoint")
    p.add_argument(
        "--restore-code",
        choices=("checkpoint", "script", "refuse"),
        help="an operator whose code was updated live since this script: run the checkpoint's code, "
        "the script's, or refuse (the default)",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=cmd_run)
    p = command("jobs", "list the running jobs of this user on this machine", "stretch jobs --json")
    p.add_argument("--json", action="store_true", help="machine-readable: a JSON list of the jobs")
    p.set_defaults(func=cmd_jobs)
    p = command(
        "status", "describe a running job: operators, instances, rates, checkpoints", "stretch status clicks"
    )
    p.add_argument("job", help="job id (or a unique prefix) or job name")
    p.add_argument("--json", action="store_true", help="machine-readable: the status as JSON, with rates")
    p.add_argument(
        "--interval",
        type=_seconds,
        help="measure the rates over this many seconds here (default: the job's own, over about the last second)",
    )
    p.set_defaults(func=cmd_status)
    p = command("metrics", "a running job's metrics, in Prometheus' text format", "stretch metrics clicks")
    p.add_argument("job", help="job id (or a unique prefix) or job name")
    p.set_defaults(func=cmd_metrics)
    p = command(
        "ui",
        "serve a live web page of this user's running jobs (and a cluster's) until interrupted",
        "stretch ui\n  stretch ui --port 0 --cluster /tmp/stretch-cluster-4k8v6ur2",
    )
    p.add_argument("--host", default="127.0.0.1", help="the interface to listen on (default: loopback)")
    p.add_argument("--port", type=int, default=8081, help="the port (default 8081; 0: any free one)")
    p.add_argument(
        "--cluster", metavar="ADDRESS", help="also show this cluster: its directory, or its driver's URL"
    )
    p.add_argument(
        "--secret",
        help="what a rescale must carry (default: $STRETCH_UI_SECRET, the cluster's secret with --cluster, "
        "else a fresh one); the printed URL carries it",
    )
    p.add_argument("--certfile", help="serve HTTPS with this PEM certificate (with --keyfile)")
    p.add_argument("--keyfile", help="the PEM key of --certfile")
    p.set_defaults(func=cmd_ui)
    p = command(
        "cluster",
        "look at a stretch cluster's nodes, or add and remove nodes through its driver",
        "stretch cluster status /path/to/cluster\n  stretch cluster add-node /path/to/cluster\n"
        "  stretch cluster remove-node /path/to/cluster node-0",
    )
    csub = p.add_subparsers(dest="cluster_command", required=True)

    def cluster_command(name: str, summary: str, example: str, json_help: str):
        c = csub.add_parser(
            name,
            help=summary,
            description=summary,
            epilog=f"example:\n  {example}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        c.add_argument(
            "address",
            help="the cluster's address: its directory, or its driver's URL (grpc://host:port, with the "
            "secret in $STRETCH_CLUSTER_SECRET)",
        )
        c.add_argument("--json", action="store_true", help=json_help)
        return c

    c = cluster_command(
        "status",
        "each node's routing version, key groups and jobs",
        "stretch cluster status /tmp/stretch-cluster-4k8v6ur2",
        "machine-readable: the routing version and each node's status as JSON",
    )
    c.set_defaults(func=cmd_cluster)
    c = cluster_command(
        "add-node",
        "start a node and move its share of key groups to it, live",
        "stretch cluster add-node /tmp/stretch-cluster-4k8v6ur2 --json",
        "machine-readable: the HandoffReport as JSON",
    )
    c.set_defaults(func=cmd_cluster)
    c = cluster_command(
        "remove-node",
        "move a node's key groups to the others, live, then stop it",
        "stretch cluster remove-node /tmp/stretch-cluster-4k8v6ur2 node-0",
        "machine-readable: the HandoffReport as JSON",
    )
    c.add_argument("node", help="the node's id, as `stretch cluster status` shows it")
    c.set_defaults(func=cmd_cluster)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: no traceback (what a job was asked to do goes on in the job)
        print("stretch: interrupted", file=sys.stderr)
        return 130


def _count(text: str) -> int:
    """A whole number of at least 1 (argparse's type)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _schedule(text: str) -> tuple[int, ...]:
    """Comma-separated parallelisms, each at least 1; empty: none."""
    return tuple(_count(p.strip()) for p in text.split(",") if p.strip())


def _seconds(text: str) -> float:
    try:
        t = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not t > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return t


if __name__ == "__main__":
    sys.exit(main())
