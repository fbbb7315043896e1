"""One local Spark session for the Spark tests, ended with its JVM when they are done."""

from __future__ import annotations

import pytest

from tests.spark.session import local_spark


@pytest.fixture(scope="package")
def spark(expected_children):
    with local_spark(expected_children, "stretch spark tests") as session:
        yield session
