"""The ``stretch`` data source for Spark's Python Data Source API (``pyspark.sql.datasource``)."""

from __future__ import annotations

from pyspark.sql.datasource import DataSource

from stretch.spark.schemas import output_schema, spark_ddl


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
            from stretch.spark.state_source import state_schema

            return state_schema(self._required("job"), self.options["state"])
        return spark_ddl(output_schema(self._required("job"), self._required("channel")))

    def streamWriter(self, schema, overwrite: bool):
        from stretch.spark.sink import StretchStreamWriter

        return StretchStreamWriter(self.options, schema)

    def streamReader(self, schema):
        from stretch.spark.source import StretchStreamReader

        return StretchStreamReader(self.options, schema)

    def reader(self, schema):
        if self.options.get("state"):
            from stretch.spark.state_source import StretchStateReader

            return StretchStateReader(self.options, schema)
        from stretch.spark.source import StretchBatchReader

        return StretchBatchReader(self.options, schema)
