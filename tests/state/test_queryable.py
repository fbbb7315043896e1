"""Queryable state: a running operator's keyed state as a pyarrow Table."""

from __future__ import annotations

import time

import numpy as np
import pytest

from stretch import channels
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.datastream.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from stretch.errors import JobEnded
from stretch.state.arena import Arena
from stretch.state.backend import KeyedStateBackend
from stretch.state.key_groups import key_groups_of
from stretch.state.keyed_table import KeyedTable, KeyMode
from stretch.state.queryable import read_state


class Remember(KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.last = ctx.get_state(ValueStateDescriptor("last", Types.STRING()))
        self.values = ctx.get_list_state(ListStateDescriptor("values", Types.LONG()))
        self.by_tag = ctx.get_map_state(MapStateDescriptor("by_tag", Types.STRING(), Types.LONG()))

    def process_element(self, value, ctx):
        _key, n, tag = value
        self.count.update((self.count.value() or 0) + 1)
        self.last.update(tag)
        self.values.add(n)
        self.by_tag.put(tag, n)
        return []


def test_state_of_a_running_job_equals_a_reference():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(3)
    t = Types.TUPLE([Types.STRING(), Types.LONG(), Types.STRING()])
    env.from_source(ChannelSource("in", t), None, "in").key_by(lambda r: r[0]).process(Remember()).name(
        "remember"
    ).sink_to(DiscardingSink())
    client = env.execute_async("queryable")
    try:
        records = [(f"k{i % 23}", i, "ab"[i % 2]) for i in range(2000)]
        writer = channels.open_writer(client, "in")
        writer.write(records)
        expected = {}
        for k, n, tag in records:
            e = expected.setdefault(k, {"count": 0, "values": [], "by_tag": {}})
            e["count"] += 1
            e["last"] = tag
            e["values"].append(n)
            e["by_tag"][tag] = n
        deadline = time.monotonic() + 30
        while True:
            table = client.query_state("remember")
            if table.num_rows == len(expected) and sum(table.column("count").to_pylist()) == len(records):
                break
            assert time.monotonic() < deadline, "state never caught up"
            time.sleep(0.05)
        got = {
            r["key"]: {
                "count": r["count"],
                "last": r["last"],
                "values": r["values"],
                "by_tag": dict(r["by_tag"]),
            }
            for r in table.to_pylist()
        }
        assert got == expected
        one = client.query_state("remember", key="k5").to_pylist()
        assert [r["count"] for r in one] == [expected["k5"]["count"]]
        writer.end()
    finally:
        client.wait()
    with pytest.raises(JobEnded, match="has ended and its state with it"):
        client.query_state("remember")


def test_key_groups_whose_values_arrow_holds_and_key_groups_it_pickles_read_as_one_table():
    """A list state of Python objects reads as Arrow lists in a key group whose lists are empty and
    pickled where they hold objects: read together, the column is pickled throughout."""
    import pickle

    import pyarrow as pa

    from stretch.state.queryable import _pickled_where_types_differ

    empty = pa.table({"key": [1], "buffer": pa.array([[]], pa.large_list(pa.large_binary()))})
    objects = pa.table({"key": [2], "buffer": pa.array([pickle.dumps([(0, "a")])], pa.large_binary())})
    merged = pa.concat_tables(_pickled_where_types_differ([empty, objects]))
    assert merged.schema.field("buffer").type == pa.large_binary()
    assert [pickle.loads(v) for v in merged.column("buffer").to_pylist()] == [[], [(0, "a")]]


def test_key_groups_without_keys_read_as_a_table_without_rows(shm_prefix):
    """Asking for empty key groups (or none) gives the schema and no rows, whatever other key groups
    hold: key group 0 is not read in their place."""
    arena = Arena.create(shm_prefix, 8)
    try:
        table = KeyedTable(arena)
        backend = KeyedStateBackend(table)
        count = backend.state(ValueStateDescriptor("count", Types.LONG()))
        candidates = np.arange(200, dtype=np.int64)
        keys = candidates[key_groups_of(candidates, 8) < 3]  # key groups 0..2 hold keys, 3..7 none
        kgs = key_groups_of(keys, 8)
        rows = table.rows(kgs, keys, KeyMode.INT64)
        backend.begin(kgs, rows, keys.tolist())
        for slot in range(len(keys)):
            backend.current = slot
            count.update(slot)
        backend.end()
        held = sorted({int(k) for k in kgs})
        empty = [kg for kg in range(8) if kg not in held]
        assert 0 in held and empty, "the test needs key group 0 to hold keys and another to hold none"
        assert read_state(table, []).num_rows == 0
        assert read_state(table, empty[:1]).num_rows == 0
        assert read_state(table, [0]).num_rows == sum(1 for kg in kgs if kg == 0)
        assert "count" in read_state(table, []).column_names
    finally:
        arena.close()
