"""Spark's way in and out of stretch jobs: a stage inside one Spark query, and the ``stretch``
Python data source.

>>> totals = stage(clicks, job="clicks", into="clicks", out="totals", mode="update", key="user")
>>> spark.dataSource.register(StretchDataSource)
>>> df.writeStream.format("stretch").option("job", "clicks").option("channel", "in") \\
...     .option("checkpointLocation", ckpt).start()
"""

from stretch.spark.data_source import StretchDataSource
from stretch.spark.stage import stage

__all__ = ["StretchDataSource", "stage"]
