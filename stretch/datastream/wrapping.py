"""What every built-in adapter around a user function needs: its life cycle forwarded."""

from __future__ import annotations

from stretch.contracts.functions import Function


class Wrapping:
    """Forwards open/close to the wrapped user function ``fn`` (so it may use keyed state); a
    plain callable has neither."""

    def __init__(self, fn):
        self.fn = fn

    def open(self, runtime_context) -> None:
        if isinstance(self.fn, Function):
            self.fn.open(runtime_context)

    def close(self) -> None:
        if isinstance(self.fn, Function):
            self.fn.close()
