"""The words nodes, the driver and writers share on the wire: the header carrying the cluster's
secret (and the variable a node process finds it in), and the markers of a node's refusals that
tell a writer to reload the routing table or the broadcast membership and send again."""

SECRET_HEADER = "x-stretch-cluster-secret"
SECRET_ENV = "STRETCH_CLUSTER_SECRET"
NOT_OWNER = "NOT_OWNER"
NOT_MEMBER = "NOT_MEMBER"  # a broadcast write of an older membership than the node is at
