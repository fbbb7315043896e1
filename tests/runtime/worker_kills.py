"""Killing a busy worker of a running checkpointed job with SIGKILL, as the recovery tests do.

The kills wait for a worker to be busy (with a deadline) rather than assume one is: on a loaded
machine workers start, and recoveries rebuild the job, slower than the tests' delays.
"""

from __future__ import annotations

import os
import random
import signal
import time

WAIT_S = 30.0  # how long a worker may take to be busy (a recovery under heavy load takes seconds)


def busy_workers(co, stage: str | None = None) -> list:
    """The job's workers running a task (of the named operator's stage, if given)."""
    stage_id = co.plan.stage(stage).id if stage is not None else None
    return [
        w
        for w in co.workers.all()
        if w.task is not None and w.pid and (stage_id is None or w.task[0] == stage_id)
    ]


def kill_a_busy_worker(co, rng: random.Random, stage: str | None = None, timeout: float = WAIT_S):
    """SIGKILL a random busy worker (of ``stage``'s operator, if given) as soon as there is one;
    returns it. Fails the test if none is busy within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (busy := busy_workers(co, stage)):
        assert not co.done, "the job ended before a worker could be killed"
        assert time.monotonic() < deadline, f"no busy worker within {timeout} s"
        time.sleep(0.005)
    victim = rng.choice(busy)
    os.kill(victim.pid, signal.SIGKILL)
    return victim


def finish_after_a_kill(client, rng: random.Random, after: tuple[float, float], stage: str | None = None):
    """Kill a busy worker (of ``stage``, if given) a random ``after`` seconds into the job; the job
    must then recover and finish. Returns the victim; cancels the job if it did not finish."""
    co = client._coordinator
    try:
        time.sleep(rng.uniform(*after))
        victim = kill_a_busy_worker(co, rng, stage)
        assert client.wait(60).name == "FINISHED"
    finally:
        if not co.done:
            client.cancel()
            client.wait(30)
    return victim


def wait_for_recoveries(co, count: int, timeout: float = WAIT_S) -> None:
    """Wait until the job has recovered ``count`` times: its new workers are being started."""
    deadline = time.monotonic() + timeout
    while len(co.recoveries) < count:
        assert not co.done, f"the job ended after {len(co.recoveries)} recoveries, not {count}"
        assert time.monotonic() < deadline, f"{len(co.recoveries)} recoveries after {timeout} s, not {count}"
        time.sleep(0.005)
