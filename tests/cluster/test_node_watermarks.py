"""A node's view of an event-time channel's writers (cluster.node_watermarks.WriterWatermarks):
the minimum over the live ones, with a forward's placeholders (cluster.forward_ends) holding time
back until the instance they stand for speaks."""

from __future__ import annotations

from stretch.cluster.node_watermarks import WriterWatermarks
from stretch.cluster.writer_clock import CarriedClock
from stretch.runtime.event_time import MIN_WATERMARK


def test_a_placeholder_holds_time_back_until_its_instance_speaks_and_never_again():
    w = WriterWatermarks()
    assert w.observe("node-0/1", MIN_WATERMARK) == []
    assert w.observe("node-1/1", MIN_WATERMARK) == []
    clock = CarriedClock("node-0/1#a")
    assert clock.replaces == "node-0/1"
    assert w.observe(**_args(clock.advance(100))) == []  # node-1's instance has not spoken
    assert w.observe(**_args(CarriedClock("node-1/1#b").advance(80))) == [80]
    assert w.observe("node-1/1", MIN_WATERMARK) == []  # a late announcement changes nothing
    assert w.marks_now() == []
    assert w.observe(**_args(clock.advance(150))) == []
    assert w.observe(**_args(CarriedClock("node-1/1#b").closing())) == [150]  # gone for good


def test_a_later_run_of_an_instance_is_a_split_of_its_own():
    w = WriterWatermarks()
    first = CarriedClock("node-0/2#a")
    assert w.observe(**_args(first.advance(10))) == [10]
    assert w.observe(**_args(first.closing())) == [None]  # nothing holds time back: idle
    again = CarriedClock("node-0/2#b")  # rescaled back up: the same instance number runs again
    assert w.observe(**_args(again.advance(5))) == [10]  # active again, never back in time
    assert w.marks == {"node-0/2#a": 10, "node-0/2#b": 5}
    assert w.observe(**_args(again.advance(30))) == [30]


def _args(progress: dict) -> dict:
    return {
        "writer": progress["writer"],
        "watermark": progress["watermark"],
        "active": progress.get("active", True),
        "closed": progress.get("closed", False),
        "replaces": progress.get("replaces"),
    }
