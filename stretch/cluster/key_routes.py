"""How the rows of a job's input channel map to key groups across a cluster: the job's own key.

Writers (ClusterWriter, Spark's sink, the one-query stage) split each batch by the key group of
every row, and nodes check the same key groups before their job sees a row; both must agree with
the job's engine, which keys the rows again. So the cluster derives each input channel's
``KeyRoute`` from the job's plan and ships it with the job's routing information, pickled
(``jobs.json``): a field (``key_by("user")``, ``key_by(0)``) is hashed column at a time, as the
engine hashes it; a key selector function (``key_by(lambda r: r[0])``) runs on each record as the
engine runs it, and a selector that fails names the record, as on one machine.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
import pyarrow as pa

from stretch.common import user_code
from stretch.common.batch_decoding import from_batch
from stretch.contracts.functions import KeySelector
from stretch.runtime.outputs import NO_KEY, describe_failure, short
from stretch.runtime.routing import not_null
from stretch.state.key_groups import key_groups_of, key_groups_of_keys, stable_hash

ROW = "__row__"
"""The route of a stream without a key (a non-keyed broadcast operator's input): the whole row.
Its key group only picks the node that takes the row, deterministically, so a replayed micro-batch
meets the marks its rows left, wherever their key groups are now."""


def column_of(batch: pa.RecordBatch, field) -> pa.Array:
    """The key column of a batch: a field given by name or by position among the data columns,
    or (``ROW``) every data column as one struct column, hashed as a tuple of the row's values."""
    data = [i for i, name in enumerate(batch.schema.names) if not name.startswith("__")]
    if field == ROW:
        return pa.StructArray.from_arrays(
            [batch.column(i) for i in data], [batch.schema.names[i] for i in data]
        )
    if isinstance(field, int):
        return batch.column(data[field])
    return batch.column(field)


class KeySelectorFailed(ValueError):
    """A job's key selector failed on a record (or gave a key that cannot be a key): nothing of
    the write was sent; the message names the operator, the record and the cause."""


@dataclass(frozen=True)
class KeyRoute:
    """The key of an input channel's rows: ``field`` (vectorized), or ``selector`` (a callable or
    KeySelector, run on each record) of operator ``operator``."""

    field: str | int | None = None
    selector: Any = None
    operator: str = ""
    watermarks: Any = None  # the channel's WatermarkStrategy (event time: cluster.writer_clock)

    def key_groups(self, batch: pa.RecordBatch, max_parallelism: int) -> np.ndarray:
        """The key group of every row of ``batch`` (a batch of the channel's record type)."""
        if self.field is not None:
            return key_groups_of(column_of(batch, self.field), max_parallelism)
        return self._selected(from_batch(batch), max_parallelism)

    def _selected(self, records: list, max_parallelism: int) -> np.ndarray:
        get = self.selector.get_key if isinstance(self.selector, KeySelector) else self.selector
        try:
            keys = [get(r) for r in records]
        except Exception:
            keys = [self._key(get, r) for r in records]  # find the record, and say why
        if None in keys or list in set(map(type, keys)):
            keys = [self._checked(r, k) for r, k in zip(records, keys)]
        try:
            return key_groups_of_keys(keys, max_parallelism)
        except TypeError:
            for r, k in zip(records, keys):
                try:
                    stable_hash(k)
                except TypeError:
                    raise KeySelectorFailed(
                        f"key selector of operator {self.operator!r}: record {short(r)} has key {short(k)} "
                        f"of type {type(k).__name__}, which cannot be hashed stably; keys must be int, "
                        "float, str, bytes, bool or tuples of these (which may hold None)"
                    ) from None
            raise

    def _key(self, get, record):
        try:
            return get(record)
        except Exception as e:
            raise KeySelectorFailed(describe_failure(self.operator, record, NO_KEY, e, "key selector")) from e

    def _checked(self, record, key):
        """A key as the engine takes it: not None (as in Flink), a list as the tuple of its items."""
        try:
            return _hashable(not_null(key))
        except ValueError as e:
            raise KeySelectorFailed(
                describe_failure(self.operator, record, NO_KEY, e, "key selector")
            ) from None

    def describe(self) -> str | int | None:
        """What ``jobs.json`` shows of it: the field, or None for a function."""
        return self.field


def _hashable(key):
    """A list key is the key of its contents, as in Flink (which hashes it by value): a tuple
    (as the engine's key_by step takes it, runtime.chain)."""
    if type(key) is list:
        return tuple(_hashable(k) for k in key)
    return key


def encode_routes(routes: dict[str, KeyRoute]) -> str:
    """A job's routes as ``jobs.json`` keeps them (text: pickled, base64); the caller holds the
    cluster's secret, as it must to submit code to its nodes."""
    return base64.b64encode(user_code.dumps(routes)).decode()


def decode_routes(text: str | None) -> dict[str, KeyRoute]:
    return cloudpickle.loads(base64.b64decode(text)) if text else {}
