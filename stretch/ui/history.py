"""What the page shows over time: each job's operators sampled once a second (the last minutes,
for the charts) and the rescales, updates and checkpoints seen as they completed (the event log).

The job's own counters are totals; rates come from the difference of two samples, as
``stretch status`` computes them, so the charts need nothing new from the job."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 600.0  # the charts' span
GONE_AFTER_S = 60.0  # a job that stopped answering leaves the list after this long
MAX_EVENTS = 200


@dataclass
class Sample:
    t: float  # time.time()
    operators: dict[str, tuple[int, int, int, int, int]]  # name -> in, out, busy ns, gate depth, p


@dataclass
class JobHistory:
    status: dict
    seen_at: float
    samples: deque = field(default_factory=lambda: deque(maxlen=int(WINDOW_S) + 1))
    events: deque = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    previous: dict | None = None  # the status before, for the instances' busy fractions
    previous_t: float = 0.0


def sample_of(status: dict, t: float) -> Sample:
    ops = {}
    for op in status.get("operators", []):
        busy = sum(i["busy_ns"] for i in op["instances"])
        ops[op["name"]] = (op["records_in"], op["records_out"], busy, op["gate_depth"], op["parallelism"])
    return Sample(t, ops)


def series(samples: list[Sample]) -> dict:
    """Per operator, between consecutive samples: records read and written per second, busy
    fraction (busy time over parallelism x elapsed), gate depth, parallelism, and the backlog's
    wait: the gate depth over the rate the instances read at (how long a record arriving now
    waits before it is read, if the rate holds)."""
    out: dict = {"t": [], "operators": {}}
    for a, b in itertools.pairwise(samples):
        dt = b.t - a.t
        if dt <= 0:
            continue
        out["t"].append(b.t)
        for name, (rin, rout, busy, depth, p) in b.operators.items():
            s = out["operators"].setdefault(
                name,
                {
                    k: [None] * (len(out["t"]) - 1)
                    for k in ("rate_in", "rate_out", "busy", "depth", "parallelism", "wait_s")
                },
            )
            prev = a.operators.get(name)
            if prev is None:
                rate_in = rate_out = busy_frac = None
            else:
                rate_in = max(rin - prev[0], 0) / dt
                rate_out = max(rout - prev[1], 0) / dt
                busy_frac = min(max(busy - prev[2], 0) / 1e9 / (dt * max(p, 1)), 1.0)
            s["rate_in"].append(rate_in)
            s["rate_out"].append(rate_out)
            s["busy"].append(busy_frac)
            s["depth"].append(depth)
            s["parallelism"].append(p)
            s["wait_s"].append(_wait(depth, rate_in))
        for s in out["operators"].values():  # an operator missing from this sample
            for values in s.values():
                if len(values) < len(out["t"]):
                    values.append(None)
    return out


def _wait(depth: int, rate: float | None) -> float | None:
    if depth == 0:
        return 0.0
    return depth / rate if rate else None  # a backlog nobody reads: unbounded, not drawn


def instance_busy(before: dict, now: dict, dt: float) -> dict[str, list[float]]:
    """Each operator's instances' busy fraction between two statuses."""
    if dt <= 0:
        return {}
    prev = {
        (op["name"], i["index"]): i["busy_ns"] for op in before.get("operators", []) for i in op["instances"]
    }
    busy = {}
    for op in now.get("operators", []):
        busy[op["name"]] = [
            min(max(i["busy_ns"] - prev.get((op["name"], i["index"]), i["busy_ns"]), 0) / 1e9 / dt, 1.0)
            for i in op["instances"]
        ]
    return busy


def new_events(before: dict | None, now: dict, t: float | None) -> list[dict]:
    """The rescales, updates and checkpoints that completed between two statuses (``t`` None:
    those done before the page first saw the job)."""
    events = []
    old = before or {}
    for report in now.get("rescales", [])[len(old.get("rescales", [])) :]:
        text = (
            f"rescaled {report.get('operator')!r} {report.get('old_parallelism')} -> "
            f"{report.get('new_parallelism')} in {report.get('elapsed_ms', 0):.1f} ms"
        )
        events.append({"t": t, "kind": "rescale", "text": text, "report": report})
    for report in now.get("updates", [])[len(old.get("updates", [])) :]:
        text = (
            f"updated {report.get('operator')!r} to code version {report.get('version')} in "
            f"{report.get('elapsed_ms', 0):.1f} ms"
        )
        events.append({"t": t, "kind": "update", "text": text, "report": report})
    ck, old_ck = now.get("checkpoints") or {}, old.get("checkpoints") or {}
    latest = ck.get("latest")
    if latest and (old_ck.get("latest") or {}).get("id") != latest.get("id"):
        text = (
            f"checkpoint {latest['id']} complete: {latest.get('duration_ms', 0):.0f} ms, "
            f"{latest.get('bytes', 0) / 1e6:,.1f} MB"
        )
        events.append({"t": t, "kind": "checkpoint", "text": text, "report": latest})
    if ck.get("failed", 0) > old_ck.get("failed", 0):
        events.append({"t": t, "kind": "checkpoint failed", "text": ck.get("last_error") or "", "report": {}})
    return events


class History:
    """Samples every source's jobs once a second, in a thread of its own, until ``stop``."""

    def __init__(self, sources: list, interval: float = 1.0):
        self.sources, self.interval = sources, interval
        self.jobs: dict[str, JobHistory] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stretch-ui-history", daemon=True)

    def start(self) -> History:
        self.poll()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        t = time.time()
        for index, source in enumerate(self.sources):
            try:
                found = source.statuses()
            except Exception:  # a source that cannot be reached now: its jobs age out
                continue
            for key, status in found.items():
                self.record(f"{index}:{key}", status, t)
        with self.lock:
            for key in [k for k, j in self.jobs.items() if t - j.seen_at > GONE_AFTER_S]:
                del self.jobs[key]

    def record(self, key: str, status: dict, t: float) -> None:
        with self.lock:
            job = self.jobs.get(key)
            if job is None:
                job = self.jobs[key] = JobHistory(status, t)
                job.events.extend(new_events(None, status, None))
            else:
                job.events.extend(new_events(job.status, status, t))
            job.previous, job.previous_t = job.status, job.seen_at
            job.status, job.seen_at = status, t
            job.samples.append(sample_of(status, t))
