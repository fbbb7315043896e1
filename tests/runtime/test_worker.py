"""A worker reports every failure of its task to the coordinator, even one it cannot print."""

from __future__ import annotations

import random

import pytest

from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.datagen import DataGeneratorSource
from stretch.errors import JobExecutionError
from stretch.runtime.worker import failure_report


class Unprintable(Exception):
    """An exception whose own ``__str__`` raises."""

    def __str__(self):
        raise RuntimeError("no str for you")


def test_the_report_of_an_exception_whose_str_raises_has_a_placeholder_message():
    try:
        raise Unprintable()
    except Unprintable as e:
        report = failure_report(e)
    assert report["type"] == "Unprintable"
    assert report["message"] == "<exception str() failed: RuntimeError: no str for you>"
    assert "raise Unprintable()" in report["traceback"]


def _generate(i: int) -> int:
    if i == 50:
        raise Unprintable()
    return i


def test_a_source_that_raises_an_exception_whose_str_raises_fails_the_job_naming_it():
    env = StreamExecutionEnvironment.get_execution_environment()
    source = DataGeneratorSource(generator_function=_generate, count=100, type_info=Types.LONG())
    with pytest.raises(JobExecutionError) as info:
        with env.from_source(source, None, "numbers").execute_and_collect(
            f"unprintable-source-{random.randrange(1 << 40):x}"
        ) as results:
            list(results)
    message = str(info.value)
    assert (
        "operator 'numbers' failed: Unprintable: <exception str() failed: RuntimeError: no str for you>"
        in message
    )
    assert "exited unexpectedly" not in message
