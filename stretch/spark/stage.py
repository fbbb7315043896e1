"""A stretch job as a stateful stage inside one Spark query.

>>> from stretch.spark import stage
>>> totals = stage(clicks, job="clicks", into="clicks", out="totals", mode="update", key="user")
>>> totals.writeStream.outputMode("update").format("parquet")...start()   # any Spark sink

Each Spark task of a micro-batch hands its rows to the job as one transaction (``mapInArrow``):
it stages them as an Arrow IPC file next to the job, asks the job to publish it, and returns the
results that its own rows caused, read from the job's output channel. The transaction is named
(query id, micro-batch id, partition): a task that Spark retries, or a micro-batch it replays
after a restart of the query, gets the first attempt's results again, and its rows never reach the
job twice (``stretch.runtime.publisher``), so the query is exactly once into idempotent or
transactional sinks (Spark's file sink; ``foreachBatch`` keyed by batch id).

Modes, as Spark's output modes name them:

- ``append`` (Flink's semantics): every result the job emits for the micro-batch's rows, in order.
- ``update``: per micro-batch, only the latest result of each key (``key``: the column(s) the job
  keys by, which its results carry under the same names). Rows are first partitioned by key, so
  each key's rows of a micro-batch are in one task and its latest result is the micro-batch's.

The job runs on a node engine of this machine, or on a cluster (a job from
``env.execute_async(name, cluster=...)``: see stretch.spark.cluster_stage). It must declare the
record type of its input channel; the DataFrame must fit it, which is checked before the query
starts, with both schemas in the error.
"""

from __future__ import annotations

import numbers
import os
import uuid
from collections.abc import Iterator

import pyarrow as pa
from pyspark import TaskContext

from stretch import channels, jobs
from stretch.cluster import ClusterJobClient
from stretch.cluster.spark_workers import check_workers
from stretch.errors import JobEnded, job_ended
from stretch.spark.cluster_stage import ClusterStage
from stretch.spark.schemas import check_fits, spark_arrow_schema, spark_ddl
from stretch.spark.stage_results import in_spark_schema, latest_per_key, transaction_of

# Spark hands a task its rows 10 000 at a time; the job pays per batch (a gate entry, a fold call
# and an output batch on each instance), so the task stages them in batches this large: it halves
# the job's CPU per transaction. Larger batches are split by the gate as they need.
STAGED_ROWS = 65_536


def stage(
    df,
    job,
    into: str,
    out: str,
    *,
    mode: str = "append",
    key=None,
    result_key=None,
    partitions: int | None = None,
):
    """``df`` through the job: its rows into input channel ``into``, the results from output
    channel ``out``, as a DataFrame (streaming if ``df`` is) of the output channel's schema.

    ``mode="update"``: ``key`` names the DataFrame column(s) the job keys by, ``result_key`` the
    results' field(s) that hold the key (default: the same names); ``partitions``: how many tasks
    a micro-batch's rows are partitioned over (default: ``spark.sql.shuffle.partitions``). The
    three are update mode's: append mode refuses them rather than ignore them.

    The job must be running: one that ended is refused here, saying how it ended.
    """
    if mode not in ("append", "update"):
        raise ValueError(f"mode must be 'append' or 'update', got {mode!r}")
    _check_options(df, mode, key, result_key, partitions)
    check_workers(df.sparkSession)
    if isinstance(job, ClusterJobClient):
        target = ClusterStage(running_on_cluster(job), into, out)
    else:
        target = EngineStage(running(job), into, out)
    in_schema = target.input_schema()
    if in_schema is None:
        raise ValueError(
            f"channel {into!r} of job {target.name!r} declares no record type; a stage needs one"
        )
    check_fits(df.schema, in_schema, f"channel {into!r} of job {target.name!r}")
    out_schema = target.output_schema()
    result_keys: list[str] = []
    if mode == "update":
        keys = _names(key)
        result_keys = _names(result_key) or keys
        if len(result_keys) != len(keys) or any(k not in out_schema.names for k in result_keys):
            raise ValueError(
                f"update mode needs result_key=: the field(s) of the job's results {out_schema.names} "
                f"that hold the key {keys}"
            )
        n = partitions or int(df.sparkSession.conf.get("spark.sql.shuffle.partitions"))
        df = df.repartition(n, *keys)
    task = target.task(in_schema, spark_arrow_schema(out_schema), result_keys)
    return df.mapInArrow(task, spark_ddl(out_schema))


