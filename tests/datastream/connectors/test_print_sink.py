import io

from stretch.common import Row, Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors.print_sink import PrintSink


def printed(records, type_info=None, parallelism=1, identifier=None, key=False):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(parallelism)
    out = io.StringIO()
    ds = env.from_collection(records, type_info)
    if key:
        ds = ds.key_by(lambda r: r[0]).map(lambda r: r, output_type=type_info)
    ds.sink_to(PrintSink(identifier, stream=out))
    env.execute()
    return out.getvalue().splitlines()


def test_print_formats_like_pyflink():
    assert printed([("a", 1)]) == ["('a', 1)"]
    assert printed([("a", 1)], Types.TUPLE([Types.STRING(), Types.LONG()])) == ["(a,1)"]
    assert printed([Row("a", 1)], Types.ROW([Types.STRING(), Types.LONG()])) == ["+I[a,1]"]
    assert printed([True, False], Types.BOOLEAN()) == ["true", "false"]
    assert printed(["x"], Types.STRING(), identifier="out") == ["out> x"]


def test_print_prefixes_instance_at_parallelism_above_one():
    lines = printed([("a", 1), ("b", 2), ("c", 3)], Types.TUPLE([Types.STRING(), Types.LONG()]), 2, key=True)
    assert sorted(line.split("> ", 1)[1] for line in lines) == ["(a,1)", "(b,2)", "(c,3)"]
    assert all(line.split("> ")[0] in {"1", "2"} for line in lines)
