"""The checkpoint directory of a cluster holds only what a restore can still read: release
checkpoints go once their adopters checkpointed, a dead or removed node's journal once its key
groups are restored elsewhere, its checkpoints once its key groups' new owners checkpointed. A node
killed right after a collection still restores exactly (a plain-Python reference of the job's
output), and a collection cut short leaves only what the next one deletes."""

from __future__ import annotations

import json

import pytest

from stretch.cluster import StretchCluster, recovery
from stretch.common.records import to_batch
from tests.cluster.jobs import PAIR
from tests.cluster.test_cluster import batches, outputs
from tests.cluster.test_recovery import assert_exactly_once, checkpointed_job, kill, wait_for


def layout(checkpoints) -> set[str]:
    """What the checkpoint directory holds: ``<node>/<entry>`` and ``<node>/checkpoints/<name>``."""
    out = set()
    root = checkpoints / "nodes"
    for node in root.iterdir() if root.exists() else []:
        for entry in node.iterdir():
            if entry.name == "checkpoints":
                out |= {f"{node.name}/checkpoints/{c.name}" for c in entry.iterdir()}
            else:
                out.add(f"{node.name}/{entry.name}")
    return out


def live(*nodes: str) -> set[str]:
    """A current node's own files: its manifest and its journal."""
    return {f"{n}/{entry}" for n in nodes for entry in ("manifest.json", "journal")}


def checkpoint_of(node: str, name: str) -> str:
    return f"{node}/checkpoints/{name}"


def settle(checkpoints, expected: set[str]) -> None:
    """Wait until the directory holds ``expected`` (the supervisor collects after its restore
    returns), then check it does."""
    try:
        wait_for(lambda: layout(checkpoints) == expected, timeout=60)
    finally:
        assert layout(checkpoints) == expected


def record_releases(cluster: StretchCluster, releases: set[str]):
    """A step hook noting the release checkpoint each move leaves (``h<version>-<from>-<to>``)."""

    def hook(at, src, dst):
        if at == "adopted":
            releases.add(checkpoint_of(src, f"h{cluster.table.version}-{src}-{dst}"))

    return hook


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_handoffs_leave_only_release_checkpoints_their_adopters_still_need(tmp_path):
    data = batches(11, 40, 30)
    ck = tmp_path / "ck"
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster", checkpoint_dir=ck, step=16) as cluster:
        client = checkpointed_job("gc-handoffs", cluster)
        with client.writer("in") as writer:
            for i in range(10):
                writer.write(to_batch(data[i], PAIR), query="q", batch=i)
            client.trigger_checkpoint()
            settle(ck, live("node-0", "node-1") | {checkpoint_of(n, "c1") for n in ("node-0", "node-1")})

            releases: set[str] = set()
            cluster._step_hook = record_releases(cluster, releases)
            cluster.add_node()  # node-2 adopts from release checkpoints; the c1s they supersede go
            assert releases and all(r.startswith(("node-0/", "node-1/")) for r in releases)
            settle(ck, live("node-0", "node-1", "node-2") | releases)

            for i in range(10, 20):
                writer.write(to_batch(data[i], PAIR), query="q", batch=i)
            writer.write(to_batch(data[4], PAIR), query="q", batch=4)  # a replay: dropped
            cluster.remove_node("node-0")  # node-0's journal and manifest go, its checkpoints stay
            assert any(r.startswith("node-0/") for r in releases)
            settle(ck, live("node-1", "node-2") | releases)

            kill(cluster, "node-2")  # right after the collection: it restores from what was kept
            wait_for(lambda: cluster.recoveries)
            settle(ck, live("node-1") | releases)  # node-2 never checkpointed: nothing of it is named
            for i in range(20, 30):
                writer.write(to_batch(data[i], PAIR), query="q", batch=i)

            client.trigger_checkpoint()  # covers every key group: every release checkpoint goes
            settle(ck, live("node-1") | {checkpoint_of("node-1", "c2")})
            for i in range(30, 40):
                writer.write(to_batch(data[i], PAIR), query="q", batch=i)
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        assert_exactly_once(outputs("gc-handoffs", ["node-0", "node-1", "node-2"]), data)
    assert layout(ck) == set()  # closed: nothing resumes it, so nothing of it is kept


