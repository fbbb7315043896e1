"""Across nodes: the key group -> node routing table, node processes, key-group handoff.

One level above the node engine: each node runs today's engine for the key groups it owns, and
the cluster moves key groups between nodes (copying their state) when nodes come and go.
"""

from stretch.cluster.client import NodeUnreachable, NotOwner, job_nodes
from stretch.cluster.cluster import StretchCluster
from stretch.cluster.handoff import HandoffReport
from stretch.cluster.job_client import ClusterJobClient
from stretch.cluster.recovery import NodeLost
from stretch.cluster.routing import RoutingStore, RoutingTable, plan_add_node, plan_remove_node
from stretch.cluster.tls import ClusterTLS
from stretch.cluster.writer import ClusterWriter

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