def _check_options(df, mode: str, key, result_key, partitions) -> None:
    """What ``key``, ``result_key`` and ``partitions`` say is refused at once where it cannot
    be done: they are update mode's (append mode returns every result, as the job emits them)."""
    if mode == "append":
        given = [
            name
            for name, value in (("key", key), ("result_key", result_key), ("partitions", partitions))
            if value is not None
        ]
        if given:
            named = ", ".join(f"{g}=" for g in given)
            spread = " (df.repartition(n) spreads its rows over n tasks)" if partitions is not None else ""
            raise ValueError(
                f"{named} {'is' if len(given) == 1 else 'are'} for update mode (each key's latest result per "
                "micro-batch, the rows partitioned by key); append mode, the default, returns every result "
                f"the job emits: give mode='update', or leave {named} out{spread}"
            )
        return
    keys = _names(key)
    if not keys:
        raise ValueError(
            f"update mode needs key=: the column(s) of the DataFrame the job keys by, of {df.columns}"
        )
    missing = [k for k in keys if k not in df.columns]
    if missing:
        raise ValueError(
            f"key= names {missing}, which the DataFrame has no column of: its columns are {df.columns}"
        )
    if partitions is not None and (
        isinstance(partitions, bool) or not isinstance(partitions, numbers.Integral) or partitions < 1
    ):
        raise ValueError(
            f"partitions= is how many tasks take a micro-batch's rows: a positive int, got {partitions!r}"
        )


def running(job) -> jobs.Job:
    """The job, if it runs; else ``JobEnded`` saying how it ended and what to do: a stage cannot
    hand an ended job rows (a JobClient of this process answers after its end: its status says)."""
    try:
        found = jobs.find(job)
    except jobs.JobNotRunning as e:  # by name or id: its ended record says how
        raise job_ended(
            e.info.how or str(e), f"staged; {restart(e.info.ended)} and give stage() the new run"
        ) from None
    status = found.status().get("status")
    if status not in _ENDED:
        return found
    how = f"job {found.name!r} has ended ({status})"
    try:
        jobs.find(found.job_id)
    except jobs.JobNotRunning as e:
        how = e.info.how or how
    except jobs.JobNotFound:
        pass
    raise job_ended(how, f"staged; {restart(status)} and give stage() the new run")


def running_on_cluster(client: ClusterJobClient) -> ClusterJobClient:
    """The cluster job, if it runs on a node; else ``JobEnded`` saying how it ended there (its
    channels' types would otherwise be asked of a job that no longer answers)."""
    states = {node: job.get("status") for node, job in client.describe().items()}
    if any(status not in _ENDED for status in states.values()):
        return client
    ended = set(states.values())
    if not ended:
        how = f"job {client.name!r} runs on no node of the cluster"
    elif len(ended) == 1:
        how = f"job {client.name!r} has ended on the cluster ({ended.pop()})"
    else:
        how = f"job {client.name!r} has ended on the cluster ({', '.join(f'{n}: {s}' for n, s in states.items())})"
    status = next(iter(states.values()), None)
    raise job_ended(how, f"staged; {restart(status)} and give stage() the new run")


_ENDED = {"FINISHED", "CANCELED", "FAILED", "CANCELLING", "FAILING"}


def restart(status: str | None) -> str:
    """How to run a job that ended ``status`` again (a finished one has nothing to restore)."""
    if status == "FINISHED":
        return "start it again (execute_async)"
    return (
        "start it again (execute_async; restore=True continues a checkpointed job from its latest checkpoint)"
    )


