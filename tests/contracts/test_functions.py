"""The function bases are subscriptable, as PyFlink's (typing.Generic), and still plain bases."""

from stretch.datastream import ProcessWindowFunction, WindowFunction
from stretch.datastream.functions import AggregateFunction, KeyedProcessFunction, MapFunction
from stretch.datastream.window import CountWindow, TimeWindow


class Describe(ProcessWindowFunction[tuple, str, str, TimeWindow]):
    def process(self, key: str, context: ProcessWindowFunction.Context[TimeWindow], elements):
        return [f"{key}:{len(list(elements))}"]


class Sum(WindowFunction[tuple, int, str, CountWindow]):
    def apply(self, key, window, inputs):
        return [sum(inputs)]


def test_generic_subclasses_are_functions():
    assert Describe().process("k", None, [1, 2]) == ["k:2"]
    assert Sum().apply("k", CountWindow(0), [1, 2]) == [3]
    assert isinstance(Describe(), ProcessWindowFunction)
    for base in (
        MapFunction[int, str],
        AggregateFunction[int, int, float],
        KeyedProcessFunction[str, int, int],
    ):
        assert base.__origin__ in (MapFunction, AggregateFunction, KeyedProcessFunction)
