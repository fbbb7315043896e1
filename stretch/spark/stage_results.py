"""What every stage task shares, on one machine or a cluster: the name of its transaction (query
id, micro-batch id, partition, from Spark's task context), and what it hands back to Spark: the
results its rows caused, in Spark's schema, in update mode only each key's latest."""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stretch.spark.schemas import spark_values

QUERY_ID = "sql.streaming.queryId"  # Spark's local properties of a streaming query's tasks
BATCH_ID = "streaming.sql.batchId"


def transaction_of(context) -> tuple[str, int, int]:
    """(query id, micro-batch id, partition) of a task (``TaskContext.get()``): a streaming
    query's id outlives its restarts, so a replayed micro-batch's task has its first run's name;
    a batch query's task gets a name of its own (nothing replays it)."""
    query = context.getLocalProperty(QUERY_ID) or f"batch-query-{uuid.uuid4().hex}"
    return query, int(context.getLocalProperty(BATCH_ID) or 0), context.partitionId()


def in_spark_schema(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """A result batch with Spark's Arrow types (JSON text for fields Spark has no type for)."""
    columns = [spark_values(c).cast(f.type) for c, f in zip(batch.columns, schema)]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def latest_per_key(results: pa.Table, keys: list[str]) -> pa.Table:
    """The last result of each key, in the order the job emitted them."""
    if not results.num_rows:
        return results
    if (
        len(keys) == 1
        and sortable(results.schema.field(keys[0]).type)
        and not results.column(keys[0]).null_count
    ):
        # one numeric key (the common case): a stable sort finds each key's last row, about 2.5x
        # faster than hashing the table
        values = results.column(keys[0]).to_numpy()
        order = np.argsort(values, kind="stable")
        ordered = values[order]
        last = np.empty(len(ordered), dtype=bool)
        last[-1] = True
        np.not_equal(ordered[1:], ordered[:-1], out=last[:-1])
        return results.take(np.sort(order[last]))
    indexed = results.append_column("__position", pa.array(range(results.num_rows), pa.int64()))
    last = indexed.group_by(keys, use_threads=False).aggregate([("__position", "max")])
    positions = pc.sort_indices(last.column("__position_max"))
    return results.take(pc.take(last.column("__position_max"), positions))


def sortable(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_temporal(t) or pa.types.is_boolean(t)
