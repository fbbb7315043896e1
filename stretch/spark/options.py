"""The options every ``format("stretch")`` read and write of a channel needs."""

from __future__ import annotations

from stretch.cluster import ClusterTLS


def job_and_channel(options) -> tuple[str, str]:
    """``option("job", ...)`` and ``option("channel", ...)``, both required."""
    job, channel = options.get("job"), options.get("channel")
    if not job or not channel:
        raise ValueError('format("stretch") needs .option("job", ...) and .option("channel", ...)')
    return job, channel


def cluster_credentials(options):
    """``option("secret", ...)`` and ``option("tls", ...)`` (a ClusterTLS's JSON) for a cluster
    given by URL; None where not given (then ``$STRETCH_CLUSTER_SECRET`` and
    ``$STRETCH_CLUSTER_TLS`` where the code runs)."""
    tls = options.get("tls")
    return options.get("secret") or None, ClusterTLS.from_json(tls) if tls else None
