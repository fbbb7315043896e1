"""What every stage task shares, on one machine or a cluster: the name of its transaction (query
id, micro-batch id, partition, from Spark's task context), and what it hands back to Spark: the
results its rows caused, in Spark's schema, in update mode only each key's latest."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stretch.spark.schemas import spark_values

QUERY_ID = "sql.streaming.queryId"  # Spark's local properties of a streaming query's tasks
BATCH_ID = "streaming.sql.batchId"


def transaction_of(context, stage_id: str) -> tuple[str, int, int]:
    """(query, micro-batch id, partition) of a task (``TaskContext.get()``) of the stage made with
    id ``stage_id``. A streaming query's id outlives its restarts, so a replayed micro-batch's task
    has its first run's name. A batch query's task is named by the stage and Spark's stage of it
    (an action on the stage's DataFrame runs its own Spark stage): a retried task has the name of
    its first attempt, so it too reaches the job once."""
    query = context.getLocalProperty(QUERY_ID)
    if query is None:
        return f"batch-{stage_id}-{context.stageId()}", 0, context.partitionId()
    return query, int(context.getLocalProperty(BATCH_ID) or 0), context.partitionId()


def in_spark_schema(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """A result batch with Spark's Arrow types (JSON text for fields Spark has no type for)."""
    columns = [spark_values(c).cast(f.type) for c, f in zip(batch.columns, schema)]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def latest_per_key(results: pa.Table, keys: list[str]) -> pa.Table:
    """The last result of each key, in the order the job emitted them."""
    if not results.num_rows:
        return results
    if len(keys) > 1:
        indexed = results.append_column("__position", pa.array(range(results.num_rows), pa.int64()))
        last = indexed.group_by(keys, use_threads=False).aggregate([("__position", "max")])
        positions = last.column("__position_max")
        return results.take(pc.take(positions, pc.sort_indices(positions)))
    # one key (the common case): numbering the keys by hashing and keeping each number's last row
    # takes a fifth of the time of a stable sort, which was the task's costliest step after the hop
    column = results.column(keys[0]).combine_chunks()
    codes = pc.dictionary_encode(column, null_encoding="encode").indices.to_numpy()  # null: a key too
    last = np.zeros(int(codes.max()) + 1, np.int64)
    np.maximum.at(last, codes, np.arange(len(codes)))
    keep = np.zeros(len(codes), bool)
    keep[last] = True
    return results.take(np.flatnonzero(keep))
