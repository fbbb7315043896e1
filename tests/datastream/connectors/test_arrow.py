import pyarrow as pa
import pyarrow.parquet as pq

from stretch.common import Row
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import ArrowSource, ParquetSink, ParquetSource


def table(n=5000):
    return pa.table({"user": [i % 37 for i in range(n)], "amount": [i * 0.5 for i in range(n)]})


def running_sums(t):
    acc, out = {}, []
    for u, a in zip(t["user"].to_pylist(), t["amount"].to_pylist()):
        acc[u] = acc.get(u, 0.0) + a
        out.append((u, acc[u]))
    return sorted(out)


def test_parquet_in_parquet_out(tmp_path):
    t = table()
    pq.write_table(t, tmp_path / "in.parquet", row_group_size=1000)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    ds = env.from_source(ParquetSource(tmp_path / "in.parquet", batch_size=700), None, "clicks")
    ds.key_by("user").sum("amount").sink_to(ParquetSink(tmp_path / "out.parquet"))
    env.execute("parquet round trip")
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column_names == ["user", "amount"]
    assert sorted(zip(out["user"].to_pylist(), out["amount"].to_pylist())) == running_sums(t)
    assert not list(tmp_path.glob("*.inprogress"))


def test_arrow_source_gives_rows_with_field_names():
    env = StreamExecutionEnvironment.get_execution_environment()
    t = table(10)
    with env.from_source(ArrowSource(t), None, "arrow").execute_and_collect() as it:
        got = list(it)
    assert got == [Row(user=u, amount=a) for u, a in zip(t["user"].to_pylist(), t["amount"].to_pylist())]


def test_parquet_sink_leaves_no_file_when_the_job_fails(tmp_path):
    import pytest

    env = StreamExecutionEnvironment.get_execution_environment()
    ds = env.from_arrow(table(100)).map(lambda r: 1 // (r.user - 5))
    ds.sink_to(ParquetSink(tmp_path / "out.parquet"))
    with pytest.raises(Exception, match="ZeroDivisionError"):
        env.execute()
    assert not list(tmp_path.iterdir())
