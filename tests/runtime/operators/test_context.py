"""What a function's runtime context tells it: the job's global parameters, in every kind of task."""

from __future__ import annotations

from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, MapFunction, StreamExecutionEnvironment


class Scale(MapFunction):
    def open(self, runtime_context):
        self.factor = int(runtime_context.get_job_parameter("factor", "1"))

    def map(self, value):
        return value * self.factor


class Offset(KeyedProcessFunction):
    def open(self, runtime_context):
        self.offset = int(runtime_context.get_job_parameter("offset", "0"))
        self.missing = runtime_context.get_job_parameter("missing", "default")

    def process_element(self, value, ctx):
        yield f"{value + self.offset}:{self.missing}"


def test_global_job_parameters_reach_chained_and_keyed_functions():
    values = list(range(50))
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.get_config().set_global_job_parameters({"factor": 10, "offset": "3"})
    stream = env.from_collection(values, Types.LONG()).map(Scale(), Types.LONG())
    keyed = stream.key_by(lambda v: v % 5).process(Offset(), Types.STRING())
    with keyed.execute_and_collect() as results:
        got = sorted(results)
    assert got == sorted(f"{v * 10 + 3}:default" for v in values)
