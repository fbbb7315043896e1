"""Watermark generation at a producer: Flink's bounded out-of-orderness rule, and rounds."""

from __future__ import annotations

import random

import numpy as np

from stretch.common import Duration, WatermarkStrategy
from stretch.runtime.event_time import MIN_WATERMARK, WatermarkGenerator


def _generator(delay_ms: int) -> WatermarkGenerator:
    return WatermarkGenerator(WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(delay_ms)))


def test_without_rounds_the_watermark_follows_the_largest_timestamp_seen():
    g = _generator(10)
    assert g.on_timestamps(np.array([100, 50])) == 89
    assert g.on_timestamps(np.array([60])) is None  # no advance
    assert g.on_timestamps(np.array([200])) == 189


def test_a_rounds_timestamps_count_only_once_the_next_round_begins():
    """A model: the watermark after each batch is the largest timestamp of the rounds before the
    current one (or of every batch without a round), minus the delay."""
    rng = random.Random(7)
    g = _generator(5)
    released, current, current_max = MIN_WATERMARK, None, MIN_WATERMARK
    emitted = MIN_WATERMARK
    for step in range(300):
        rnd = None if rng.random() < 0.2 else f"q/{step // 4}"
        ts = np.array([rng.randrange(0, 10_000) for _ in range(rng.randrange(1, 5))])
        if rnd != current:
            released, current, current_max = max(released, current_max), rnd, MIN_WATERMARK
        if rnd is None:
            released = max(released, int(ts.max()))
        else:
            current_max = max(current_max, int(ts.max()))
        want = released - 6 if released > MIN_WATERMARK else MIN_WATERMARK
        got = g.on_timestamps(ts, rnd)
        if want > emitted:
            assert got == want
            emitted = want
        else:
            assert got is None
