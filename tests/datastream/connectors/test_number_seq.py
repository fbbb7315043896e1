from stretch.common import WatermarkStrategy
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import NumberSequenceSource


def test_number_sequence_is_inclusive_and_keyed_sums_match():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    ds = env.from_source(
        NumberSequenceSource(1, 100_000, batch_rows=7000), WatermarkStrategy.no_watermarks(), "seq"
    )
    with ds.key_by(lambda x: x % 10).sum(0).execute_and_collect() as it:
        got = list(it)
    assert len(got) == 100_000
    running, want = {}, []
    for x in range(1, 100_001):
        running[x % 10] = running.get(x % 10, 0) + x
        want.append(running[x % 10])
    assert sorted(got) == sorted(want)


def test_number_sequence_values_in_order_at_parallelism_one():
    env = StreamExecutionEnvironment.get_execution_environment()
    with env.from_source(NumberSequenceSource(5, 9), None, "seq").execute_and_collect() as it:
        assert list(it) == [5, 6, 7, 8, 9]
