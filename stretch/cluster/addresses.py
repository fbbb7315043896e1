"""Where a cluster's endpoints listen, what they tell peers to dial, and the two forms of its address.

Nodes and the driver bind to ``host``: loopback (127.0.0.1) by default, so that only processes of
this machine reach them; any other interface (an IP, or ``0.0.0.0`` for all) opens them to other
hosts, still refusing every call without the cluster's secret. A node bound to all interfaces
advertises one address peers can dial: the machine's (Spark's ``SPARK_LOCAL_IP`` in an executor).

A cluster's address is either its directory (same host: files hold the routing table, the nodes'
endpoints and the secret) or its driver's URL (``grpc://10.1.2.3:40123``, ``grpc+tls://`` with
TLS; any host: the driver answers the same over Flight, to callers holding the secret).
"""

from __future__ import annotations

import ipaddress
import os
import socket

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::", "")
URL_SCHEMES = ("grpc://", "grpc+tls://")


def is_url(address) -> bool:
    """A driver's URL (``grpc://host:port``), not a directory."""
    return isinstance(address, str) and address.startswith(URL_SCHEMES)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def machine_address() -> str:
    """This machine's address on its network (not loopback): the interface its default route
    leaves by (a UDP socket's connect sends nothing), else what its hostname resolves to."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
            if not is_loopback(address) and address not in WILDCARDS:
                return address
        except OSError:
            pass
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = LOOPBACK
    if is_loopback(address):
        raise LookupError(
            "this machine has no network address besides loopback: bind the cluster to an explicit host"
        )
    return address


def advertised_host(host: str) -> str:
    """What peers dial to reach an endpoint bound to ``host``: ``host`` itself, or for all
    interfaces ``SPARK_LOCAL_IP`` (set by Spark where it runs) or the machine's address."""
    if host not in WILDCARDS:
        return host
    return os.environ.get("SPARK_LOCAL_IP") or machine_address()
