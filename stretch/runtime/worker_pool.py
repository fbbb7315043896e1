"""A job's worker processes: forked from the process's shared zygote, each one connects back to
the job's control socket, is given the job once, then runs one task at a time (a source, an
operator instance), or waits idle as a spare, so that a rescale or an update starts new instances
in an already warm process."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass

from stretch.runtime import zygote


@dataclass
class Worker:
    id: int
    pid: int | None = None
    conn: object = None  # its control-socket connection, once it said hello
    task: tuple[int, int] | None = None  # (stage id, instance index)
    exited: bool = False


class WorkerPool:
    """The workers of one job (``socket``, ``token``: where and how they prove they are its)."""

    def __init__(self, socket: str, token: str, preload):
        self.socket, self.token, self.preload = socket, token, preload
        self._ids = itertools.count()
        self._workers: dict[int, Worker] = {}
        self.zygote: zygote.Zygote | None = None  # the process's shared one, from the first spawn
        # Forks take turns with stopping and killing, which thus see every worker forked; the job
        # thread refills the warm pool without its own lock (JobLoop.replenish), and the readers
        # below take a copy of the workers, so a fork under way (tens of ms on busy cores) holds
        # up neither a rescale placing its epoch nor the job's events.
        self._forking = threading.Lock()
        self._stopped = False

    def spawn(self) -> Worker | None:
        """Fork a worker (None once the pool is stopped: the job is ending)."""
        with self._forking:
            if self._stopped:
                return None
            if self.zygote is None:
                self.zygote = zygote.shared(self.preload)
            wid = next(self._ids)
            w = self._workers[wid] = Worker(wid)
            w.pid = self.zygote.fork(self.socket, self.token, wid, self.preload)
            return w

    def of(self, conn) -> Worker | None:
        """The worker on this connection (None: one that a recovery ended, or a stranger)."""
        return self._workers.get(conn.worker) if conn.worker is not None else None

    def all(self) -> list[Worker]:
        return list(self._workers.values())  # one step under the GIL: a fork may add one meanwhile

    def idle(self) -> list[Worker]:
        return [w for w in self.all() if w.conn is not None and w.task is None and not w.exited]

    def live(self) -> list[Worker]:
        return [w for w in self.all() if w.conn is not None and not w.exited]

    def starting(self) -> int:
        """Forked (or forking), not connected yet."""
        return sum(1 for w in self.all() if w.conn is None and not w.exited)

    def kill_all(self, timeout: float) -> None:
        """SIGKILL every worker and forget them (a recovery starts a new set)."""
        with self._forking:
            workers = [w for w in self._workers.values() if w.pid]
            for w in workers:
                w.exited = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
            self._workers.clear()
        deadline = time.monotonic() + timeout
        while any(alive(w.pid) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.001)

    def stop(self, timeout: float) -> None:
        """Ask the connected workers to exit, kill those still starting (nobody will answer them),
        wait, and kill whatever is left after ``timeout``. No worker is forked after it."""
        with self._forking:
            self._stopped = True
        for w in self._workers.values():
            if w.conn is not None and not w.exited:
                with contextlib.suppress(OSError):
                    w.conn.send({"op": "exit"})
            elif w.pid and not w.exited:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        pids = [w.pid for w in self._workers.values() if w.pid]
        while time.monotonic() < deadline:
            if not any(alive(p) for p in pids):
                return
            time.sleep(0.01)
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
