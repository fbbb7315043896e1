"""A job's status: its graph as the UI draws it, and the instances' own recent rates."""

from __future__ import annotations

import time

from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DataGeneratorSource, DiscardingSink, RateLimiterStrategy


def test_the_instances_rates_are_the_jobs_own_over_the_last_second():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    src = DataGeneratorSource(
        lambda i: (i % 10, i),
        count=None,
        rate_limiter_strategy=RateLimiterStrategy.per_second(4000),
        type_info=Types.TUPLE([Types.LONG(), Types.LONG()]),
    )
    keyed = (
        env.from_source(src, None, "gen")
        .filter(lambda r: r[1] >= 0)
        .name("non-negative")
        .key_by(lambda r: r[0])
    )
    totals = keyed.sum(1).name("totals")
    totals.sink_to(DiscardingSink())
    totals.map(lambda r: r).name("copy").sink_to(DiscardingSink())
    client = env.execute_async("status rates")
    try:
        time.sleep(2.0)
        status = client.describe()
        (op,) = status["operators"]
        rates = [i["rate"] for i in op["instances"]]
        assert 2000 < sum(rates) < 6000  # the source emits 4000 records/s
        assert all(0.0 <= i["busy"] <= 1.0 for i in op["instances"])
        graph = status["graph"]
        nodes = {n["id"]: (n["name"], n["kind"], n["chained"]) for n in graph["nodes"]}
        assert nodes == {
            "stage-0": ("gen", "source", ["non-negative"]),
            "stage-1": ("totals", "aggregate", ["copy"]),
            "sink-0": ("DiscardingSink", "sink", []),
            "sink-1": ("DiscardingSink", "sink", []),
        }
        assert sorted(graph["edges"]) == [
            ["stage-0", "stage-1"],
            ["stage-1", "sink-0"],
            ["stage-1", "sink-1"],
        ]
    finally:
        client.cancel()
