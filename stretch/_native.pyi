"""Typed stubs of ``stretch._native``, compiled from native/stretch_native.c."""

import mmap

class Region:
    """Atomics, futexes and a robust mutex over a pinned writable buffer."""

    def __init__(self, buffer: mmap.mmap | bytearray | memoryview, /) -> None: ...
    @property
    def address(self) -> int:
        """Base address of the pinned buffer."""
    @property
    def size(self) -> int:
        """Size in bytes of the pinned buffer (0 once released)."""
    def load64(self, offset: int, /) -> int:
        """Atomically load the int64 at offset."""
    def store64(self, offset: int, value: int, /) -> None:
        """Atomically store an int64 at offset."""
    def fetch_add64(self, offset: int, delta: int, /) -> int:
        """Atomically add to the int64 at offset; return the old value."""
    def cas64(self, offset: int, expected: int, desired: int, /) -> bool:
        """Compare-and-swap the int64 at offset; return True on success."""
    def max64(self, offset: int, value: int, /) -> int:
        """Atomically raise the int64 at offset to at least value; return the result."""
    def load32(self, offset: int, /) -> int:
        """Atomically load the uint32 at offset."""
    def store32(self, offset: int, value: int, /) -> None:
        """Atomically store a uint32 at offset."""
    def fetch_add32(self, offset: int, delta: int, /) -> int:
        """Atomically add to the uint32 at offset; return the old value."""
    def wait32(self, offset: int, expected: int, timeout: float | None = None, /) -> bool:
        """Futex-wait while the uint32 at offset equals expected; False on timeout."""
    def wake32(self, offset: int, n: int = ..., /) -> int:
        """Futex-wake up to n waiters on the uint32 at offset; the number woken."""
    def lock(self, offset: int, timeout: float | None = None, /) -> bool:
        """Take the robust mutex at offset (a dead owner's lock is taken over); False on timeout."""
    def unlock(self, offset: int, /) -> None:
        """Release the robust mutex at offset."""
    def release(self) -> None:
        """Release the pinned buffer."""

def set_parent_death_signal(signal: int, /) -> None:
    """Ask the kernel to send this signal when the parent thread exits (Linux PR_SET_PDEATHSIG)."""
