"""PyFlink: ``pyflink.datastream.state_backend``; defined in ``stretch.contracts.execution``.

Whichever is chosen, keyed state lives in shared memory and is snapshotted at checkpoints."""

from stretch.contracts.execution import (
    EmbeddedRocksDBStateBackend,
    FsStateBackend,
    HashMapStateBackend,
    MemoryStateBackend,
    RocksDBStateBackend,
    StateBackend,
)

__all__ = [
    "EmbeddedRocksDBStateBackend",
    "FsStateBackend",
    "HashMapStateBackend",
    "MemoryStateBackend",
    "RocksDBStateBackend",
    "StateBackend",
]
