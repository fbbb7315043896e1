"""Where and how the UI listens, and what a change (a rescale) must present."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8081  # Flink's web UI port: where its users look first


@dataclass(frozen=True)
class UIConfig:
    """``host``: loopback unless told otherwise. ``port`` 0: any free one. ``secret``: what a
    change must carry (the cookie the page's first URL sets, or an ``X-Stretch-Secret`` header);
    None makes a fresh one, printed in that URL. A cluster's UI uses the cluster's secret.
    ``certfile``/``keyfile``: serve HTTPS (PEM), as the control plane's TLS option does."""

    host: str = LOOPBACK
    port: int = 0
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    certfile: str | None = None
    keyfile: str | None = None

    def __post_init__(self):
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("UIConfig: give both certfile and keyfile (PEM), or neither")
        if not self.secret:
            raise ValueError("UIConfig: the secret must not be empty")

    @classmethod
    def of(cls, ui: bool | int | UIConfig, secret: str | None = None) -> UIConfig:
        """``ui=True`` (any free loopback port), a port number, or a UIConfig."""
        if isinstance(ui, UIConfig):
            return ui
        if ui is True:
            ui = 0
        if isinstance(ui, bool) or not isinstance(ui, int) or ui < 0:
            raise TypeError(f"ui must be True, a port number or a stretch.ui.UIConfig, got {ui!r}")
        return cls(port=ui, **({"secret": secret} if secret else {}))

    @property
    def scheme(self) -> str:
        return "https" if self.certfile else "http"
