"""KeyedProcessFunction over every state kind, against a plain-Python sequential reference."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from stretch.common import Types
from stretch.datastream import AggregateFunction, KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.state import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)


class Average(AggregateFunction):
    def create_accumulator(self):
        return (0, 0)

    def add(self, value, accumulator):
        return accumulator[0] + value, accumulator[1] + 1

    def get_result(self, accumulator):
        return accumulator[0] / accumulator[1]


class EveryState(KeyedProcessFunction):
    """Touches every state kind on every record and reports what it sees."""

    def open(self, runtime_context):
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.last = runtime_context.get_state(ValueStateDescriptor("last", Types.STRING()))
        self.recent = runtime_context.get_list_state(ListStateDescriptor("recent", Types.LONG()))
        self.tags = runtime_context.get_map_state(MapStateDescriptor("tags", Types.STRING(), Types.LONG()))
        self.total = runtime_context.get_reducing_state(
            ReducingStateDescriptor("total", lambda a, b: a + b, Types.LONG())
        )
        self.avg = runtime_context.get_aggregating_state(
            AggregatingStateDescriptor("avg", Average(), Types.PICKLED_BYTE_ARRAY())
        )

    def process_element(self, value, ctx):
        _, n, tag = value
        c = (self.count.value() or 0) + 1
        self.count.update(c)
        previous = self.last.value()
        self.last.update(tag)
        self.recent.add(n)
        if c % 4 == 0:  # keep the list short sometimes, exercising update()
            self.recent.update(list(self.recent.get())[-2:])
        self.tags.put(tag, (self.tags.get(tag) or 0) + 1)
        if c % 7 == 0:
            self.tags.remove(tag)
        self.total.add(n)
        self.avg.add(n)
        yield (
            ctx.get_current_key(),
            c,
            previous,
            tuple(self.recent.get()),
            tuple(sorted(self.tags.items())),
            self.total.get(),
            round(self.avg.get(), 9),
        )


def reference(records, key_of):
    """What EveryState must produce, computed sequentially with dicts."""
    count, last, recent, tags, total, sums = {}, {}, defaultdict(list), defaultdict(dict), {}, {}
    out = []
    for value in records:
        k = key_of(value)
        _, n, tag = value
        c = count.get(k, 0) + 1
        count[k] = c
        previous = last.get(k)
        last[k] = tag
        recent[k].append(n)
        if c % 4 == 0:
            recent[k] = recent[k][-2:]
        tags[k][tag] = tags[k].get(tag, 0) + 1
        if c % 7 == 0:
            del tags[k][tag]
        total[k] = total.get(k, 0) + n
        s, m = sums.get(k, (0, 0))
        sums[k] = (s + n, m + 1)
        out.append(
            (
                k,
                c,
                previous,
                tuple(recent[k]),
                tuple(sorted(tags[k].items())),
                total[k],
                round((s + n) / (m + 1), 9),
            )
        )
    return out


def by_key(outputs):
    d = defaultdict(list)
    for o in outputs:
        d[o[0]].append(o)
    return dict(d)


KEYS = {
    "str": lambda r: r[0],
    "int": lambda r: len(r[0]) * 1000 + ord(r[0][-1]),
    "tuple": lambda r: (r[0][:2], r[1] % 3),
}


def make_records(n=3000, seed=7):
    rng = random.Random(seed)
    users = [f"user{i}" * (1 + i % 3) for i in range(97)]
    return [(rng.choice(users), rng.randrange(1000), rng.choice("abcde")) for _ in range(n)]


@pytest.mark.parametrize("parallelism", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("key_kind", ["str", "int", "tuple"])
def test_every_state_kind_matches_sequential_reference(parallelism, key_kind):
    records = make_records()
    key_of = KEYS[key_kind]
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    ds = env.from_collection(records, Types.TUPLE([Types.STRING(), Types.LONG(), Types.STRING()]))
    with ds.key_by(key_of).process(EveryState()).execute_and_collect() as results:
        got = list(results)
    assert by_key(got) == by_key(reference(records, key_of))


class Count(KeyedProcessFunction):
    def open(self, runtime_context):
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))

    def process_element(self, value, ctx):
        c = (self.count.value() or 0) + 1
        self.count.update(c)
        yield ctx.get_current_key(), c


def test_the_issue_example_runs_unchanged():
    records = [(f"k{i % 13}", i) for i in range(2000)]
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(4)
    ds = env.from_collection(records, type_info=Types.TUPLE([Types.STRING(), Types.LONG()]))
    with ds.key_by(lambda r: r[0]).process(Count()).execute_and_collect() as results:
        got = list(results)
    expected, seen = [], defaultdict(int)
    for k, _ in records:
        seen[k] += 1
        expected.append((k, seen[k]))
    assert by_key(got) == by_key(expected)


class RunningSum(KeyedProcessFunction):
    def open(self, runtime_context):
        self.count = runtime_context.get_state(ValueStateDescriptor("n", Types.LONG()))
        self.sum = runtime_context.get_state(ValueStateDescriptor("s", Types.LONG()))

    def process_element(self, value, ctx):
        n = (self.count.value() or 0) + 1
        s = (self.sum.value() or 0) + value[1]
        self.count.update(n)
        self.sum.update(s)
        yield ctx.get_current_key(), n, s


@pytest.mark.parametrize("parallelism", [1, 3])
def test_rekeying_pipeline_through_a_second_gate(parallelism):
    records = [(f"user{i % 50}", i % 17) for i in range(4000)]
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    ds = env.from_collection(records, Types.TUPLE([Types.STRING(), Types.LONG()]))
    per_user = ds.key_by(lambda r: r[0]).process(Count())  # (user, running count)
    per_bucket = (
        per_user.map(lambda t: (int(t[0][4:]) % 7, t[1])).key_by(lambda t: t[0]).process(RunningSum())
    )
    with per_bucket.execute_and_collect() as results:
        got = list(results)
    # The second operator's input interleaves records from several first-operator instances, so
    # only order-free facts are comparable: how many outputs, and each key's final count and sum.
    expected_sum, expected_n, seen = defaultdict(int), defaultdict(int), defaultdict(int)
    for user, _ in records:
        seen[user] += 1
        bucket = int(user[4:]) % 7
        expected_n[bucket] += 1
        expected_sum[bucket] += seen[user]
    assert len(got) == len(records)
    final = {}
    for k, n, s in got:
        if n > final.get(k, (0, 0))[0]:
            final[k] = (n, s)
    assert final == {k: (expected_n[k], expected_sum[k]) for k in expected_n}


def test_key_by_field_name_on_arrow_rows():
    import pyarrow as pa

    table = pa.table({"user": [i % 11 for i in range(3000)], "amount": [float(i % 5) for i in range(3000)]})
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)

    class Total(KeyedProcessFunction):
        def open(self, ctx):
            self.total = ctx.get_state(ValueStateDescriptor("t", Types.DOUBLE()))

        def process_element(self, value, ctx):
            t = (self.total.value() or 0.0) + value["amount"]
            self.total.update(t)
            yield ctx.get_current_key(), t

    with env.from_arrow(table).key_by("user").process(Total()).execute_and_collect() as results:
        got = list(results)
    expected, totals = [], defaultdict(float)
    for u, a in zip(table["user"].to_pylist(), table["amount"].to_pylist()):
        totals[u] += a
        expected.append((u, totals[u]))
    assert by_key(got) == by_key(expected)
