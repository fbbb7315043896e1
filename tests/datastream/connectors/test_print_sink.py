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


def test_typed_fields_print_as_their_java_values_do():
    """PyFlink's print() of a typed stream is Java's toString of each value (only ROW records are
    formatted in Python): Lists, Maps, nested Rows and Doubles as Java writes them."""
    from stretch.common.records import to_batch
    from stretch.datastream.connectors.print_sink import format_records

    def lines(records, type_info):
        return format_records(to_batch(records, type_info))

    assert lines([["a", "b"], []], Types.LIST(Types.STRING())) == ["[a, b]", "[]"]
    assert lines([{"k": 1, "j": None}], Types.MAP(Types.STRING(), Types.LONG())) == ["{k=1, j=null}"]
    nested = Types.TUPLE([Types.ROW([Types.STRING(), Types.LONG()]), Types.LIST(Types.BOOLEAN())])
    assert lines([(Row("a", 1), [True, None])], nested) == ["(+I[a, 1],[true, null])"]
    doubles = {1.5: "1.5", 2.0: "2.0", 1e-3: "0.001", 9999999.0: "9999999.0", 1e7: "1.0E7"}
    doubles.update({12345678.0: "1.2345678E7", 1e20: "1.0E20", -2.5e-10: "-2.5E-10", 1e-4: "1.0E-4"})
    doubles.update({float("nan"): "NaN", float("-inf"): "-Infinity"})
    assert lines(list(doubles), Types.DOUBLE()) == list(doubles.values())
    # a ROW record is formatted in Python by PyFlink, its fields with Python's str
    row = Types.ROW([Types.LIST(Types.STRING()), Types.DOUBLE()])
    assert lines([Row(["a"], 1e20)], row) == ["+I[['a'],1e+20]"]
