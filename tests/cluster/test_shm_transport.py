"""Rows reach a node on the same host through shared memory, and over Flight where the node cannot
see the writer's segments (a private /dev/shm, as on another host); the result is the same."""

from __future__ import annotations

import os
import random
import time

import pyarrow as pa
import pytest

from stretch.cluster import StretchCluster
from stretch.cluster.shm_transport import NO_SHM, NotVisible, SharedBatches, staged_batches
from stretch.common.records import to_batch
from tests.cluster.jobs import PAIR, count_sum_job, reference


def _segments(shared: SharedBatches) -> list[str]:
    return [s.name for s in shared._segments.values()]


def test_a_staged_batch_reads_back_equal_in_place_and_its_segment_grows_and_goes():
    shared = SharedBatches()
    small = pa.record_batch({"k": pa.array(["a", "b", None]), "v": pa.array([1, 2, 3], pa.int64())})
    big = pa.record_batch(
        {"k": pa.array([f"key-{i}" for i in range(200_000)]), "v": pa.array(range(200_000))}
    )
    try:
        for batch in (small, big, small):
            staged = shared.stage("node-0", batch)
            with staged_batches(staged["segment"], staged["size"]) as batches:
                assert pa.Table.from_batches(batches).equals(pa.Table.from_batches([batch]))
        (name,) = _segments(shared)
        assert os.path.exists(f"/dev/shm/{name}")  # the grown one, reused for the smaller batch
    finally:
        shared.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(NotVisible, match=NO_SHM):
        with staged_batches(name, 10):
            pass
    with pytest.raises(NotVisible, match=NO_SHM):  # only a stretch segment, by name
        with staged_batches("../etc/passwd", 10):
            pass


def test_a_writer_on_the_nodes_host_sends_through_shared_memory(tmp_path):
    """(Nodes with a private /dev/shm, which cannot see it, get rows over Flight: see
    test_cluster.test_add_and_remove_nodes_under_a_steady_stream_lose_and_duplicate_nothing.)"""
    rng = random.Random(3)
    data = [[(f"user-{rng.randrange(200)}", rng.randint(-9, 9)) for _ in range(300)] for _ in range(20)]
    with StretchCluster.local(nodes=2, directory=tmp_path / "c") as cluster:
        client = count_sum_job().execute_async("shm-job", cluster=cluster)
        writer = client.writer("in")
        for i, records in enumerate(data):
            writer.write(to_batch(records, PAIR), query="q", batch=i)
        writer.write(to_batch(data[4], PAIR), query="q", batch=4)  # a replay: dropped either way
        assert not writer.shared._refused and len(_segments(writer.shared)) == 2
        expected = reference([r for records in data for r in records])
        deadline = time.monotonic() + 60
        while True:  # the nodes took every row; their instances process them meanwhile
            got = {r["key"]: (r["count"], r["sum"]) for r in client.query_state("counts").to_pylist()}
            if got == expected or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        segments = _segments(writer.shared)
        client.cancel()
    assert not [s for s in segments if os.path.exists(f"/dev/shm/{s}")]  # closed with the cluster
    assert got == expected
