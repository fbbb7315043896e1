"""SIGTERM ends the jobs of this process cleanly: cancelled, workers stopped, segments removed.

Installed when a job starts, only if the process still has the default SIGTERM action (a user's or
framework's own handler is left alone). After the jobs have shut down, the signal is delivered
again with its default action, so the process ends as a terminated process does.
"""

from __future__ import annotations

import os
import signal
import threading
import weakref

from stretch.runtime import job_info

_running: weakref.WeakSet = weakref.WeakSet()
_GRACE = 10.0  # seconds each job gets to shut down


def register(coordinator) -> None:
    """Cancel this job on SIGTERM (installs the handler on first use, from the main thread)."""
    _running.add(coordinator)
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    jobs = [c for c in list(_running) if not c.done]
    for c in jobs:
        c.cancel()
    for c in jobs:
        c.wait(_GRACE)
    job_info.forget_ended()  # the signal ends the process without its exit hooks
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
