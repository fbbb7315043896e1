"""What every built-in adapter around a user function needs: its life cycle forwarded, and its
function swapped by a live code update."""

from __future__ import annotations

import copy

from stretch.common.wording import a, described
from stretch.contracts.functions import Function
from stretch.errors import UpdateRefused


def replaced(adapter, attribute: str, new, accepts: tuple, callables: bool = True):
    """A copy of ``adapter`` whose ``attribute`` is ``new`` (a live update), if ``new`` is one of
    ``accepts`` (or, where ``callables``, a plain callable); else the update is refused."""
    if isinstance(new, accepts) or (callables and callable(new) and not isinstance(new, Function)):
        clone = copy.copy(adapter)
        setattr(clone, attribute, new)
        return clone
    kinds = " or ".join(a(c.__name__) for c in accepts) + (" or a callable" if callables else "")
    raise UpdateRefused(f"this operator runs {kinds}; the new code is {described(new)}")


class Wrapping:
    """Forwards open/close to the wrapped user function ``fn`` (so it may use keyed state); a
    plain callable has neither."""

    accepts: tuple = ()  # the kinds of function a live update may put in place of ``fn``
    callables = True  # ... or a plain callable

    def __init__(self, fn):
        self.fn = fn

    def open(self, runtime_context) -> None:
        if isinstance(self.fn, Function):
            self.fn.open(runtime_context)

    def close(self) -> None:
        if isinstance(self.fn, Function):
            self.fn.close()

    def _with_user_function(self, new):
        return replaced(self, "fn", new, self.accepts, self.callables)
