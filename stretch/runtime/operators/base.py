"""The part every keyed operator shares: its state tables, and keys -> table rows -> batch-unique
key slots (one vectorized lookup per batch)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stretch.plan.stages import OperatorSpec
from stretch.runtime.batch import KEY_COLUMN, Records, resolve_field
from stretch.runtime.event_time import MIN_WATERMARK
from stretch.runtime.outputs import StepError, short
from stretch.state import _table_kernels as K
from stretch.state.backend import KeyedStateBackend
from stretch.state.key_codec import decode_key
from stretch.state.keyed_table import KeyedTable, KeyMode, fits_mode, key_array, key_mode_of, key_type_name


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
        self._key_mode: KeyMode | None = None  # the operator's, once its first batch fixed it

    def owned_here(self) -> np.ndarray:
        """The key groups this instance owns whose state is in its arena: on a cluster node, not
        those of other nodes, nor those being loaded from one (see KeyedTable.here)."""
        return self.table.here(self.owned)

    def fire(self, domain: int, limit: int) -> Records | None:
        """Fire the timers due at ``limit`` (event time: the watermark; processing: the clock)."""
        return None

    def next_timer(self, domain: int) -> int:
        return 2**63 - 1

    def open(self, runtime_context) -> None:
        pass

    def close(self) -> None:
        pass

    def drop_state(self, name: str) -> None:
        """Clear a state that the operator's code no longer declares (a live update with
        ``drop_orphaned``), in the key groups this instance owns: its memory is reused."""
        registry = self.table.arena.registry()
        sid = next((i for i, e in enumerate(registry) if e["name"] == name), None)
        if sid is None:
            return
        storage = registry[sid]["storage"]
        for kg in self.owned_here().tolist():
            n = self.table.n_keys(kg)
            if not n:
                continue
            kgs, rows = np.full(n, kg, dtype=np.uint16), np.arange(n, dtype=np.int64)
            self.table.begin_write(np.array([kg], dtype=np.uint16))
            try:
                if storage == "var":
                    self.table.write_var(sid, kgs, rows, [None] * n)
                else:
                    dtype = np.dtype(storage)
                    self.table.scatter(sid, dtype, kgs, rows, np.zeros(n, dtype), np.zeros(n, np.uint8))
            finally:
                self.table.end_write(np.array([kg], dtype=np.uint16))

    def key_column(self, batch: pa.RecordBatch) -> tuple[pa.Array, KeyMode]:
        """The batch's keys in the operator's key mode. A batch sent in another mode (its keys
        mixed, or of one other type) fails the job, naming the first record whose key the
        operator cannot hold (``admit`` routes those to dead letters under that policy)."""
        col, mode = self._sent_keys(batch)
        held = self._held_mode()
        if held is None or mode is held:
            return col, mode
        keys = _keys_of(col, mode)
        bad = next((i for i, k in enumerate(keys) if not fits_mode(k, held)), None)
        if bad is not None:
            error = TypeError(self._key_type_message(Records(batch=batch).items()[bad], keys[bad], held))
            error.rejected_key = True  # callers that can route it to dead letters catch it
            raise error
        return key_array(keys, held), held

    def _held_mode(self) -> KeyMode | None:
        """The mode the operator's keys are stored in (fixed for good by the first batch)."""
        if self._key_mode is None:
            self._key_mode = self.table.mode()
        return self._key_mode

    def _key_type_message(self, record, key, held: KeyMode) -> str:
        return (
            f"operator {self.name!r}: record {short(record)} has key {short(key)} of type "
            f"{type(key).__name__}, but the operator's keys are {key_type_name(held)}; one operator's "
            "keys must share one type, as in Flink: make the key selector return one type"
        )

    def admit(self, batch: pa.RecordBatch, kgs: np.ndarray, error: TypeError):
        """After ``key_column`` refused a batch (``error``): under the dead-letter policy, the
        records whose keys the operator cannot hold go to dead letters and the batch and key
        groups of the rest are returned (None, None: no rest); else ``error`` fails the job."""
        outputs = getattr(self, "outputs", None)
        if not getattr(error, "rejected_key", False) or outputs is None or outputs.dead_letter_gate is None:
            raise error
        held = self._held_mode()
        col, mode = self._sent_keys(batch)
        keys, records = _keys_of(col, mode), Records(batch=batch).items()
        keep = []
        for i, key in enumerate(keys):
            if fits_mode(key, held):
                keep.append(i)
                continue
            cause = TypeError(self._key_type_message(records[i], key, held))
            outputs.dead_letter(StepError(self.name, records[i], key, cause, "key type"))
        if not keep:
            return None, None
        return batch.take(pa.array(keep, pa.int64())), kgs[np.asarray(keep, dtype=np.int64)]

    def _sent_keys(self, batch: pa.RecordBatch) -> tuple[pa.Array, KeyMode]:
        """The batch's keys, in the mode its producer sent them."""
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


def _keys_of(col: pa.Array, mode: KeyMode) -> list:
    """A key column's keys as Python values."""
    keys = col.to_pylist()
    return [decode_key(k) for k in keys] if mode is KeyMode.CANONICAL else keys
