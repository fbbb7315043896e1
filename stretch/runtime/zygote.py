"""The zygote: a warm, single-threaded process that forks workers in milliseconds.

The coordinator starts one per job. It imports the engine and loads the numba kernels once; every
worker is then a fork of it, so starting a worker (for a job or a rescale) never waits for Python to
start, modules to import or numba to compile. Both the zygote and its workers die with their
parent (PR_SET_PDEATHSIG), so nothing outlives the job even if the coordinator is killed.

The zygote imports the very ``stretch`` package its parent runs, wherever the current directory
is: a source checkout (with a ``stretch/`` folder but no built extension) or a user's folder must
not shadow the installed package. Then it takes the parent's ``sys.path`` as it is, so the modules
of the user's script folder that functions refer to import in workers as they do in the parent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from stretch._native import set_parent_death_signal

# Run by ``python -c`` with argv [package root, cmd fd, resp fd]: the package root goes first on
# the path before anything of stretch is imported (``-m`` would put the current directory first).
# Ctrl-C in a terminal reaches the whole process group: only the user's program answers it (and
# ends the job); the zygote and its workers ignore it rather than print tracebacks of their own.
_BOOT = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from stretch.runtime.zygote import main; sys.exit(main(int(sys.argv[2]), int(sys.argv[3])))"
)


def package_root() -> str:
    """The directory this process imported ``stretch`` from (its site-packages, or a checkout)."""
    import stretch

    return os.path.dirname(os.path.dirname(os.path.abspath(stretch.__file__)))


def parent_path() -> list[str]:
    """This process's import path with relative entries ('' is the current directory) made
    absolute, so that they mean the same in the zygote even if the directory changes later."""
    return [os.path.abspath(p) if not os.path.isabs(p) else p for p in sys.path]


def _serve(cmd_fd: int, resp_fd: int) -> int:
    cmd = os.fdopen(cmd_fd, "r")
    resp = os.fdopen(resp_fd, "w", buffering=1)
    config = json.loads(cmd.readline())
    sys.path[:] = config["sys_path"]  # stretch itself is imported already, from the parent's root
    from stretch.runtime import worker

    worker.warm_up(config["preload"])
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    resp.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in cmd:
        msg = json.loads(line)
        if "fork" in msg:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    cmd.close()
                    resp.close()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    set_parent_death_signal(signal.SIGKILL)
                    code = worker.main(config["socket"], config["token"], int(msg["fork"]))
                finally:
                    os._exit(code)
            resp.write(json.dumps({"pid": pid, "worker": msg["fork"]}) + "\n")
        elif msg.get("exit"):
            break
    return 0


def main(cmd_fd: int, resp_fd: int) -> int:
    set_parent_death_signal(signal.SIGKILL)
    return _serve(cmd_fd, resp_fd)


class Zygote:
    """The coordinator's handle on its zygote: start it, fork workers, stop it."""

    def __init__(self, socket_path: str, token: str, preload: tuple[str, ...] = ()):
        """``preload``: modules the zygote imports before it forks (the job's function libraries)."""
        cmd_r, self._cmd_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, package_root(), str(cmd_r), str(resp_w)],
            pass_fds=(cmd_r, resp_w),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        os.close(cmd_r)
        os.close(resp_w)
        self._cmd = os.fdopen(self._cmd_w, "w", buffering=1)
        self._resp = os.fdopen(self._resp_r, "r")
        self._lock = threading.Lock()
        self._send(
            {"socket": socket_path, "token": token, "sys_path": parent_path(), "preload": list(preload)}
        )
        self._ready = None

    def _send(self, obj) -> None:
        self._cmd.write(json.dumps(obj) + "\n")

    def wait_ready(self) -> None:
        if self._ready is None:
            line = self._resp.readline()
            if not line:
                raise RuntimeError("the stretch zygote process failed to start (see its error output above)")
            self._ready = json.loads(line)

    def fork(self, worker_id: int) -> int:
        """Fork a worker that will connect to the job socket; returns its pid."""
        with self._lock:
            self.wait_ready()
            self._send({"fork": worker_id})
            line = self._resp.readline()
            if not line:
                raise RuntimeError("the stretch zygote process died")
            return int(json.loads(line)["pid"])

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            try:
                self._send({"exit": True})
                self._cmd.close()
            except (BrokenPipeError, ValueError, OSError):
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self._resp.close()


if __name__ == "__main__":  # python -m stretch.runtime.zygote CMD_FD RESP_FD, as engines before _BOOT ran it
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
