"""Serve the UI from a thread of this process: uvicorn on a socket bound here, so a busy port
fails at once in the caller and port 0 gives the free port it got."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import quote

from stretch.ui.config import UIConfig
from stretch.ui.history import History

START_TIMEOUT = 10.0


def require_ui():
    """Starlette and uvicorn, or an error naming the extra that brings them."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise ImportError(f"the stretch UI needs the 'ui' extra: pip install 'stretch[ui]' ({e})") from None
    return uvicorn


class UIServer:
    """The page and its API for ``sources`` (see ``stretch.ui.sources``), until ``stop``."""

    def __init__(self, sources: list, config: UIConfig):
        self.config = config
        self.history = History(sources)
        self._server = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.port = 0

    def start(self) -> UIServer:
        uvicorn = require_ui()
        from stretch.ui.app import make_app

        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as e:
            sock.close()
            raise OSError(
                f"the stretch UI cannot listen on {self.config.host}:{self.config.port}: {e}"
            ) from None
        sock.listen(64)
        self.port = sock.getsockname()[1]
        settings = uvicorn.Config(
            make_app(self.history, self.config.secret),
            log_level="warning",
            lifespan="off",
            ssl_certfile=self.config.certfile,
            ssl_keyfile=self.config.keyfile,
        )
        self._server = uvicorn.Server(settings)
        self.history.start()
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="stretch-ui", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the stretch UI did not start (see the log above)")
            time.sleep(0.01)
        self._sock = sock
        return self

    @property
    def address(self) -> str:
        """The page's address, without the secret (what to share with people who only look)."""
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        elif ":" in host:
            host = f"[{host}]"
        return f"{self.config.scheme}://{host}:{self.port}/"

    @property
    def url(self) -> str:
        """The address with the secret: opening it lets that browser rescale."""
        return f"{self.address}?secret={quote(self.config.secret, safe='')}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(START_TIMEOUT)
        self.history.stop()
        for source in self.history.sources:
            source.close()
        if self._sock is not None:
            self._sock.close()
