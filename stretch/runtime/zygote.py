"""The zygote: a warm, single-threaded process that forks workers in milliseconds.

One per Python process, shared by the jobs it runs one after another (as multiprocessing's fork
server is): it imports the engine and loads the numba kernels once, about two seconds, and every
worker of every job is then a fork of it, so neither a job's start nor a rescale waits for Python to
start, modules to import or numba to compile. It dies with the process that started it
(PR_SET_PDEATHSIG, from a thread that lives as long as the process), and its workers with it, so
nothing outlives the user's program even if it is killed; ``shutdown`` ends it sooner.

The zygote imports the very ``stretch`` package its parent runs, wherever the current directory
is: a source checkout (with a ``stretch/`` folder but no built extension) or a user's folder must
not shadow the installed package. Each worker takes the parent's ``sys.path``, environment and
current directory as they are when it is forked, so the modules of the user's script folder that
functions refer to import in workers as they do in the parent.
"""

from __future__ import annotations

import atexit
import gc
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
    """Warm up, then fork a worker for each request. Everything the zygote holds then (the
    modules of numpy, pyarrow, numba and the engine: a few hundred thousand objects) is frozen
    out of the cyclic collector before a fork: a worker's full collection would otherwise scan
    it all, a pause of about 200 ms in the middle of its work, and write to every page it scans."""
    cmd = os.fdopen(cmd_fd, "r")
    resp = os.fdopen(resp_fd, "w", buffering=1)
    config = json.loads(cmd.readline())
    sys.path[:] = config["sys_path"]  # stretch itself is imported already, from the parent's root
    from stretch.runtime import worker

    worker.warm_up(config["preload"])
    gc.collect()  # what warming up left behind is not frozen with the rest (below)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    resp.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in cmd:
        msg = json.loads(line)
        if "fork" in msg:
            try:  # a job's function libraries, once: every later fork has them in memory
                sys.path[:] = msg["sys_path"]
                worker.warm_up([m for m in msg["preload"] if m not in sys.modules], kernels=False)
            except Exception as e:
                resp.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
                continue
            gc.freeze()  # workers' collections skip the zygote's objects (_serve's docstring)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    cmd.close()
                    resp.close()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    set_parent_death_signal(signal.SIGKILL)
                    os.environ.clear()
                    os.environ.update(msg["env"])
                    os.chdir(msg["cwd"])
                    code = worker.main(msg["socket"], msg["token"], int(msg["fork"]))
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
    """A handle on a zygote: start it, fork workers, stop it. ``shared()`` is the process's own."""

    def __init__(self, preload: tuple[str, ...] = ()):
        """``preload``: modules the zygote imports before it forks (the API's function libraries)."""
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
        self._send({"sys_path": parent_path(), "preload": list(preload)})
        self._ready = None

    def _send(self, obj) -> None:
        self._cmd.write(json.dumps(obj) + "\n")

    def wait_ready(self) -> None:
        if self._ready is None:
            line = self._resp.readline()
            if not line:
                raise RuntimeError("the stretch zygote process failed to start (see its error output above)")
            self._ready = json.loads(line)

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, socket_path: str, token: str, worker_id: int, preload: tuple[str, ...] = ()) -> int:
        """Fork a worker that will connect to the job socket ``socket_path``; returns its pid."""
        with self._lock:
            self.wait_ready()
            self._send(
                {
                    "fork": worker_id,
                    "socket": socket_path,
                    "token": token,
                    "preload": list(preload),
                    "sys_path": parent_path(),
                    "env": {**os.environ, "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")},
                    "cwd": os.getcwd(),
                }
            )
            reply = self._resp.readline()
            if not reply:
                raise RuntimeError("the stretch zygote process died")
            answer = json.loads(reply)
            if "error" in answer:
                raise RuntimeError(
                    f"the stretch zygote could not import the job's modules: {answer['error']}"
                )
            return int(answer["pid"])

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


_shared: Zygote | None = None
_shared_lock = threading.Lock()


def shared(preload: tuple[str, ...] = ()) -> Zygote:
    """The process's zygote, started on first use (again if it died). It is started from a thread
    of its own that lives as long as the process: the parent-death signal follows the thread that
    forked, and a job's thread ends with the job."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive():
            if _shared is not None:
                _shared.stop()  # it died: close its pipes
            started: list = []
            ready = threading.Event()

            def keep() -> None:
                try:
                    started.append(Zygote(preload))
                except BaseException as e:
                    started.append(e)
                    return
                finally:
                    ready.set()
                started[0].process.wait()  # this thread lives as long as the zygote

            threading.Thread(target=keep, name="stretch-zygote", daemon=True).start()
            ready.wait()
            if isinstance(started[0], BaseException):
                raise started[0]
            _shared = started[0]
        return _shared


def _forget_in_child() -> None:
    """A process forked from this one (by multiprocessing, say) starts a zygote of its own: the
    parent's pipes are not its to use."""
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def shared_pid() -> int | None:
    """The pid of the process's zygote, if one runs."""
    return _shared.process.pid if _shared is not None and _shared.alive() else None


def shutdown() -> None:
    """End the process's zygote (it ends with the process anyway); the next job starts another."""
    global _shared
    with _shared_lock:
        if _shared is not None:
            _shared.stop()
            _shared = None


atexit.register(shutdown)

if __name__ == "__main__":  # python -m stretch.runtime.zygote CMD_FD RESP_FD, as engines before _BOOT ran it
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
