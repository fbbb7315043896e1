"""State from checkpoints, for a job that finished or died, or is still running, as Arrow; and
state written into them, for a job to restore from: Flink's State Processor API.

>>> from stretch.state import checkpoint_dir, read_checkpoint, write_checkpoint
>>> read_checkpoint(checkpoint_dir("clicks"), "running-total")   # key_group, key, one column per state
>>> write_checkpoint(checkpoint_dir("clicks"), "running-total", fixed)  # a new checkpoint to restore

The table is the one a running job's state read gives (``JobClient.query_state``, Spark's
``format("stretch").option("state", ...)``), so the two compare directly. Spark reads the same
with ``spark.read.format("stretch").option("checkpoint", path).option("state", operator)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import pyarrow as pa

from stretch.state.checkpoint_finder import CheckpointNotFound, IncompleteCheckpoint, find_operator
from stretch.state.checkpoint_layout import checkpoint_dir
from stretch.state.checkpoint_reader import OperatorCheckpoint
from stretch.state.checkpoint_writer import write_checkpoint

__all__ = [
    "CheckpointNotFound",
    "IncompleteCheckpoint",
    "OperatorCheckpoint",
    "checkpoint_dir",
    "open_checkpoint",
    "read_checkpoint",
    "write_checkpoint",
]


def read_checkpoint(
    path: str | os.PathLike,
    operator: str,
    checkpoint: int | None = None,
    job: str | None = None,
    key_groups: Iterable[int] | None = None,
) -> pa.Table:
    """A keyed operator's state in a checkpoint: one row per key (key group, key, one column per
    declared state), as a running job's state reads give it.

    Args:
        path: a job's checkpoint directory (``checkpoint_dir(job_name)`` on the machine it ran
            on), the job's directory holding it, one checkpoint's directory in it, or a
            cluster's ``checkpoint_dir``.
        operator: the keyed operator's name (``.name(...)``).
        checkpoint: which checkpoint (its id); by default the latest complete one. A cluster's
            nodes keep only their latest.
        job: on a cluster's directory, the job, if several have an operator of that name.
        key_groups: only these key groups.

    Raises:
        CheckpointNotFound: nothing at ``path``, no complete checkpoint, or not the one asked for.
        LookupError: no keyed operator of that name (the message lists those there).

    An incomplete checkpoint newer than the one read (its job died or stopped while taking it)
    is skipped with an ``IncompleteCheckpoint`` warning.
    """
    return find_operator(path, operator, checkpoint, job).read(key_groups)


def open_checkpoint(
    path: str | os.PathLike, operator: str, checkpoint: int | None = None, job: str | None = None
) -> OperatorCheckpoint:
    """Where an operator's key groups are in a checkpoint (arguments as ``read_checkpoint``'s),
    to read them in parts, or elsewhere: ``.key_groups()``, ``.schema()``, ``.read(key_groups)``."""
    return find_operator(path, operator, checkpoint, job)
