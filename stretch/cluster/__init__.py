"""Across nodes: the key group -> node routing table, node processes, key-group handoff.

One level above the node engine: each node runs today's engine for the key groups it owns, and
the cluster moves key groups between nodes (copying their state) when nodes come and go.
"""

from stretch.cluster.client import ClusterWriter, NodeUnreachable, NotOwner, job_nodes
from stretch.cluster.cluster import HandoffReport, NodeLost, StretchCluster
from stretch.cluster.job_client import ClusterJobClient
from stretch.cluster.routing import RoutingStore, RoutingTable, plan_add_node, plan_remove_node
from stretch.cluster.tls import ClusterTLS

__all__ = [
    "ClusterJobClient",
    "ClusterTLS",
    "ClusterWriter",
    "HandoffReport",
    "NodeLost",
    "NodeUnreachable",
    "NotOwner",
    "RoutingStore",
    "RoutingTable",
    "StretchCluster",
    "job_nodes",
    "plan_add_node",
    "plan_remove_node",
]
