"""How a stage describes a user function's failure: never failing in its turn."""

from __future__ import annotations

from stretch.runtime.outputs import StepError, dead_letter_batch


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")


class Unrepresentable:
    def __repr__(self):
        raise ValueError("no repr either")


def test_a_failure_whose_exception_record_and_key_cannot_be_printed_is_described():
    error = StepError("op", Unrepresentable(), Unrepresentable(), Unprintable(), "map function")
    assert str(error) == (
        "map function of operator 'op' failed on record <Unrepresentable object: repr() failed: "
        "ValueError>, key <Unrepresentable object: repr() failed: ValueError>: "
        "Unprintable: <exception str() failed: RuntimeError: no str for you>"
    )
    letter = dead_letter_batch(error).to_pylist()[0]
    assert letter["record"] == letter["key"] == "<Unrepresentable object: repr() failed: ValueError>"
    assert letter["error"] == "Unprintable: <exception str() failed: RuntimeError: no str for you>"
