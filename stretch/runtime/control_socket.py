"""The job's unix-domain control socket: framing, the server in the coordinator, and clients.

Frames are a 4-byte length, a format byte and the payload. Anyone with access to the socket (it is
owner-only) may send JSON requests; pickled frames are accepted only on connections that proved
they are this job's workers by presenting the job's secret token, so nothing that arrives from
outside the job's own processes is ever unpickled.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import shutil
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import cloudpickle

_HEADER = struct.Struct(">IB")
JSON, PICKLE = ord("J"), ord("P")
MAX_FRAME = 1 << 30


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
    """The info files of this user's jobs whose process is alive; what dead jobs left here (info
    file, socket, staged Spark files) is removed."""
    jobs = []
    for path in sorted(runtime_dir().glob("*.json")):
        try:
            info = json.loads(path.read_text())
            os.kill(int(info["pid"]), 0)
        except ProcessLookupError:
            shutil.rmtree(path.parent / "staging" / info["job_id"], ignore_errors=True)
            with contextlib.suppress(OSError):
                path.unlink()
                Path(info["socket"]).unlink()
            continue
        except (OSError, ValueError, KeyError):
            continue  # being written, or gone meanwhile
        jobs.append(info)
    return jobs


def send(sock: socket.socket, obj, fmt: int = JSON) -> None:
    payload = json.dumps(obj).encode() if fmt == JSON else cloudpickle.dumps(obj)
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


def recv(sock: socket.socket, trusted: bool):
    """Read one frame; pickled frames only from trusted peers."""
    n, fmt = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes refused")
    payload = _recv_exact(sock, n)
    if fmt == JSON:
        return json.loads(payload)
    if fmt == PICKLE and trusted:
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

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class ControlServer:
    """Accepts connections on the job socket and hands each received message to ``on_message``."""

    def __init__(self, path: Path, token: str, on_message: Callable, on_close: Callable):
        self.path = path
        self.token = token
        self.on_message = on_message
        self.on_close = on_close
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(str(path))
        finally:
            os.umask(old)
        self._sock.listen(64)
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
                msg = recv(conn.sock, trusted=conn.worker is not None)
                if isinstance(msg, dict) and msg.get("op") == "hello":
                    if not hmac.compare_digest(str(msg.get("token", "")), self.token):
                        conn.send({"ok": False, "error": "bad token"})
                        break
                    conn.worker = int(msg["worker"])
                    conn.pid = int(msg["pid"])
                self.on_message(conn, msg)
        except (ConnectionError, OSError, ValueError):
            pass
        finally:
            conn.close()
            self.on_close(conn)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def request(path: Path | str, obj: dict, timeout: float = 30.0):
    """Send one JSON request to a job socket and return its JSON reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        send(sock, obj)
        return recv(sock, trusted=False)
