"""The local Spark session the tests share: its settings, and how it ends with its JVM."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stretch.spark import StretchDataSource

# Spark's Python workers import the steps the tests put into queries from ``tests``: they find it
# here whatever directory the worker daemon was started in (a docs test runs in a temporary one).
_ROOT = str(Path(__file__).resolve().parents[2])


@contextmanager
def local_spark(expected_children: set[int], app_name: str, log_level: str | None = None) -> Iterator:
    """A local[2] session with the ``stretch`` data source registered; on exit the session stops
    and its JVM ends (a child of this process that the suite's guard must not count meanwhile)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2,2]")  # a failed task is retried once
        .appName(app_name)
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.executorEnv.PYTHONPATH", _ROOT)
        .getOrCreate()
    )
    if log_level is not None:
        session.sparkContext.setLogLevel(log_level)
    session.dataSource.register(StretchDataSource)
    gateway = SparkContext._gateway
    jvm = gateway.proc
    expected_children.add(jvm.pid)
    try:
        yield session
    finally:
        session.stop()
        gateway.shutdown()
        if jvm.stdin is not None:
            jvm.stdin.close()  # the JVM ends when its parent closes its stdin
        try:
            jvm.wait(30)
        except subprocess.TimeoutExpired:
            jvm.kill()
            jvm.wait()
        SparkContext._gateway = SparkContext._jvm = None
        expected_children.discard(jvm.pid)
