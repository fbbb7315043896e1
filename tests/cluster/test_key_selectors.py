"""A job keyed by a key selector function (``key_by(lambda r: ...)``, as most PyFlink programs key)
on a cluster: writers route every record by the job's own selector while nodes come and go, and
each key's running count and sum equal a plain-Python reference; a selector that fails refuses
the write, naming the record, and nothing of it reaches a node."""

from __future__ import annotations

from collections import defaultdict

import pytest

from stretch.cluster import StretchCluster
from stretch.cluster.key_routes import KeySelectorFailed
from stretch.common.records import to_batch
from tests.cluster.jobs import PAIR, team_job, team_of
from tests.cluster.test_cluster import batches, outputs


@pytest.mark.long  # about 15 s: three node starts; test_key_routes covers the routing by default
def test_a_lambda_keyed_job_is_exact_while_nodes_are_added_and_removed(tmp_path):
    data = batches(7, 12, 40)
    with StretchCluster.local(nodes=2, directory=tmp_path / "cluster", step=16) as cluster:
        client = team_job().execute_async("teams", cluster=cluster)
        with client.writer("in") as writer:
            for i, records in enumerate(data):
                writer.write(to_batch(records, PAIR), query="q", batch=i)
                if i == 3:
                    assert cluster.add_node().key_groups_moved == 42
                if i == 7:
                    cluster.remove_node("node-0")
                if i == 9:  # a replay of a micro-batch taken before both changes: dropped
                    writer.write(to_batch(data[2], PAIR), query="q", batch=2)
            broken = [("user-1", 1000), ("user-2", 1000), ("user-x", 1000)]
            with pytest.raises(
                KeySelectorFailed, match=r"operator 'teams' failed on record \('user-x', 1000\)"
            ):
                writer.write(to_batch(broken, PAIR), query="q", batch=len(data))
        client.end("in")
        assert set(client.wait(120).values()) == {"FINISHED"}
        got = outputs("teams", ["node-0", "node-1", "node-2"])
    counts, sums = defaultdict(int), defaultdict(int)
    want = set()
    for records in data:
        for record in records:
            team = team_of(record)
            counts[team] += 1
            sums[team] += record[1]
            want.add((team, counts[team], sums[team]))
    assert sorted(got) == sorted(want)  # each team's running count and sum, every step once
