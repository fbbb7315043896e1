"""User-defined metrics (PyFlink's pyflink.metrics) count within the instance that owns them."""

from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.metrics import Counter, Distribution, Meter, MetricGroup


def test_metrics_keep_their_counts_and_one_name_is_one_metric():
    group = MetricGroup()
    counter = group.counter("c")
    counter.inc()
    counter.inc(4)
    counter.dec(2)
    assert isinstance(counter, Counter) and counter.get_count() == 3
    assert group.counter("c") is counter
    meter = group.meter("m", 5)
    meter.mark_event()
    meter.mark_event(3)
    assert isinstance(meter, Meter) and meter.get_count() == 4 and meter.time_span_in_seconds == 5
    values = [4, -1, 9, 2]
    distribution = group.distribution("d")
    for v in values:
        distribution.update(v)
    assert isinstance(distribution, Distribution)
    assert (distribution.count, distribution.sum, distribution.min, distribution.max) == (4, 14, -1, 9)
    assert group.gauge("g", lambda: 7)() == 7
    assert group.add_group("sub", "x") is group.add_group("sub", "x")


def test_a_function_counts_every_record_of_its_instance():
    records = [(f"k{i % 5}", i) for i in range(200)]

    class CountSoFar(KeyedProcessFunction):
        def open(self, runtime_context):
            self.seen = runtime_context.get_metrics_group().add_group("records").counter("seen")

        def process_element(self, value, ctx):
            self.seen.inc()
            yield self.seen.get_count()

    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    stream = env.from_collection(records, Types.TUPLE([Types.STRING(), Types.LONG()]))
    counts = list(stream.key_by(lambda r: r[0]).process(CountSoFar(), Types.LONG()).execute_and_collect())
    assert sorted(counts) == list(range(1, len(records) + 1))