@pytest.mark.long  # the suite keeps within its time: run with -m long
def test_a_dead_nodes_files_go_once_its_key_groups_are_checkpointed_elsewhere(tmp_path):
    data = batches(12, 40, 30)
    ck = tmp_path / "ck"
    with StretchCluster.local(nodes=3, directory=tmp_path / "cluster", checkpoint_dir=ck) as cluster:
        client = checkpointed_job("gc-deaths", cluster)
        nodes = ("node-0", "node-1", "node-2")
        with client.writer("in") as writer:
            for i in range(10):
                writer.write(to_batch(data[i], PAIR), query="q", batch=i)
            client.trigger_checkpoint()
            settle(ck, live(*nodes) | {checkpoint_of(n, "c1") for n in nodes})
            for i in range(10, 20):
                writer.write(to_batch(data[i], PAIR), query="q", batch=i)

            kill(cluster, "node-1")  # restored from c1 and its journal: the journal goes after
            wait_for(lambda: cluster.recoveries)
            settle(ck, live("node-0", "node-2") | {checkpoint_of(n, "c1") for n in nodes})
            for i in range(20, 30):
                writer.write(to_batch(data[i], PAIR), query="q", batch=i)
            writer.write(to_batch(data[15], PAIR), query="q", batch=15)  # a replay: dropped

            client.trigger_checkpoint()  # its key groups are covered by their new owners' c2
            settle(ck, live("node-0", "node-2") | {checkpoint_of(n, "c2") for n in ("node-0", "node-2")})
            kill(cluster, "node-0")  # right after the collection
            wait_for(lambda: len(cluster.recoveries) == 2)
            settle(ck, live("node-2") | {checkpoint_of(n, "c2") for n in ("node-0", "node-2")})
            for i in range(30, 40):
                writer.write(to_batch(data[i], PAIR), query="q", batch=i)
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        assert_exactly_once(outputs("gc-deaths", list(nodes)), data)


def manifest(checkpoint: str | None, adopted: list[str]) -> dict:
    return {
        "checkpoint": checkpoint,
        "key_groups": [],
        "journal": {},
        "outputs": {},
        "adopted": [{"key_groups": [i], "base": b, "journal": {}} for i, b in enumerate(adopted)],
    }


def make(ck, node: str, checkpoints: list[str], named: dict | None) -> None:
    directory = recovery.node_dir(ck, node)
    (directory / "journal" / "job" / "in").mkdir(parents=True)
    (directory / "journal" / "job" / "in" / "00000000.log").write_bytes(b"rows")
    for name in checkpoints:
        (directory / "checkpoints" / name / "job").mkdir(parents=True)
        (directory / "checkpoints" / name / "_metadata.json").write_text("{}")
    if named is not None:
        (directory / "manifest.json").write_text(json.dumps(named))


@pytest.mark.parametrize("cut_after", [0, 2, 5, None])
def test_a_collection_cut_short_deletes_only_what_no_manifest_names(tmp_path, cut_after):
    """Current nodes a, b; nodes gone: c (its c3 restored into a), d (nothing of it named), e
    (its release checkpoint adopted by b). The collection stops (the driver killed) before its
    ``cut_after``-th deletion; whatever it deleted, every named checkpoint and every current
    node's journal is there, and a next collection ends where a whole one would."""
    ck = tmp_path / "ck"

    def path(node, name):
        return str(recovery.node_dir(ck, node) / "checkpoints" / name)

    make(ck, "a", ["c4", "c5", "h2-a"], manifest(path("a", "c5"), [path("c", "c3")]))
    make(ck, "b", ["c5", "h1-b"], manifest(path("b", "h1-b"), [path("e", "h3-e"), path("a", "h2-a")]))
    make(ck, "c", ["c2", "c3"], manifest(path("c", "c3"), []))
    make(ck, "d", ["c1"], manifest(path("d", "c1"), []))
    make(ck, "e", ["c2", "h3-e"], None)  # died writing its manifest: none
    named = {"a/checkpoints/c5", "a/checkpoints/h2-a", "b/checkpoints/h1-b", "c/checkpoints/c3"}
    named |= {"e/checkpoints/h3-e"}
    whole = live("a", "b") | named  # a plain-Python model of what a whole collection keeps

    deleted = []

    def stop(p):
        if cut_after is not None and len(deleted) == cut_after:
            raise KeyboardInterrupt  # the driver dies here
        deleted.append(p)

    try:
        recovery.collect_garbage(ck, ["a", "b"], stop)
    except KeyboardInterrupt:
        assert len(deleted) == cut_after
    kept = layout(ck)
    assert whole <= kept  # nothing named, no current journal or manifest, went
    assert (kept == whole) == (cut_after is None)
    recovery.collect_garbage(ck, ["a", "b"])
    assert layout(ck) == whole
