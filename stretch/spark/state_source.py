"""Spark reads a running operator's keyed state (queryable state) as a DataFrame.

``spark.read.format("stretch").option("job", J).option("state", operator).load()``: one row per
key (key group, key, one column per declared state), read by executors straight from the state
arena in shared memory, key groups split over partitions, without stopping or slowing the job.
Each key group is read under its seqlock, so every row is a consistent snapshot of its key.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition

from stretch.jobs import QueryableState, find
from stretch.spark.schemas import spark_ddl, spark_values


@dataclass
class KeyGroups(InputPartition):
    arena: str
    first: int
    last: int  # exclusive


def state_schema(job: str, operator: str) -> str:
    """The Spark schema of an operator's keyed state (``job``: a running job's name or id)."""
    with QueryableState(find(job).state_location(operator)["arena"]) as state:
        return state_ddl(state.schema())


def state_ddl(schema: pa.Schema) -> str:
    """The Spark schema of keyed state rows of Arrow schema ``schema``."""
    return spark_ddl(pa.schema([(f.name, spark_values(pa.array([], f.type)).type) for f in schema]))


class StretchStateReader(DataSourceReader):
    def __init__(self, options, schema):
        reply = find(options["job"]).state_location(options["state"])
        self.arena = reply["arena"]
        self.max_parallelism = reply["max_parallelism"]
        self.parts = int(options.get("partitions", 2))
        self.names = [f.name for f in schema.fields]

    def partitions(self) -> list[KeyGroups]:
        n = max(1, min(self.parts, self.max_parallelism))
        bounds = [self.max_parallelism * i // n for i in range(n + 1)]
        return [KeyGroups(self.arena, a, b) for a, b in pairwise(bounds)]

    def read(self, partition: KeyGroups):
        return read_key_groups(partition, self.names)


def read_key_groups(partition: KeyGroups, names: list[str]):
    """The rows of the partition's key groups, columns ``names``."""
    with QueryableState(partition.arena) as state:  # the rows are read before it is unmapped
        table = state.read(range(partition.first, partition.last))
        columns = [spark_values(table.column(n).combine_chunks()) for n in names]
        batch = pa.RecordBatch.from_arrays(columns, names=names) if table.num_rows else None
    if batch is not None:
        yield batch
