"""Where checkpoints lie on disk: the names the engine, the cluster and the checkpoint reader share.

They live down here, not in the runtime or the cluster that write checkpoints, so that
``stretch.state`` can read a checkpoint with no running engine and without importing the floors
above it (see the layer contract in pyproject.toml).

One machine, per job name, under ``job_dir(name)/checkpoints/``:

- ``<id, 10 digits>/``: one checkpoint, ``<stage>-<instance>.arrow`` per instance (key-group
  snapshots, ``stretch.state.snapshot``) and ``_metadata.json``, written last: complete once it is
  there;
- ``_run_start.json``: where the run began (checkpoint 0, no state); ``_finished.json``: the job
  ended, nothing is left to restore.

A cluster, under its ``checkpoint_dir``: ``nodes/<node>/manifest.json`` (the checkpoint each of the
node's key groups restores from) and ``nodes/<node>/checkpoints/<name>/`` (``c<id>`` for the
cluster's checkpoints, ``h<version>-...`` for a handoff's): ``<job dir name>/<operator>.arrow`` per
job and keyed operator, and ``_metadata.json``, written last.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

METADATA = "_metadata.json"
RUN_START = "_run_start.json"
FINISHED = "_finished.json"
MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"
NODES = "nodes"


def state_root() -> Path:
    """``$STRETCH_STATE_DIR``, else ``$XDG_STATE_HOME/stretch``, else ``~/.local/state/stretch``."""
    explicit = os.environ.get("STRETCH_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "stretch"


def job_dir_name(job_name: str) -> str:
    """The directory name of a job name: readable (the name with anything but letters, digits,
    ``_`` and ``-`` made ``_``) and one-to-one (a hash of the exact name follows), so that
    ``clicks per user`` and ``clicks_per_user`` never share checkpoints or logs. No name has a
    ``.``, which only private run directories (``<name>.run-<job id>``) have."""
    slug = re.sub(r"[^A-Za-z0-9_-]", "_", job_name)[:80]
    digest = hashlib.sha256(job_name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{slug}-{digest}"


def job_dir(job_name: str) -> Path:
    """A job's directory, named after the job (the name is what a restarted job shares)."""
    return state_root() / "jobs" / job_dir_name(job_name)


def checkpoint_dir(job_name: str) -> Path:
    """Where a job run on this machine keeps its checkpoints (``read_checkpoint`` reads them)."""
    return job_dir(job_name) / CHECKPOINTS


def snapshot_file(root: Path, checkpoint: int, stage: int, instance: int) -> Path:
    """Where an instance writes its key groups at a checkpoint."""
    return Path(root) / f"{checkpoint:010d}" / f"{stage}-{instance}.arrow"


def node_dir(checkpoint_dir: str | os.PathLike, node: str) -> Path:
    """A cluster node's part of the cluster's checkpoint directory."""
    return Path(checkpoint_dir) / NODES / node


def operator_file(checkpoint: str | os.PathLike, job: str, operator: str) -> Path:
    """A keyed operator's key-group snapshots in one checkpoint of a cluster node."""
    return Path(checkpoint) / job_dir_name(job) / f"{operator}.arrow"
