"""Which checkpoint a read takes: a cluster's checkpoint directory gives each key group once, as
its nodes' latest checkpoints hold it (against a plain-Python reference); what is not a
checkpoint, or not a complete one, says so in one line."""

from __future__ import annotations

import json
import random
import shutil
import warnings

import pyarrow as pa
import pytest

from stretch.cluster import StretchCluster
from stretch.state import CheckpointNotFound, IncompleteCheckpoint, read_checkpoint
from tests.cluster.jobs import count_sum_job, reference


def as_reference(table: pa.Table) -> dict:
    return {r["key"]: (r["count"], r["sum"]) for r in table.to_pylist()}


def ordered(table: pa.Table) -> pa.Table:
    return table.sort_by([("key_group", "ascending"), ("key", "ascending")])


def test_a_clusters_checkpoint_dir_gives_each_key_group_once_at_its_nodes_checkpoints(tmp_path):
    rng = random.Random(7)
    data = [[(f"user-{rng.randrange(90)}", rng.randint(-50, 50)) for _ in range(300)] for _ in range(2)]
    ck = tmp_path / "ck"
    copy = tmp_path / "copy"
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster", checkpoint_dir=ck) as cluster:
        env = count_sum_job()
        env.enable_checkpointing()  # on demand
        client = env.execute_async("cluster-state", cluster=cluster)
        with client.writer("in") as writer:
            writer.write(data[0], query="q", batch=0)
        client.trigger_checkpoint()
        read = read_checkpoint(ck, "counts")
        assert ordered(read).equals(ordered(client.query_state("counts")))  # as the live read gives it
        assert as_reference(read) == reference(data[0])
        with client.writer("in") as writer:
            writer.write(data[1], query="q", batch=1)  # taken, in no checkpoint yet
        assert as_reference(read_checkpoint(ck, "counts")) == reference(data[0])
        client.trigger_checkpoint()
        client.end("in")
        assert set(client.wait(60).values()) == {"FINISHED"}
        everything = reference(data[0] + data[1])
        assert as_reference(read_checkpoint(ck, "counts")) == everything  # the job finished
        assert as_reference(read_checkpoint(ck, "counts", checkpoint=2, job="cluster-state")) == everything
        shutil.copytree(ck, copy)  # the cluster removes its directory when it closes
    with pytest.raises(
        CheckpointNotFound, match=r"no checkpoint 1 at .*each node keeps only its latest, and they are c2"
    ):
        read_checkpoint(copy, "counts", checkpoint=1)
    with pytest.raises(LookupError, match=r"no keyed operator 'nope' at .*job 'cluster-state': counts"):
        read_checkpoint(copy, "nope")

    # a dead node whose manifest the cluster has not collected yet claims node-0's key groups from
    # an older routing version: each key group is still read once, from the newer checkpoint
    shutil.copytree(copy / "nodes" / "node-0", copy / "nodes" / "node-9")
    old = copy / "nodes" / "node-9" / "checkpoints" / "c2"
    meta = json.loads((old / "_metadata.json").read_text())
    (old / "_metadata.json").write_text(json.dumps({**meta, "version": -1, "node": "node-9"}))
    manifest = json.loads((copy / "nodes" / "node-9" / "manifest.json").read_text())
    (copy / "nodes" / "node-9" / "manifest.json").write_text(json.dumps({**manifest, "checkpoint": str(old)}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert as_reference(read_checkpoint(copy, "counts")) == everything

    # a node that died taking its next checkpoint: skipped, saying so
    (copy / "nodes" / "node-1" / "checkpoints" / "c3").mkdir()
    with pytest.warns(IncompleteCheckpoint, match=r"checkpoint c3 of node node-1 at .* is incomplete"):
        assert as_reference(read_checkpoint(copy, "counts")) == everything
    # one node's checkpoint alone: its key groups
    alone = read_checkpoint(copy / "nodes" / "node-1" / "checkpoints" / "c2", "counts")
    assert alone.num_rows and min(alone.column("key_group").to_pylist()) >= 64


def test_what_is_not_a_complete_checkpoint_says_so_in_one_line(tmp_path):
    with pytest.raises(CheckpointNotFound, match=r"no checkpoint at .*nowhere: no such directory"):
        read_checkpoint(tmp_path / "nowhere", "op")
    with pytest.raises(CheckpointNotFound, match=r"no checkpoint at .*expected a job's checkpoint directory"):
        read_checkpoint(tmp_path, "op")
    job = tmp_path / "job"
    (job / "checkpoints").mkdir(parents=True)
    (job / "checkpoints" / "_run_start.json").write_text("{}")
    with pytest.raises(CheckpointNotFound, match=r"no completed checkpoint at .*before completing one"):
        read_checkpoint(job, "op")
    (job / "checkpoints" / "0000000001").mkdir()
    with pytest.raises(CheckpointNotFound, match=r"no completed checkpoint at .*\(1 incomplete"):
        read_checkpoint(job / "checkpoints", "op")
    (job / "checkpoints" / "0000000001" / "_metadata.json").write_text(
        json.dumps({"id": 1, "job": "j", "max_parallelism": 8, "operators": {}})
    )
    with pytest.raises(
        LookupError, match=r"no keyed operator 'op' in checkpoint 1 at .*\(keyed operators there: none\)"
    ):
        read_checkpoint(job, "op")
    with pytest.raises(LookupError, match=r"checkpoint 1 at .* is of job 'j', not 'k'"):
        read_checkpoint(job, "op", job="k")
    (tmp_path / "cluster" / "nodes").mkdir(parents=True)
    with pytest.raises(
        CheckpointNotFound, match=r"no completed checkpoint at .*no node has saved a manifest"
    ):
        read_checkpoint(tmp_path / "cluster", "op")
    for message in _messages(tmp_path):
        assert "\n" not in message


def _messages(tmp_path) -> list[str]:
    out = []
    for path in (tmp_path / "nowhere", tmp_path, tmp_path / "job", tmp_path / "cluster"):
        try:
            read_checkpoint(path, "op")
        except (LookupError, FileNotFoundError) as e:
            out.append(str(e))
    return out
