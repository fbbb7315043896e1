"""A channel's key route gives every row the key group the job's engine gives it: a field column at
a time, a key selector function record by record; a selector that fails names the record, in the
words the engine uses on one machine."""

from __future__ import annotations

import pytest

from stretch.cluster.key_routes import KeyRoute, KeySelectorFailed, decode_routes, encode_routes
from stretch.common import Row, Types
from stretch.common.records import to_batch
from stretch.datastream import KeySelector, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink
from stretch.state.key_groups import key_group
from tests.cluster.jobs import PAIR

RECORDS = [(f"user-{i % 13}", i) for i in range(200)]


def test_a_field_route_gives_each_row_its_keys_key_group():
    groups = KeyRoute(field=0).key_groups(to_batch(RECORDS, PAIR), 128)
    assert groups.tolist() == [key_group(k, 128) for k, _ in RECORDS]


class Second(KeySelector):
    def get_key(self, value):
        return value[1] % 7


@pytest.mark.parametrize(
    ("selector", "key"),
    [
        (lambda r: r[0].split("-")[1], lambda r: r[0].split("-")[1]),
        (Second(), lambda r: r[1] % 7),
        (lambda r: [r[0], r[1] % 3], lambda r: (r[0], r[1] % 3)),  # a list key is its tuple, as in Flink
    ],
)
def test_a_selector_route_gives_each_record_the_key_group_of_its_selected_key(selector, key):
    groups = KeyRoute(selector=selector, operator="op").key_groups(to_batch(RECORDS, PAIR), 64)
    assert groups.tolist() == [key_group(key(r), 64) for r in RECORDS]


def test_a_selector_sees_records_of_the_channels_type():
    row = Types.ROW_NAMED(["user", "amount"], [Types.STRING(), Types.LONG()])
    rows = [Row(user=u, amount=a) for u, a in RECORDS]
    groups = KeyRoute(selector=lambda r: r.user, operator="op").key_groups(to_batch(rows, row), 128)
    assert groups.tolist() == [key_group(u, 128) for u, _ in RECORDS]


def test_routes_travel_pickled_with_their_functions():
    routes = decode_routes(encode_routes({"in": KeyRoute(selector=lambda r: r[0] * 2, operator="op")}))
    assert routes["in"].key_groups(to_batch([("a", 1)], PAIR), 128).tolist() == [key_group("aa", 128)]


def failing(record):
    if record[0] == "b":
        raise ValueError("no b here")
    return record[0]


def test_a_selector_that_fails_names_the_record_as_the_engine_does_on_one_machine():
    records = [("a", 1), ("b", 2), ("c", 3)]
    with pytest.raises(KeySelectorFailed) as raised:
        KeyRoute(selector=failing, operator="totals").key_groups(to_batch(records, PAIR), 128)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.from_collection(records, PAIR).key_by(failing).sum(1).name("totals").sink_to(ChannelSink("out"))
    with pytest.raises(Exception) as engine:  # the job fails, naming the record
        env.execute("one machine")
    said = "key selector of operator 'totals' failed on record ('b', 2): ValueError: no b here"
    assert said in str(raised.value) and said in str(engine.value)


@pytest.mark.parametrize(
    ("selector", "said"),
    [
        (lambda r: None if r[1] == 2 else r[0], r"record \('b', 2\).*keys must not be None"),
        (
            lambda r: {r[0]} if r[1] == 2 else r[0],
            r"record \('b', 2\) has key \{'b'\}.*cannot be hashed stably",
        ),
    ],
)
def test_a_key_that_cannot_be_a_key_names_the_record(selector, said):
    with pytest.raises(KeySelectorFailed, match=said):
        KeyRoute(selector=selector, operator="op").key_groups(to_batch([("a", 1), ("b", 2)], PAIR), 128)