class EngineStage:
    """A stage whose job runs on a node engine of this machine."""

    def __init__(self, job: jobs.Job, into: str, out: str):
        self.job, self.into, self.out = job, into, out
        self.name = job.name

    def input_schema(self) -> pa.Schema | None:
        return channels.input_schema(self.job, self.into)

    def output_schema(self) -> pa.Schema:
        return channels.output_schema(self.job, self.out)

    def task(self, in_schema: pa.Schema, out_schema: pa.Schema, keys: list[str]) -> StageTask:
        staging = self.job.join_channel(self.into, "writer")["staging"]
        return StageTask(self.job, self.into, self.out, staging, in_schema, out_schema, keys)


def _names(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value or ())


class StageTask:
    """What each Spark task runs (pickled to the executors' Python workers)."""

    def __init__(self, job: jobs.Job, into, out, staging, in_schema, out_schema, keys):
        self.job_id, self.job_name, self.into, self.out, self.staging = (
            job.job_id,
            job.name,
            into,
            out,
            staging,
        )
        self.in_schema, self.out_schema, self.keys = in_schema, out_schema, keys
        self.stage_id = uuid.uuid4().hex  # names the tasks of batch queries (stage_results.transaction_of)

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        job = self._job()
        path = self._stage(batches)
        if path is None:
            return
        query, batch_id, partition = transaction_of(TaskContext.get(), self.stage_id)
        try:
            reply = job.publish_txn(self.into, self.out, query, batch_id, partition, [path])
        except jobs.JobGone:
            raise self._gone() from None
        results = self._read(reply["log"], reply["offsets"])
        if self.keys:
            results = latest_per_key(results, self.keys)
        yield from results.to_batches()

    def _job(self) -> jobs.Job:
        try:
            return jobs.find(self.job_id)
        except jobs.JobNotFound:
            raise self._gone() from None

    def _gone(self) -> RuntimeError:
        """Why the job takes no rows: it ended (how, where its process still runs), or its
        process is gone (then a checkpointed job restores)."""
        gone = f"the stretch job {self.job_name!r} ({self.job_id[:12]}) of this stage is not running any more"
        try:
            jobs.find(self.job_id)
        except jobs.JobNotRunning as e:
            return JobEnded(
                f"{gone}: {e.info.how or e}; {restart(e.info.ended)} and restart the query with it"
            )
        except jobs.JobNotFound:
            pass
        return RuntimeError(f"{gone}: restore it (execute(restore=True)) and restart the query")

    def _stage(self, batches) -> str | None:
        """The task's rows as an Arrow IPC file in the job's staging directory (None: no rows)."""
        path = os.path.join(self.staging, f"{uuid.uuid4().hex}.arrows")
        rows = 0
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileNotFoundError:  # the job removed its staging directory as it ended
            raise self._gone() from None
        held: list[pa.RecordBatch] = []  # written as one batch once STAGED_ROWS are held
        with os.fdopen(fd, "wb") as f, pa.ipc.new_stream(f, self.in_schema) as writer:
            for batch in batches:
                if not batch.num_rows:
                    continue
                columns = [c.cast(t.type) for c, t in zip(batch.columns, self.in_schema)]
                held.append(pa.RecordBatch.from_arrays(columns, schema=self.in_schema))
                rows += batch.num_rows
                if sum(b.num_rows for b in held) >= STAGED_ROWS:
                    writer.write_table(pa.Table.from_batches(held).combine_chunks())
                    held = []
            if held:
                writer.write_table(pa.Table.from_batches(held).combine_chunks())
        if not rows:
            os.unlink(path)
            return None
        return path

    def _read(self, log: str, offsets: list[int]) -> pa.Table:
        """The transaction's results, as Spark's schema has them."""
        schema = self.out_schema
        out = []
        with channels.OutputLog(log) as results:
            for offset in offsets:
                for batch in results.read(offset, offset + 1):
                    out.append(in_spark_schema(batch, schema))
        return pa.Table.from_batches(out, schema=schema)
