"""Spark reads an operator's keyed state from a job's checkpoints with
``format("stretch").option("checkpoint", path).option("state", operator)``, on local Spark: the
same state as ``read_checkpoint`` and a plain-Python model give, at the checkpoint asked for."""

from __future__ import annotations

import json
import random

import pytest

from stretch import channels
from stretch.state import checkpoint_dir, read_checkpoint
from tests.state.test_checkpoint_reader import model, records, remember_job, wait_processed


def as_model(rows) -> dict:
    """Spark's rows as the model has them: lists and maps come as JSON text, as a live read's."""
    return {
        r["key"]: {
            "count": r["count"],
            "last": r["last"],
            "values": json.loads(r["values"]),
            "by_tag": dict(json.loads(r["by_tag"])),
        }
        for r in rows
    }


def test_spark_reads_an_operators_state_from_a_jobs_checkpoints(spark):
    name = f"spark-ckpt-{random.randrange(1 << 40):x}"
    client = remember_job(name)
    writer = channels.open_writer(client, "in")
    first, second = records(0, 900), records(900, 400)
    writer.write(first)
    wait_processed(client, len(first))
    one = client.trigger_checkpoint()["id"]
    writer.write(second)
    wait_processed(client, len(first) + len(second))
    client.trigger_checkpoint()
    path = str(checkpoint_dir(name))

    def state(operator="remember", checkpoint=path, **options):
        reader = spark.read.format("stretch").option("checkpoint", checkpoint).option("state", operator)
        for key, value in options.items():
            reader = reader.option(key, value)
        return reader.load()

    assert as_model(state(checkpointId=one).collect()) == model(first)  # an earlier one, by id
    writer.end()
    assert client.wait(60).name == "FINISHED"
    df = state(partitions=3)  # the latest: a finished job keeps it
    assert df.schema.simpleString() == (
        "struct<key_group:int,key:string,count:bigint,last:string,values:string,by_tag:string>"
    )
    assert as_model(df.collect()) == model(first + second)
    assert df.count() == read_checkpoint(path, "remember").num_rows
    with pytest.raises(
        Exception, match=r"no keyed operator 'nope' in checkpoint .*operators there: remember"
    ):
        state("nope")
    with pytest.raises(Exception, match=rf"no checkpoint {one} at .*\(completed: "):
        state(checkpointId=one)
    with pytest.raises(Exception, match=r"no checkpoint at .*: no such directory"):
        state(checkpoint=path + "-nowhere")
