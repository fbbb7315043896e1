"""The built-in time triggers can merge, as Flink's: a merged window's timer is registered unless
its time has already passed."""

from stretch.contracts.triggers import EventTimeTrigger, ProcessingTimeTrigger, Trigger
from stretch.contracts.window import TimeWindow


class Clock(Trigger.OnMergeContext):
    def __init__(self, now: int):
        self.now, self.event, self.processing = now, [], []

    def get_current_processing_time(self):
        return self.now

    def get_current_watermark(self):
        return self.now

    def register_event_time_timer(self, time):
        self.event.append(time)

    def register_processing_time_timer(self, time):
        self.processing.append(time)

    def delete_event_time_timer(self, time):
        self.event.remove(time)

    def delete_processing_time_timer(self, time):
        self.processing.remove(time)

    def get_partitioned_state(self, state_descriptor):
        raise AssertionError("time triggers keep no state")

    def merge_partitioned_state(self, state_descriptor):
        raise AssertionError("time triggers keep no state")


def test_time_triggers_register_the_merged_windows_end_unless_it_has_passed():
    window = TimeWindow(10, 20)  # max timestamp 19
    for trigger, timers in (
        (EventTimeTrigger.create(), "event"),
        (ProcessingTimeTrigger.create(), "processing"),
    ):
        assert trigger.can_merge()
        for now, expected in ((5, [19]), (18, [19]), (19, []), (30, [])):
            clock = Clock(now)
            trigger.on_merge(window, clock)
            assert getattr(clock, timers) == expected
