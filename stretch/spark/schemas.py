"""Channel schemas as Spark sees them, and the check that a Spark schema fits a channel."""

from __future__ import annotations

import json

import pyarrow as pa

from stretch.channels import input_schema

_DDL = [
    (pa.types.is_int8, "TINYINT"),
    (pa.types.is_int16, "SMALLINT"),
    (pa.types.is_int32, "INT"),
    (pa.types.is_int64, "BIGINT"),
    (pa.types.is_float32, "FLOAT"),
    (pa.types.is_float64, "DOUBLE"),
    (pa.types.is_boolean, "BOOLEAN"),
    (lambda t: pa.types.is_string(t) or pa.types.is_large_string(t), "STRING"),
    (lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t), "BINARY"),
    (pa.types.is_timestamp, "TIMESTAMP"),
    (pa.types.is_date, "DATE"),
]


_SPARK_ARROW = {
    "TINYINT": pa.int8(),
    "SMALLINT": pa.int16(),
    "INT": pa.int32(),
    "BIGINT": pa.int64(),
    "FLOAT": pa.float32(),
    "DOUBLE": pa.float64(),
    "BOOLEAN": pa.bool_(),
    "STRING": pa.string(),
    "BINARY": pa.binary(),
    "TIMESTAMP": pa.timestamp("us", tz="UTC"),
    "DATE": pa.date32(),
}


def channel_schema(job: str, channel: str) -> pa.Schema:
    """An input channel's schema; a clear error for unknown jobs and channels and untyped channels."""
    schema = input_schema(job, channel)
    if schema is None:
        raise ValueError(f"channel {channel!r} of job {job!r} declares no record type")
    return schema


def spark_type(t: pa.DataType) -> str | None:
    """The Spark SQL type of an Arrow type, where there is a plain one."""
    for test, name in _DDL:
        if test(t):
            return name
    return None


def spark_arrow_schema(schema: pa.Schema) -> pa.Schema:
    """The Arrow schema Spark exchanges for a channel's records: its own Arrow types (regular
    strings and binaries, microsecond timestamps), JSON text for fields Spark has no type for."""
    return pa.schema([(f.name, _SPARK_ARROW.get(spark_type(f.type) or "STRING")) for f in schema])


def spark_ddl(schema: pa.Schema) -> str:
    """``name TYPE, ...`` for Spark; fields of other types (lists, maps, records) are JSON text."""
    return ", ".join(f"`{f.name}` {spark_type(f.type) or 'STRING'}" for f in schema)


def spark_values(column: pa.Array) -> pa.Array:
    """A column as Spark reads it: as is where Spark has the type (large strings and binaries as
    regular ones: a Python data source's reader must return Spark's own Arrow types, and state
    keeps strings large), else as JSON text."""
    if pa.types.is_large_string(column.type) or pa.types.is_large_binary(column.type):
        return column.cast(_SPARK_ARROW[spark_type(column.type)])
    if spark_type(column.type) is not None:
        return column
    return pa.array(
        [None if v is None else json.dumps(v, default=str) for v in column.to_pylist()], pa.string()
    )


def check_fits(spark_schema, channel: pa.Schema, where: str) -> None:
    """A Spark schema fits a channel when it has the same fields, by position, of the same kinds."""
    ok = len(spark_schema.fields) == len(channel)
    if ok:
        for sf, cf in zip(spark_schema.fields, channel):
            ok = ok and sf.dataType.simpleString().upper() in _aliases(spark_type(cf.type))
    if not ok:
        spark = ", ".join(f"{f.name} {f.dataType.simpleString()}" for f in spark_schema.fields)
        raise ValueError(
            f"the Spark schema does not fit {where}:\n  Spark:   {spark}\n  channel: {spark_ddl(channel)}"
        )


def _aliases(family: str | None) -> set[str]:
    return {
        "BIGINT": {"BIGINT"},
        "INT": {"INT"},
        "SMALLINT": {"SMALLINT"},
        "TINYINT": {"TINYINT"},
        "DOUBLE": {"DOUBLE"},
        "FLOAT": {"FLOAT"},
        "BOOLEAN": {"BOOLEAN"},
        "STRING": {"STRING"},
        "BINARY": {"BINARY"},
        "TIMESTAMP": {"TIMESTAMP", "TIMESTAMP_NTZ"},
        "DATE": {"DATE"},
    }.get(family or "", set())
