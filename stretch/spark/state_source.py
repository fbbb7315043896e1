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

from stretch.channels import _socket_of
from stretch.runtime.control_socket import request
from stretch.spark.schemas import spark_ddl, spark_values
from stretch.state.arena import Arena
from stretch.state.keyed_table import KeyedTable
from stretch.state.queryable import read_key_group, read_state


@dataclass
class KeyGroups(InputPartition):
    arena: str
    first: int
    last: int  # exclusive


def locate(job: str, operator: str) -> dict:
    reply = request(_socket_of(job), {"op": "state", "operator": operator})
    if not reply.get("ok"):
        raise LookupError(reply.get("error"))
    return reply


def state_schema(job: str, operator: str) -> str:
    reply = locate(job, operator)
    arena = Arena.attach(reply["arena"])
    try:
        table = KeyedTable(arena)
        sample = next(
            (read_key_group(table, kg) for kg in range(table.maxp) if table.n_keys(kg)),
            read_key_group(table, 0),
        )
        return spark_ddl(
            pa.schema(
                [
                    (n, spark_values(c.combine_chunks()).type)
                    for n, c in zip(sample.column_names, sample.columns)
                ]
            )
        )
    finally:
        arena.close()


class StretchStateReader(DataSourceReader):
    def __init__(self, options, schema):
        reply = locate(options["job"], options["state"])
        self.arena = reply["arena"]
        self.max_parallelism = reply["max_parallelism"]
        self.parts = int(options.get("partitions", 2))
        self.names = [f.name for f in schema.fields]

    def partitions(self) -> list[KeyGroups]:
        n = max(1, min(self.parts, self.max_parallelism))
        bounds = [self.max_parallelism * i // n for i in range(n + 1)]
        return [KeyGroups(self.arena, a, b) for a, b in pairwise(bounds)]

    def read(self, partition: KeyGroups):
        arena = Arena.attach(partition.arena)
        try:
            table = read_state(KeyedTable(arena), range(partition.first, partition.last))
            columns = [spark_values(table.column(n).combine_chunks()) for n in self.names]
            if table.num_rows:
                yield pa.RecordBatch.from_arrays(columns, names=self.names)
        finally:
            arena.close()
