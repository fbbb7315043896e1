"""The routing table: contiguous start, fewest moves on node changes, balance, durable versions."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from stretch.cluster.routing import (
    RoutingStore,
    RoutingTable,
    plan_add_node,
    plan_failover,
    plan_remove_node,
    steps,
)


def test_initial_table_is_contiguous_ranges():
    table = RoutingTable.initial(["a", "b", "c"], 128)
    assert table.version == 0
    for node in "abc":
        kgs = table.key_groups_of(node)
        assert kgs == list(range(kgs[0], kgs[-1] + 1))
    assert sorted(Counter(table.owners).values()) == [42, 43, 43]


def balanced(table: RoutingTable) -> bool:
    counts = Counter(table.owners).values()
    return max(counts) - min(counts) <= 1


@pytest.mark.parametrize("n,maxp", [(1, 128), (2, 128), (3, 128), (5, 128), (7, 1000), (2, 3)])
def test_add_node_moves_only_the_new_nodes_share(n, maxp):
    table = RoutingTable.initial([f"n{i}" for i in range(n)], maxp)
    moves = plan_add_node(table, "new")
    after = table.moved(moves)
    assert after.version == 1
    assert balanced(after)
    assert all(dst == "new" for dst in moves.values())  # nothing moves between old nodes
    assert len(moves) == maxp // (n + 1) or len(moves) == -(-maxp // (n + 1))
    assert sum(a != b for a, b in zip(table.owners, after.owners)) == len(moves)


def test_two_to_three_moves_about_a_third():
    table = RoutingTable.initial(["a", "b"], 128)
    moves = plan_add_node(table, "c")
    assert abs(len(moves) / 128 - 1 / 3) < 0.01


def test_remove_node_moves_only_its_key_groups_and_stays_balanced():
    rng = random.Random(7)
    table = RoutingTable.initial(["a", "b", "c", "d"], 128)
    for step in range(20):
        if len(table.nodes) > 1 and rng.random() < 0.5:
            gone = rng.choice(table.nodes)
            moves = plan_remove_node(table, gone)
            assert set(moves) == set(table.key_groups_of(gone))
            assert gone not in moves.values()
        else:
            moves = plan_add_node(table, f"x{step}")
        table = table.moved(moves)
        assert balanced(table)


def test_refusals():
    table = RoutingTable.initial(["a"], 4)
    with pytest.raises(ValueError, match="only node"):
        plan_remove_node(table, "a")
    with pytest.raises(ValueError, match="owns no key groups"):
        plan_remove_node(table, "z")
    with pytest.raises(ValueError, match="already owns"):
        plan_add_node(table, "a")
    with pytest.raises(ValueError, match="would own none"):
        RoutingTable.initial(["a", "b", "c"], 2)


def test_steps_cut_moves_into_small_versions():
    moves = {kg: "n" for kg in range(20)}
    parts = steps(moves, 8)
    assert [len(p) for p in parts] == [8, 8, 4]
    assert {k: v for p in parts for k, v in p.items()} == moves


@pytest.mark.parametrize("seed", range(5))
def test_steps_of_large_key_groups_hold_fewer_of_them(seed):
    """Each step stays within the byte budget unless it is a single key group, holds at most
    ``size`` key groups, and the steps together are the moves, in key group order."""
    rng = np.random.default_rng(seed)
    moves = {int(kg): f"n{kg % 3}" for kg in rng.choice(128, 60, replace=False)}
    weights = {kg: float(rng.integers(0, 5 << 20)) for kg in range(128)}
    budget = 6 << 20
    parts = steps(moves, 8, weights, budget)
    assert [kg for p in parts for kg in p] == sorted(moves)
    assert {k: v for p in parts for k, v in p.items()} == moves
    for i, p in enumerate(parts):
        held = sum(weights[kg] for kg in p)
        assert len(p) <= 8 and (held <= budget or len(p) == 1)
        if i + 1 < len(parts) and len(p) < 8:  # cut early only because the next would not fit
            assert held + weights[next(iter(parts[i + 1]))] > budget


def test_store_keeps_the_latest_version_across_restarts(tmp_path):
    store = RoutingStore(tmp_path)
    assert store.load() is None
    table = RoutingTable.initial(["a", "b"], 16)
    store.save(table)
    newer = table.moved(plan_add_node(table, "c"))
    store.save(newer)
    assert RoutingStore(tmp_path).load() == newer  # a new driver reads what the old one wrote
    with pytest.raises(ValueError, match="not newer"):
        store.save(table)


def test_failover_gives_dead_nodes_key_groups_to_the_survivors_evenly():
    table = RoutingTable.initial(["a", "b", "c", "d"], 128)
    moves = plan_failover(table, ["b", "d"])
    assert set(moves) == set(table.key_groups_of("b")) | set(table.key_groups_of("d"))
    after = table.moved(moves)
    assert set(after.owners) == {"a", "c"} and balanced(after)
    fresh = table.moved(plan_failover(table, ["a", "b", "c", "d"], survivors=["x", "y", "z"]))
    assert set(fresh.owners) == {"x", "y", "z"} and balanced(fresh)
    with pytest.raises(ValueError, match="no node of the cluster survives"):
        plan_failover(table, ["a", "b", "c", "d"])
