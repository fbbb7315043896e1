"""The cluster's routing table: which node owns each key group, one version at a time.

Every writer (a Spark task, a Python client) and every node must agree on the owner of a row's
key group, so the table is a plain versioned list ``owners[kg] -> node id`` that the cluster
publishes durably as JSON in its directory: a driver that restarts, or a writer in another
process, reads the latest version from there. It starts as contiguous ranges (as instances own
key groups inside a node); a node change computes the fewest moves that keep every node within
one key group of an even share (``plan_add_node``, ``plan_remove_node``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RoutingTable:
    """Version ``version`` of the key group -> node table (``owners[kg]`` is a node id)."""

    version: int
    owners: tuple[str, ...]

    @classmethod
    def initial(cls, nodes: list[str], max_parallelism: int) -> RoutingTable:
        """Contiguous ranges, as ``operator_index`` gives key groups to instances."""
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"node ids must be distinct, got {nodes}")
        if len(nodes) > max_parallelism:
            raise ValueError(
                f"{len(nodes)} nodes but only {max_parallelism} key groups: a node would own none"
            )
        n = len(nodes)
        return cls(0, tuple(nodes[kg * n // max_parallelism] for kg in range(max_parallelism)))

    @property
    def max_parallelism(self) -> int:
        return len(self.owners)

    @property
    def nodes(self) -> list[str]:
        """The nodes owning at least one key group, in order of their first key group."""
        return list(dict.fromkeys(self.owners))

    def key_groups_of(self, node: str) -> list[int]:
        return [kg for kg, owner in enumerate(self.owners) if owner == node]

    def moved(self, moves: dict[int, str]) -> RoutingTable:
        """The next version, with ``moves`` (key group -> new owner) applied."""
        owners = list(self.owners)
        for kg, node in moves.items():
            owners[kg] = node
        return RoutingTable(self.version + 1, tuple(owners))

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "owners": list(self.owners)})

    @classmethod
    def from_json(cls, text: str) -> RoutingTable:
        raw = json.loads(text)
        return cls(int(raw["version"]), tuple(str(o) for o in raw["owners"]))


def plan_add_node(table: RoutingTable, node: str) -> dict[int, str]:
    """The fewest key groups to give a new node so that every node is within one of an even share.

    The new node takes its share from the nodes holding the most, each giving up the end of its
    ranges, so owners keep contiguous runs. On 2 -> 3 nodes about 1/3 of the key groups move.
    """
    if node in table.owners:
        raise ValueError(f"node {node!r} already owns key groups")
    counts = Counter(table.owners)
    target = table.max_parallelism // (len(counts) + 1)  # the smallest even share: the fewest moves
    mine = {n: table.key_groups_of(n) for n in counts}
    moves: dict[int, str] = {}
    for _ in range(target):
        donor = max(counts, key=lambda n: (counts[n], n))
        kg = mine[donor].pop()
        counts[donor] -= 1
        moves[kg] = node
    return dict(sorted(moves.items()))


def plan_remove_node(table: RoutingTable, node: str) -> dict[int, str]:
    """Where a leaving node's key groups go: each to the node holding the fewest at that point."""
    if node not in table.owners:
        raise ValueError(f"node {node!r} owns no key groups (nodes: {table.nodes})")
    counts = Counter(o for o in table.owners if o != node)
    if not counts:
        raise ValueError(f"node {node!r} is the only node: nowhere to move its key groups")
    moves: dict[int, str] = {}
    for kg in table.key_groups_of(node):
        taker = min(counts, key=lambda n: (counts[n], n))
        counts[taker] += 1
        moves[kg] = taker
    return moves


def steps(
    moves: dict[int, str], size: int, state_bytes: dict[int, float] | None = None, budget: float = 0
) -> list[dict[int, str]]:
    """Moves cut into small steps (Megaphone's fluid migration) of at most ``size`` key groups
    and, given each key group's ``state_bytes``, at most ``budget`` bytes of state (but at least
    one key group): each step is one version, so a key waits only for its own step's copy."""
    out: list[dict[int, str]] = []
    step: dict[int, str] = {}
    held = 0.0
    for kg, node in sorted(moves.items()):
        weight = state_bytes.get(kg, 0.0) if state_bytes else 0.0
        if step and (len(step) == size or (budget and held + weight > budget)):
            out.append(step)
            step, held = {}, 0.0
        step[kg] = node
        held += weight
    if step:
        out.append(step)
    return out


class RoutingStore:
    """The routing table kept in a directory: ``routing.json`` holds the latest version, written
    atomically (a reader sees a whole version, old or new), so it survives a driver restart."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.path = self.directory / "routing.json"

    def save(self, table: RoutingTable) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        current = self.load()
        if current is not None and table.version <= current.version:
            raise ValueError(
                f"routing version {table.version} is not newer than the stored {current.version}"
            )
        tmp = self.path.with_name(f"routing.json.{os.getpid()}.tmp")
        tmp.write_text(table.to_json())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        tmp.replace(self.path)

    def load(self) -> RoutingTable | None:
        try:
            return RoutingTable.from_json(self.path.read_text())
        except FileNotFoundError:
            return None


def plan_failover(table: RoutingTable, dead: list[str], survivors: list[str] | None = None) -> dict[int, str]:
    """Where the key groups of nodes that died go: each to the surviving node holding the fewest
    at that point (as ``plan_remove_node``, for several nodes at once). ``survivors``: the nodes
    to restore on (default: the owners that did not die; new nodes after a driver restart)."""
    gone = set(dead)
    counts = Counter(o for o in table.owners if o not in gone)
    for node in survivors or []:
        counts.setdefault(node, 0)
    counts = Counter({n: c for n, c in counts.items() if survivors is None or n in survivors})
    if not counts:
        raise ValueError(f"no node of the cluster survives ({sorted(gone)} died): nowhere to restore")
    moves: dict[int, str] = {}
    for kg, owner in enumerate(table.owners):
        if owner in gone:
            taker = min(counts, key=lambda n: (counts[n], n))
            counts[taker] += 1
            moves[kg] = taker
    return moves
