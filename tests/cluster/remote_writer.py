"""A writer and reader on "another host": a process given only a cluster's URL (and its secret in
``$STRETCH_CLUSTER_SECRET``) that writes keyed rows and reads results and keyed state back, told
what to do by JSON lines on its standard input, answering each with a JSON line.

The test runs it in a mount namespace of its own where the cluster's directory is an empty tmpfs
and ``/dev/shm`` a private one: it can reach the cluster only over the network.
"""

from __future__ import annotations

import json
import os
import sys
import time

from stretch.cluster import ClusterWriter, job_nodes
from stretch.cluster.client import ClusterConnection
from stretch.common.records import to_batch
from tests.cluster.jobs import PAIR
from tests.cluster.test_cluster import batches

DATA = batches(3, 60, 40)


def main() -> None:
    url, job, hidden = sys.argv[1:4]
    print(json.dumps({"sees_directory": bool(os.listdir(hidden)), "cwd": os.getcwd()}), flush=True)
    with ClusterWriter(url, job, "in") as writer:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "write":
                for i in range(cmd["from"], cmd["to"]):
                    writer.write(to_batch(DATA[i], PAIR), query="q", batch=i)
                    time.sleep(0.01)  # a steady stream, so that node changes meet it
                answer = {"refusals": writer.refusals}
            elif cmd["op"] == "replay":
                for i in cmd["batches"]:
                    writer.write(to_batch(DATA[i], PAIR), query="q", batch=i)
                answer = {"refusals": writer.refusals}
            elif cmd["op"] == "read":
                answer = read(url, job)
            else:
                break
            print(json.dumps(answer), flush=True)


def read(url: str, job: str) -> dict:
    """Every node's results (a removed node's through the driver) and the keyed state of the
    nodes running now, all over Flight."""
    outputs, state = [], []
    with ClusterConnection(url) as c:
        running = c.locations()
        for node in job_nodes(url, job):
            info = c.output_info(node, job, "out")
            outputs += c.output_range(node, job, "out", info["start"], info["end"]).to_pylist()
            if node in running:
                state += c.get(node, f"state:{job}:counts").to_pylist()
    return {"outputs": outputs, "state": state, "nodes": sorted(running)}


if __name__ == "__main__":
    main()
