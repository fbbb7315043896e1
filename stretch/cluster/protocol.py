"""The words the cluster's processes share on the wire: the secret every call carries, the
refusals a node answers, and how a server's errors reach its callers.

Nodes and the driver serve these; writers, readers, launchers and the driver as a caller read
them. They live apart from the servers so that a caller imports no server to speak to one.
"""

from __future__ import annotations

import functools
import hmac

from pyarrow import flight

SECRET_HEADER = "x-stretch-cluster-secret"
SECRET_ENV = "STRETCH_CLUSTER_SECRET"
NOT_OWNER = "NOT_OWNER"  # rows of a key group the node does not own (now): reload the routing table
NOT_MEMBER = "NOT_MEMBER"  # a broadcast write of an older membership than the node is at
LEFT_CLUSTER = 1 << 62  # the membership version of a node that left: it takes no broadcast row


def plain_errors(call):
    """A server call's error reaches the caller as its type and message: Flight would otherwise
    append the server's Python traceback to the message of any exception but its own."""

    @functools.wraps(call)
    def wrapped(*args, **kwargs):
        try:
            return call(*args, **kwargs)
        except flight.FlightError:
            raise
        except Exception as e:
            message = e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 else e
            raise flight.FlightServerError(f"{type(e).__name__}: {message}") from e

    return wrapped


class SecretCheck(flight.ServerMiddlewareFactory):
    """Rejects every call that does not carry the cluster's secret."""

    def __init__(self, secret: str):
        self.secret = secret.encode()

    def start_call(self, info, headers):
        given = headers.get(SECRET_HEADER) or headers.get(SECRET_HEADER.encode()) or [b""]
        value = given[0] if isinstance(given[0], bytes) else str(given[0]).encode()
        if not hmac.compare_digest(value, self.secret):
            raise flight.FlightUnauthenticatedError(
                "this stretch node accepts only calls carrying its cluster's secret"
            )


def call_options(secret: str) -> flight.FlightCallOptions:
    """Flight call options carrying the cluster's secret."""
    return flight.FlightCallOptions(headers=[(SECRET_HEADER.encode(), secret.encode())])
