"""Keyed state: key groups, shared-memory state tables, timers, snapshots, and state read from
checkpoints (``read_checkpoint``; see ``stretch.state.checkpoints``)."""

from __future__ import annotations

_PUBLIC = (
    "CheckpointNotFound",
    "IncompleteCheckpoint",
    "OperatorCheckpoint",
    "checkpoint_dir",
    "open_checkpoint",
    "read_checkpoint",
    "write_checkpoint",
)


def __getattr__(name: str):
    """The checkpoint names, imported on first use: importing any module of this package (the
    engine's workers do) does not pay for them."""
    if name in _PUBLIC:
        from stretch.state import checkpoints

        return getattr(checkpoints, name)
    raise AttributeError(f"module 'stretch.state' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
