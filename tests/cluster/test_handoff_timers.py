"""Timers move with their key groups: a key's pending timer set on one node fires on the node its
key group moved to, exactly once, while rows keep coming and timers keep firing on every node."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

from stretch.cluster import StretchCluster
from stretch.common.records import to_batch
from tests.cluster.jobs import PAIR, flush_job

KEYS = [f"user-{i}" for i in range(400)]


def test_pending_timers_fire_once_on_the_node_their_key_groups_moved_to(tmp_path):
    rng = random.Random(7)
    data = [[(rng.choice(KEYS), 1) for _ in range(40)] for _ in range(150)]
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster", max_parallelism=16, step=4) as cluster:
        client = flush_job().execute_async("flush-job", cluster=cluster)
        writer = client.writer("in")
        started, errors = threading.Event(), []

        def stream():
            try:
                for i, records in enumerate(data):
                    writer.write(to_batch(records, PAIR), query="q", batch=i)
                    started.set()
                    time.sleep(0.005)  # timers fire between writes, on every node
            except BaseException as e:
                errors.append(e)
                started.set()

        feeder = threading.Thread(target=stream)
        feeder.start()
        started.wait(60)
        cluster.add_node()
        cluster.remove_node("node-0")
        feeder.join(120)
        assert not errors, errors

        expected = Counter(key for records in data for key, _ in records)
        deadline = time.monotonic() + 60
        while True:  # every timer fires 20 ms after it was set, wherever its key group is now
            state = client.query_state("flush").to_pylist()
            got = {r["key"]: (r["count"], r["flushed"]) for r in state}
            if (
                all(f == c for c, f in got.values()) and len(got) == len(expected)
            ) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        client.cancel()
    assert {k: c for k, (c, _f) in got.items()} == dict(expected)
    assert {k: f for k, (_c, f) in got.items()} == dict(expected)
