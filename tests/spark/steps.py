"""Steps the Spark tests put into queries (in a module Spark's Python workers can import)."""

from __future__ import annotations


def fail_first_attempt(batches):
    """A step after a stage that fails partition 0's first attempt: Spark retries the task."""
    from pyspark import TaskContext

    batches = list(batches)
    if TaskContext.get().attemptNumber() == 0 and TaskContext.get().partitionId() == 0:
        raise RuntimeError("injected task failure")
    yield from batches
