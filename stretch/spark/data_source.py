"""The ``stretch`` data source for Spark's Python Data Source API (``pyspark.sql.datasource``)."""

from __future__ import annotations

import pyarrow as pa
from pyspark.sql.datasource import DataSource

from stretch.spark.schemas import channel_schema, spark_ddl


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
        """The channel's schema, so that Spark needs none from the user."""
        schema: pa.Schema = channel_schema(self._required("job"), self._required("channel"))
        return spark_ddl(schema)

    def streamWriter(self, schema, overwrite: bool):
        from stretch.spark.sink import StretchStreamWriter

        return StretchStreamWriter(self.options, schema)
