"""Queryable state: a running operator's keyed state as a pyarrow Table."""

from __future__ import annotations

import time

from stretch import channels
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.datastream.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor


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
