"""The records that cross a stage: Arrow batches in gates, with the engine's own columns.

A gate batch carries the records' fields and, where the producer added them, ``__kg`` (key group),
``__key`` (a key a selector computed, or a canonical encoding of a key field) and ``__ts`` (event
time). Inside a stage, ``Records`` holds a batch, a Python list, or both, converted on demand.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stretch.common.batch_decoding import from_batch
from stretch.common.records import RecordTypeError, to_batch
from stretch.contracts.output_tag import OutputTag
from stretch.runtime.outputs import short

KEY_COLUMN = "__key"
KG_COLUMN = "__kg"
TS_COLUMN = "__ts"
CANONICAL_META = {b"stretch.key": b"canonical"}
INFERRED_META = b"stretch.inferred"


class Records:
    """Records in flight: an Arrow batch, a Python list, or both (each made on demand), and the
    records' event timestamps (epoch ms; the batch's ``__ts`` column in gates) if they have any.
    ``producer`` names the operator whose outputs the records are, for the error a record that
    does not fit ``type_info`` (its declared output type) raises."""

    __slots__ = ("_batch", "_items", "_ts", "producer", "side", "type_info")

    def __init__(
        self,
        batch: pa.RecordBatch | None = None,
        items: list | None = None,
        type_info=None,
        timestamps: np.ndarray | None = None,
        side: dict | None = None,
        producer: str | None = None,
    ):
        self._batch = batch
        self._items = items
        self.type_info = type_info
        self._ts = timestamps
        self.side = side  # side outputs: tag id -> Records
        self.producer = producer

    def timestamps(self) -> np.ndarray | None:
        if self._ts is None and self._batch is not None and TS_COLUMN in self._batch.schema.names:
            self._ts = self._batch.column(TS_COLUMN).to_numpy()
        return self._ts

    def __len__(self) -> int:
        return self._batch.num_rows if self._batch is not None else len(self._items)

    def items(self) -> list:
        if self._items is None:
            self._items = from_batch(self._batch)
        return self._items

    def batch(self) -> pa.RecordBatch:
        if self._batch is None:
            try:
                batch = to_batch(self._items, self.type_info)
            except RecordTypeError as e:  # its index in this batch would mean nothing to the user
                if self.producer is None:
                    raise
                raise TypeError(
                    f"operator {self.producer!r}: its output {short(e.record)} {e.reason}"
                ) from None
            if self.type_info is None:  # remembered so print() can show the records as Python does
                batch = batch.replace_schema_metadata({**(batch.schema.metadata or {}), INFERRED_META: b"1"})
            self._batch = batch
        return self._batch

    def data_batch(self) -> pa.RecordBatch:
        """The batch without engine columns (``__kg``, ``__key``)."""
        b = self.batch()
        keep = [
            i for i, name in enumerate(b.schema.names) if not name.startswith("__") or name == "__row_kind"
        ]
        return b if len(keep) == b.num_columns else b.select(keep)


def resolve_field(schema: pa.Schema, field: str | int) -> int:
    """Column index of a record field given by name or by position among the data columns."""
    data = [i for i, name in enumerate(schema.names) if not name.startswith("__")]
    if isinstance(field, int):
        if not 0 <= field < len(data):
            raise IndexError(f"field position {field} is out of range for records with {len(data)} fields")
        return data[field]
    if field not in schema.names or field.startswith("__"):
        names = [schema.names[i] for i in data]
        raise KeyError(f"records have no field {field!r} (fields: {names})")
    return schema.get_field_index(field)


def split_outputs(
    items: list, stamps: list | None, timestamped: bool, type_info, producer: str | None = None
) -> Records:
    """An operator's outputs as Records: ``(tag, value)`` pairs go to their side outputs, and for
    functions that emit ``(value, timestamp)`` pairs the timestamps are taken apart. ``producer``:
    the operator's name, for errors."""
    if timestamped:
        stamps = [ts for _, ts in items]
        items = [v for v, _ in items]
    side: dict = {}
    if any(type(o) is tuple and len(o) == 2 and type(o[0]) is OutputTag for o in items):
        main, main_ts = [], []
        for i, o in enumerate(items):
            if type(o) is tuple and len(o) == 2 and type(o[0]) is OutputTag:
                vals, tss, _ = side.setdefault(o[0].tag_id, ([], [], o[0]))
                vals.append(o[1])
                tss.append(stamps[i] if stamps is not None else None)
            else:
                main.append(o)
                main_ts.append(stamps[i] if stamps is not None else None)
        items, stamps = main, (main_ts if stamps is not None else None)
        side = {
            tid: Records(
                items=v,
                type_info=tag.type_info,
                timestamps=_stamps(t) if stamps is not None else None,
                producer=producer,
            )
            for tid, (v, t, tag) in side.items()
        }
    return Records(
        items=items, type_info=type_info, timestamps=_stamps(stamps), side=side or None, producer=producer
    )


def _stamps(stamps) -> np.ndarray | None:
    return None if stamps is None else np.array(stamps, dtype=np.int64)


def take(ts: np.ndarray | None, kept: list[int]) -> np.ndarray | None:
    return None if ts is None else ts[np.asarray(kept, dtype=np.int64)]
