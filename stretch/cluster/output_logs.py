"""A node's output logs served over Flight, for readers on other hosts (Spark's, by URL).

On the node's host a reader opens the log's files by path; elsewhere it asks the node: action
``output`` (body ``{"job": "<job>@<node>", "channel"}``) answers the log's readable offsets, the
first of the job's current run and the channel's schema; ticket ``output:{"job", "channel",
"start", "end"}`` streams batches ``start`` .. ``end``. The driver answers the same for a node that
was removed, whose log stays where it wrote it (readable from the driver where the driver shares
the node's filesystem: nodes on the driver's host).
"""

from __future__ import annotations

import base64

import pyarrow as pa

from stretch.channels import OutputLog, locate_output, output_schema


def encode_schema(schema: pa.Schema | None) -> str | None:
    return None if schema is None else base64.b64encode(schema.serialize().to_pybytes()).decode()


def decode_schema(text: str | None) -> pa.Schema | None:
    return None if text is None else pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def run_output(run: dict, channel: str) -> dict:
    """Where output channel ``channel`` of one run of a job on a node is (a ``locate_output``
    answer), ``run`` being its job id and log directories (``NodeJob.run_record``): not another
    cluster's job of the same name on the host, which the name ``<job>@<node>`` may find."""
    return locate_output(run["job_id"], channel, kept=run["logs"].get(channel))


def locate(msg: dict) -> dict:
    """Where the asked output log is: by its run where the node or driver added it, else by the
    job's name."""
    run = msg.get("run")
    return locate_output(msg["job"], msg["channel"]) if run is None else run_output(run, msg["channel"])


def output_info(msg: dict) -> dict:
    """Offsets (``start``, ``end``, ``run_start``) and ``schema`` of an output channel's log."""
    where = locate(msg)
    with OutputLog(where["log"]) as log:
        start, end = log.start, log.end
    try:
        schema = output_schema(msg["job"], msg["channel"], where)
    except ValueError:  # no declared type and nothing written yet
        schema = None
    return {"start": start, "end": end, "run_start": where["run_start"], "schema": encode_schema(schema)}


def output_range(msg: dict) -> pa.Table:
    """Batches ``start`` .. ``end`` of an output channel's log, as one table."""
    with OutputLog(locate(msg)["log"]) as log:
        batches = [b.replace_schema_metadata(None) for b in log.read(int(msg["start"]), int(msg["end"]))]
    if not batches:
        return pa.table({})
    schema = batches[0].schema
    return pa.Table.from_batches([b if b.schema.equals(schema) else b.cast(schema) for b in batches])
