"""The options every ``format("stretch")`` read and write of a channel needs."""

from __future__ import annotations


def job_and_channel(options) -> tuple[str, str]:
    """``option("job", ...)`` and ``option("channel", ...)``, both required."""
    job, channel = options.get("job"), options.get("channel")
    if not job or not channel:
        raise ValueError('format("stretch") needs .option("job", ...) and .option("channel", ...)')
    return job, channel
