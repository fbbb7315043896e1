"""Spark's way in and out of stretch jobs: the ``stretch`` Python data source.

>>> spark.dataSource.register(StretchDataSource)
>>> df.writeStream.format("stretch").option("job", "clicks").option("channel", "in") \\
...     .option("checkpointLocation", ckpt).start()
"""

from stretch.spark.data_source import StretchDataSource

__all__ = ["StretchDataSource"]
