"""The ``stretch`` data source for Spark's Python Data Source API (``pyspark.sql.datasource``)."""

from __future__ import annotations

from pyspark.sql.datasource import DataSource

from stretch.channels import output_schema
from stretch.spark.cluster_sink import ClusterStreamWriter
from stretch.spark.schemas import spark_ddl
from stretch.spark.sink import StretchStreamWriter
from stretch.spark.source import StretchBatchReader, StretchStreamReader
from stretch.spark.state_source import StretchStateReader, state_schema


class StretchDataSource(DataSource):
    """``format("stretch")`` with options ``job`` (a job name or id) and ``channel``."""

    @classmethod
    def name(cls) -> str:
        return "stretch"

    def _required(self, key: str) -> str:
        value = self.options.get(key)
        if not value:
            raise ValueError(f'format("stretch") needs .option("{key}", ...)')
        return value

    def schema(self):
        """What a read returns, so that Spark needs no schema from the user: an output channel's
        records, or (``option("state", operator)``) an operator's keyed state."""
        if self.options.get("state"):
            return state_schema(self._required("job"), self.options["state"])
        return spark_ddl(output_schema(self._required("job"), self._required("channel")))

    def streamWriter(self, schema, overwrite: bool):
        if self.options.get("cluster"):  # a job on a stretch cluster: rows go to their key groups' nodes
            return ClusterStreamWriter(self.options, schema)
        return StretchStreamWriter(self.options, schema)

    def streamReader(self, schema):
        return StretchStreamReader(self.options, schema)

    def reader(self, schema):
        if self.options.get("state"):
            return StretchStateReader(self.options, schema)
        return StretchBatchReader(self.options, schema)
