"""One local Spark session for the Spark tests, ended with its JVM when they are done."""

from __future__ import annotations

import subprocess

import pytest

from stretch.spark import StretchDataSource


@pytest.fixture(scope="package")
def spark(expected_children):
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2,2]")  # a failed task is retried once
        .appName("stretch spark tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    session.dataSource.register(StretchDataSource)
    gateway = SparkContext._gateway
    jvm = gateway.proc
    expected_children.add(jvm.pid)
    yield session
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
