"""Spark reads a keyed operator's state from a checkpoint: the State Processor API's read side.

``spark.read.format("stretch").option("checkpoint", path).option("state", operator).load()``
gives the rows a running job's state read gives (key group, key, one column per declared state),
for a job that finished or died as for one still running, on one machine or a cluster (``path``:
its ``checkpoint_dir``). The driver finds the checkpoint once (the latest complete one, or
``option("checkpointId", n)``; ``option("job", name)`` picks the job on a cluster's directory
holding several) and its executors read their key groups from the files it found, so every
partition reads that one checkpoint even if a newer one completes meanwhile. The files must be
readable where the executors run.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition

from stretch.spark.schemas import spark_values
from stretch.spark.state_source import state_ddl
from stretch.state import OperatorCheckpoint, open_checkpoint


@dataclass
class CheckpointKeyGroups(InputPartition):
    found: OperatorCheckpoint
    key_groups: list[int]


def open_from(options) -> OperatorCheckpoint:
    """The operator's state in the checkpoint the options name."""
    operator = options.get("state")
    if not operator:
        raise ValueError(
            'format("stretch") with .option("checkpoint", path) reads an operator\'s state: '
            'add .option("state", operator)'
        )
    which = options.get("checkpointId")
    return open_checkpoint(
        options["checkpoint"], operator, int(which) if which else None, options.get("job") or None
    )


def checkpoint_schema(options) -> str:
    """The Spark schema of the operator's state in the checkpoint."""
    return state_ddl(open_from(options).schema())


class CheckpointStateReader(DataSourceReader):
    def __init__(self, options, schema):
        self.found = open_from(options)
        self.parts = int(options.get("partitions", 2))
        self.names = [f.name for f in schema.fields]

    def partitions(self) -> list[CheckpointKeyGroups]:
        """Contiguous runs of the key groups that hold keys, about equal in number."""
        kgs = self.found.key_groups()
        n = max(1, min(self.parts, len(kgs)))
        return [
            CheckpointKeyGroups(self.found, kgs[len(kgs) * i // n : len(kgs) * (i + 1) // n])
            for i in range(n)
        ]

    def read(self, partition: CheckpointKeyGroups):
        table = partition.found.read(partition.key_groups) if partition.key_groups else None
        if table is not None and table.num_rows:
            columns = [spark_values(table.column(n).combine_chunks()) for n in self.names]
            yield pa.RecordBatch.from_arrays(columns, names=self.names)
