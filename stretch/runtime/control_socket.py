"""The job's unix-domain control socket: framing, the server in the coordinator, and clients.

Frames are a 4-byte length, a format byte and the payload. Anyone with access to the socket (it is
owner-only) may send JSON requests, each at most ``MAX_REQUEST`` bytes; pickled frames are
accepted only on connections that proved they are this job's workers by presenting the job's
secret token, so nothing that arrives from outside the job's own processes is ever unpickled.
A worker's messages go to the job's event loop; a request from outside is answered in its own
connection's thread (``runtime.requests``), so no client can stall or fail the job.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

_HEADER = struct.Struct(">IB")
JSON, PICKLE = ord("J"), ord("P")
MAX_FRAME = 1 << 30  # from the job's own workers (a job's prepared stages can be large)
MAX_REQUEST = 1 << 20  # from anyone else
MAX_REPLY = 64 << 20  # what a client accepts from the job (a status of many instances)
REPLY_TIMEOUT = 10.0  # seconds a client that does not read may hold up the sending of its reply


def runtime_dir() -> Path:
    """Where this user's jobs put their sockets: found by the CLI without any configuration."""
    base = os.environ.get("STRETCH_RUNTIME_DIR")
    if base:
        path = Path(base)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "stretch"
    else:
        path = Path("/tmp") / f"stretch-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid() or path.stat().st_mode & 0o077:
        raise PermissionError(f"{path} must be owned by you and not accessible to others")
    return path


def running_jobs() -> list[dict]:
    """The info files of this user's running jobs whose process is alive; what dead jobs left
    here (info file, socket, staged Spark files) is removed."""
    return [info for info in local_jobs() if not info.get("ended")]


def local_jobs() -> list[dict]:
    """``running_jobs()`` and the ended records of jobs whose process still runs (``ended``: how
    each ended, see ``runtime.job_info``); what dead jobs left here is removed."""
    jobs = []
    for path in sorted(runtime_dir().glob("*.json")):
        try:
            info = json.loads(path.read_text())
            os.kill(int(info["pid"]), 0)
        except ProcessLookupError:
            shutil.rmtree(path.parent / "staging" / info["job_id"], ignore_errors=True)
            with contextlib.suppress(OSError):
                path.unlink()
                if info.get("socket"):  # an ended record has none
                    Path(info["socket"]).unlink()
            continue
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or gone meanwhile
        jobs.append(info)
    return jobs


def send(sock: socket.socket, obj, fmt: int = JSON) -> None:
    if fmt == JSON:
        payload = json.dumps(obj).encode()
    else:  # cloudpickle only where pickled frames are sent: not in the command line's clients
        import cloudpickle

        payload = cloudpickle.dumps(obj)
    sock.sendall(_HEADER.pack(len(payload), fmt) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket, trusted: bool, limit: int | None = None):
    """Read one frame; pickled frames only from trusted peers, and frames of at most ``limit``
    bytes (default: ``MAX_FRAME`` from trusted peers, ``MAX_REQUEST`` from others)."""
    n, fmt = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if limit is None:
        limit = MAX_FRAME if trusted else MAX_REQUEST
    if n > limit:
        raise ConnectionError(f"frame of {n} bytes refused (at most {limit})")
    payload = _recv_exact(sock, n)
    if fmt == JSON:
        return json.loads(payload)
    if fmt == PICKLE and trusted:
        import cloudpickle

        return cloudpickle.loads(payload)
    raise ConnectionError("refused a pickled frame from an unauthenticated peer")


class Connection:
    """One peer of the server; ``worker`` is set once the peer proved it belongs to the job."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.worker: int | None = None
        self.pid: int | None = None
        self._lock = threading.Lock()

    def send(self, obj, fmt: int = JSON) -> None:
        with self._lock:
            send(self.sock, obj, fmt)

    def reply(self, obj) -> bool:
        """Answer a client from outside the job: one that left, or does not read within
        ``REPLY_TIMEOUT``, is dropped (False), and the job goes on."""
        try:
            with self._lock:
                self.sock.settimeout(REPLY_TIMEOUT)
                try:
                    send(self.sock, obj)
                finally:
                    self.sock.settimeout(None)
            return True
        except (OSError, ValueError):
            self.close()
            return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class ControlServer:
    """Accepts connections on the job socket: a worker's messages go to ``on_worker_message`` (and
    its leaving to ``on_close``), requests from anyone else to ``on_request`` in the connection's
    own thread."""

    def __init__(
        self, path: Path, token: str, on_worker_message: Callable, on_close: Callable, on_request: Callable
    ):
        self.path = path
        self.token = token
        self.on_worker_message = on_worker_message
        self.on_close = on_close
        self.on_request = on_request
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(str(path))
        finally:
            os.umask(old)
        self._sock.listen(min(socket.SOMAXCONN, 4096))
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="stretch-control", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            if not self._same_user(sock):
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(Connection(sock),), daemon=True).start()

    @staticmethod
    def _same_user(sock: socket.socket) -> bool:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return uid == os.getuid()

    def _serve(self, conn: Connection) -> None:
        try:
            while True:
                try:
                    msg = recv(conn.sock, trusted=conn.worker is not None)
                except ValueError as e:  # not JSON
                    conn.reply({"ok": False, "error": f"a request must be JSON: {e}"})
                    return
                if conn.worker is not None:
                    self.on_worker_message(conn, msg)
                elif isinstance(msg, dict) and msg.get("op") == "hello":
                    if not self._hello(conn, msg):
                        return
                    self.on_worker_message(conn, msg)
                else:
                    self.on_request(conn, msg)
        except (ConnectionError, OSError):
            pass
        finally:
            conn.close()
            if conn.worker is not None:
                self.on_close(conn)

    def _hello(self, conn: Connection, msg: dict) -> bool:
        """A worker proves it belongs to the job with the job's token."""
        import hmac  # the server's only: the command line's clients need not load hashlib

        token = msg.get("token")
        try:
            ok = isinstance(token, str) and hmac.compare_digest(token.encode(), self.token.encode())
            worker, pid = int(msg["worker"]), int(msg["pid"])
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            conn.reply({"ok": False, "error": "bad token"})
            return False
        conn.worker, conn.pid = worker, pid
        return True

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def request(path: Path | str, obj: dict, timeout: float | None = 30.0, on_progress: Callable | None = None):
    """Send one JSON request to a job socket and return its JSON reply.

    A long operation sends progress frames while it works (each passed to ``on_progress``); the
    ``timeout`` bounds the silence between two frames, not the whole operation.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        _connect(sock, str(path), timeout)
        send(sock, obj)
        while True:
            reply = recv(sock, trusted=False, limit=MAX_REPLY)
            if not (isinstance(reply, dict) and reply.get("progress")):
                return reply
            if on_progress is not None:
                on_progress(reply)


def _connect(sock: socket.socket, path: str, timeout: float | None) -> None:
    """Connect, waiting while the job's backlog of connections is full (many clients at once)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError as e:
            if e.errno != errno.EAGAIN or (deadline is not None and time.monotonic() > deadline):
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
