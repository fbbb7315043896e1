"""The UI's charts and event log, from statuses as a job answers them, against a plain model."""

from __future__ import annotations

import random

import pytest

from stretch.ui.history import History, instance_busy, sample_of, series


def status(t_ns_busy: list[int], records_in: int, records_out: int, depth: int, name="op") -> dict:
    return {
        "operators": [
            {
                "name": name,
                "parallelism": len(t_ns_busy),
                "records_in": records_in,
                "records_out": records_out,
                "gate_depth": depth,
                "instances": [{"index": i, "busy_ns": b} for i, b in enumerate(t_ns_busy)],
            }
        ],
        "rescales": [],
        "updates": [],
        "checkpoints": None,
    }


def test_rates_busy_and_backlog_wait_follow_the_counters():
    rng = random.Random(7)
    t, rin, rout, busy = 1000.0, 0, 0, [0, 0]
    statuses = []
    for _ in range(30):
        statuses.append((t, status(list(busy), rin, rout, depth := rng.randrange(0, 5000))))
        dt = rng.uniform(0.5, 1.5)
        t += dt
        rin += rng.randrange(0, 100_000)
        rout += rng.randrange(0, 1000)
        busy = [b + rng.randrange(0, int(dt * 1e9)) for b in busy]
    samples = [sample_of(s, at) for at, s in statuses]
    got = series(samples)
    op = got["operators"]["op"]
    for i in range(1, len(statuses)):
        (t0, a), (t1, b) = statuses[i - 1], statuses[i]
        a_op, b_op = a["operators"][0], b["operators"][0]
        dt = t1 - t0
        rate_in = (b_op["records_in"] - a_op["records_in"]) / dt
        assert got["t"][i - 1] == t1
        assert op["rate_in"][i - 1] == pytest.approx(rate_in)
        assert op["rate_out"][i - 1] == pytest.approx((b_op["records_out"] - a_op["records_out"]) / dt)
        busy_s = sum(y["busy_ns"] - x["busy_ns"] for x, y in zip(a_op["instances"], b_op["instances"])) / 1e9
        assert op["busy"][i - 1] == pytest.approx(busy_s / (2 * dt))
        depth = b_op["gate_depth"]
        expected_wait = 0.0 if depth == 0 else (depth / rate_in if rate_in else None)
        assert op["wait_s"][i - 1] == (pytest.approx(expected_wait) if expected_wait is not None else None)
    # what the chart integrates back: the records read between the first and the last sample
    total = sum(r * (t1 - t0) for r, t0, t1 in zip(op["rate_in"], [statuses[0][0], *got["t"]], got["t"]))
    assert total == pytest.approx(statuses[-1][1]["operators"][0]["records_in"])


def test_an_operator_that_appears_later_has_gaps_not_shifted_values():
    a = sample_of(status([0], 0, 0, 0, name="a"), 0.0)
    b = sample_of(
        {
            "operators": status([0], 10, 0, 0, name="a")["operators"]
            + status([0], 5, 0, 0, name="b")["operators"]
        },
        1.0,
    )
    c = sample_of(
        {
            "operators": status([0], 20, 0, 0, name="a")["operators"]
            + status([0], 25, 0, 0, name="b")["operators"]
        },
        2.0,
    )
    got = series([a, b, c])
    assert got["operators"]["a"]["rate_in"] == [10.0, 10.0]
    assert got["operators"]["b"]["rate_in"] == [None, 20.0]
    assert got["operators"]["b"]["parallelism"] == [1, 1]


def test_instance_busy_is_each_instances_share_of_the_elapsed_time():
    before, now = status([0, 5 * 10**8], 0, 0, 0), status([2 * 10**8, 5 * 10**8 + 10**9], 0, 0, 0)
    now["operators"][0]["instances"].append({"index": 2, "busy_ns": 3 * 10**8})  # new since: from now
    assert instance_busy(before, now, 1.0) == {"op": [pytest.approx(0.2), 1.0, 0.0]}


class Source:
    is_cluster = False

    def __init__(self, statuses):
        self.calls = iter(statuses)

    def statuses(self):
        return next(self.calls)

    def close(self):
        pass


def test_the_event_log_has_each_rescale_update_and_checkpoint_once_in_order():
    base = status([0], 0, 0, 0)
    rescale = {"operator": "op", "old_parallelism": 1, "new_parallelism": 3, "elapsed_ms": 2.5}
    update = {"operator": "op", "version": 1, "elapsed_ms": 7.0}
    ck = {"interval_ms": 100, "completed": 1, "failed": 0, "last_error": None}
    seen = [
        {"j": {**base, "rescales": [rescale], "checkpoints": {**ck, "latest": None}}},  # one before the UI
        {
            "j": {
                **base,
                "rescales": [rescale],
                "checkpoints": {**ck, "latest": {"id": 1, "duration_ms": 3, "bytes": 10}},
            }
        },
        {
            "j": {
                **base,
                "rescales": [rescale, rescale],
                "updates": [update],
                "checkpoints": {**ck, "latest": {"id": 1, "duration_ms": 3, "bytes": 10}},
            }
        },
        {
            "j": {
                **base,
                "rescales": [rescale, rescale],
                "updates": [update],
                "checkpoints": {
                    **ck,
                    "failed": 1,
                    "last_error": "disk full",
                    "latest": {"id": 2, "duration_ms": 4, "bytes": 10},
                },
            }
        },
    ]
    history = History([Source(seen)])
    for _ in seen:
        history.poll()
    events = list(history.jobs["0:j"].events)
    assert [(e["kind"], e["t"] is None) for e in events] == [
        ("rescale", True),
        ("checkpoint", False),
        ("rescale", False),
        ("update", False),
        ("checkpoint", False),
        ("checkpoint failed", False),
    ]
    assert events[0]["text"] == "rescaled 'op' 1 -> 3 in 2.5 ms"
    assert events[-1]["text"] == "disk full"
    assert len(history.jobs["0:j"].samples) == 4
