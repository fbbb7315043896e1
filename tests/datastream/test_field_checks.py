"""A field named by position or name is checked against the stream's record type where the program
names it (datastream.field_checks): a misspelt field fails on its own line, before the job runs."""

from __future__ import annotations

import pytest

from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment

CLICK = Types.ROW_NAMED(["user", "amount"], [Types.STRING(), Types.LONG()])


def clicks():
    env = StreamExecutionEnvironment.get_execution_environment()
    return env.from_collection(
        [("a", 1)], type_info=Types.TUPLE([Types.STRING(), Types.LONG()])
    ), env.from_collection([], type_info=CLICK)


def test_a_key_field_the_records_lack_fails_at_key_by_naming_their_fields():
    _, rows = clicks()
    with pytest.raises(
        ValueError, match=r"^key_by: records have no field 'usr' \(fields: \['user', 'amount'\]\)$"
    ):
        rows.key_by("usr")
    with pytest.raises(IndexError, match="field position 2 is out of range for records with 2 fields"):
        rows.key_by(2)


def test_a_rolling_aggregate_of_a_field_the_records_lack_fails_where_it_is_named():
    """Also when every key would have one record, where the sum never folds and so never met it."""
    tuples, rows = clicks()
    with pytest.raises(ValueError, match="sum: records have no field 'amt'"):
        rows.key_by("user").sum("amt")
    with pytest.raises(ValueError, match="max: records have no field 'amt'"):
        rows.key_by("user").max(["amount", "amt"])
    with pytest.raises(IndexError, match="min: field position 3"):
        tuples.key_by(0).min(3)


def test_a_sum_of_text_is_refused_as_flink_refuses_it():
    tuples, rows = clicks()
    with pytest.raises(TypeError, match="sum: field 'user' is String, not a number"):
        rows.key_by("amount").sum("user")
    with pytest.raises(TypeError, match="sum: field 'f0' is String, not a number"):
        tuples.key_by(1).sum(0)
    rows.key_by("amount").max("user")  # max and min compare text as Flink does


def test_fields_that_exist_run_and_sum_as_a_plain_loop_does():
    env = StreamExecutionEnvironment.get_execution_environment()
    data = [("a", 1), ("b", 2), ("a", 3), ("b", 4), ("a", 5)]
    stream = env.from_collection(data, type_info=CLICK)
    got = [tuple(r) for r in stream.key_by("user").sum("amount").execute_and_collect(limit=len(data))]
    totals: dict = {}
    want = []
    for user, amount in data:
        totals[user] = totals.get(user, 0) + amount
        want.append((user, totals[user]))
    assert sorted(got) == sorted(want)
