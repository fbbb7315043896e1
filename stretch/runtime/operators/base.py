"""The part every keyed operator shares: its state tables, and keys -> table rows -> batch-unique
key slots (one vectorized lookup per batch)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stretch.plan.stages import OperatorSpec
from stretch.runtime.batch import KEY_COLUMN, Records, resolve_field
from stretch.runtime.event_time import MIN_WATERMARK
from stretch.state import _table_kernels as K
from stretch.state.backend import KeyedStateBackend
from stretch.state.key_codec import decode_key
from stretch.state.keyed_table import KeyedTable, KeyMode, key_mode_of


class KeyedOperator:
    """Shared part: the state tables, and keys -> table rows -> batch-unique key slots."""

    def __init__(self, spec: OperatorSpec, name: str, table: KeyedTable):
        self.spec = spec
        self.name = name
        self.table = table
        self.backend = KeyedStateBackend(table)
        self._scratch = np.zeros(0, dtype=np.int64)
        self.watermark = MIN_WATERMARK  # this instance's input watermark
        self.rows_in = 0  # rows of the last batch this instance owned (operators with process_owned)
        self.owned = np.zeros(0, dtype=np.int64)  # key groups this instance owns (set per epoch)

    def fire(self, domain: int, limit: int) -> Records | None:
        """Fire the timers due at ``limit`` (event time: the watermark; processing: the clock)."""
        return None

    def next_timer(self, domain: int) -> int:
        return 2**63 - 1

    def open(self, runtime_context) -> None:
        pass

    def close(self) -> None:
        pass

    def key_column(self, batch: pa.RecordBatch) -> tuple[pa.Array, KeyMode]:
        schema = batch.schema
        if KEY_COLUMN in schema.names:
            i = schema.get_field_index(KEY_COLUMN)
            f = schema.field(i)
            canonical = (f.metadata or {}).get(b"stretch.key") == b"canonical"
            return batch.column(i), KeyMode.CANONICAL if canonical else key_mode_of(f.type)
        col = batch.column(resolve_field(schema, self.spec.key.field))
        return col, key_mode_of(col.type)

    def locate(self, batch: pa.RecordBatch, kgs: np.ndarray):
        """(key column, rows, unique slot per row, first position of each slot) for a batch."""
        col, mode = self.key_column(batch)
        try:
            rows = self.table.rows(kgs, col, mode)
        except TypeError as e:
            raise TypeError(f"operator {self.name!r}: {e}") from None
        n = len(rows)
        size = 1 << max(2 * n - 1, 1).bit_length()
        if self._scratch.shape[0] < size:
            self._scratch = np.zeros(size, dtype=np.int64)
        scratch = self._scratch[:size]
        scratch[:] = 0
        uidx = np.empty(n, dtype=np.int64)
        first = np.empty(n, dtype=np.int64)
        nu = K.dedup(kgs, rows, scratch, uidx, first)
        return col, mode, rows, uidx, first[:nu]

    @staticmethod
    def python_keys(col: pa.Array, mode: KeyMode, first: np.ndarray) -> list:
        picked = col.take(first)
        if mode is KeyMode.CANONICAL:
            return [decode_key(b) for b in picked.to_pylist()]
        if mode is KeyMode.INT64 and pa.types.is_int64(col.type) and not picked.null_count:
            return picked.to_numpy().tolist()
        return picked.to_pylist()
