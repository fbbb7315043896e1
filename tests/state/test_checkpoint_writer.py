"""State written into a job's checkpoint (a fix of some keys, a key added, one dropped) is what
the job restores: its state reads back as written, and records after the restore build on it,
as a plain-Python model of the same says."""

from __future__ import annotations

import copy
import random
import time

import pyarrow as pa
import pytest

from stretch import channels
from stretch.state import checkpoint_dir, read_checkpoint, write_checkpoint
from tests.state.test_checkpoint_reader import as_model, model, records, remember_job, wait_processed


def apply(state: dict, rows: list[tuple]) -> dict:
    """``model``'s step, from a given state on."""
    state = copy.deepcopy(state)
    for key, n, tag in rows:
        s = state.setdefault(key, {"count": 0, "values": [], "by_tag": {}})
        s["count"] += 1
        s["last"] = tag
        s["values"].append(n)
        s["by_tag"][tag] = n
    return state


def test_a_job_restores_the_state_written_into_its_checkpoint():
    name = f"write-ckpt-{random.randrange(1 << 40):x}"
    client = remember_job(name)
    writer = channels.open_writer(client, "in")
    writer.write(records(0, 600))
    wait_processed(client, 600)
    client.trigger_checkpoint()
    client.cancel()  # its checkpoints stay, to restore
    client.wait(60)
    path = checkpoint_dir(name)

    read = read_checkpoint(path, "remember")
    fixed = copy.deepcopy(as_model(read))
    fixed["k1"]["count"] = 1000  # a fix
    del fixed["k2"]  # a key dropped
    fixed["new"] = {"count": 7, "last": "z", "values": [1, 2], "by_tag": {"z": 2}}  # a key added
    keys = sorted(fixed)
    table = pa.table(
        {
            "key": keys,
            "count": [fixed[k]["count"] for k in keys],
            "last": [fixed[k]["last"] for k in keys],
            "values": [fixed[k]["values"] for k in keys],
            "by_tag": pa.array(
                [list(fixed[k]["by_tag"].items()) for k in keys], read.schema.field("by_tag").type
            ),
        }
    )
    moved = read.set_column(
        0, "key_group", pa.array([(kg + 1) % 128 for kg in read.column(0).to_pylist()], pa.int32())
    )
    with pytest.raises(ValueError, match=r"key .* is in key group \d+ at max parallelism 128, not \d+"):
        write_checkpoint(path, "remember", moved)
    written = write_checkpoint(path, "remember", table)
    assert written == 2
    assert as_model(read_checkpoint(path, "remember")) == fixed
    assert as_model(read_checkpoint(path, "remember", checkpoint=1)) == model(records(0, 600))  # as it was

    restored = remember_job(name, restore=True)
    try:
        assert restored._coordinator.restored_from == written
        assert as_model(restored.query_state("remember")) == fixed
        more = records(600, 300) + [("new", 5, "q")]
        channels.open_writer(restored, "in").write(more)
        want = apply(fixed, more)
        deadline = time.monotonic() + 30
        while as_model(restored.query_state("remember")) != want:
            assert time.monotonic() < deadline, "the restored job never built on the written state"
            time.sleep(0.05)
    finally:
        restored.cancel()
        restored.wait(60)


def test_what_cannot_be_written_says_so(tmp_path):
    name = f"write-refused-{random.randrange(1 << 40):x}"
    client = remember_job(name)
    writer = channels.open_writer(client, "in")
    writer.write(records(0, 50))
    wait_processed(client, 50)
    client.trigger_checkpoint()
    path = checkpoint_dir(name)
    table = read_checkpoint(path, "remember")
    with pytest.raises(ValueError, match=r"the job at .* is running: stop it before writing its checkpoint"):
        write_checkpoint(path, "remember", table)
    writer.end()
    assert client.wait(60).name == "FINISHED"
    with pytest.raises(ValueError, match=r"the job at .* finished: it cannot restore"):
        write_checkpoint(path, "remember", table)


def test_states_that_cannot_be_written_and_columns_of_no_state_are_refused():
    from stretch.state.checkpoint_writer import _descriptors

    count = {"name": "count", "kind": "value", "storage": "int64", "type": {"type": "LONG"}}
    rolling = {"name": "sum", "kind": "record", "storage": "words", "fields": [], "type": None}
    assert list(_descriptors({"key_mode": 2, "registry": [count]}, ["key", "count"], "op")) == ["count"]
    with pytest.raises(ValueError, match=r"state 'sum' of 'op' \(record\) cannot be written"):
        _descriptors({"key_mode": 2, "registry": [count, rolling]}, ["key", "count"], "op")
    with pytest.raises(ValueError, match=r"columns \['total'\] are no state of 'op' \(its states: count\)"):
        _descriptors({"key_mode": 2, "registry": [count]}, ["key", "total"], "op")
    stamps = {"name": "__ttl__count", "kind": "value", "storage": "int64", "type": {"type": "LONG"}}
    with pytest.raises(ValueError, match="has a time-to-live"):
        _descriptors({"key_mode": 2, "registry": [count, stamps]}, ["key", "count"], "op")
