"""Plain-Python models of Flink's join semantics, the references for the join tests.

Input is a list of batches of ``(side, key, timestamp, value)`` records. The engine's gate sees a
batch's left records, then its right ones (the job splits one source into two filtered
branches), then the watermark: the maximum timestamp so far - delay - 1. At the end the watermark
jumps to the maximum. The models process records in that order.
"""

from __future__ import annotations

from tests.datastream.flink_windows import MAX, MIN, run


def gate_order(batches):
    """Each batch as the gate holds it: its left records, then its right records, tagged."""
    return [[(0, r) for r in b if r[0] == 0] + [(1, r) for r in b if r[0] == 1] for b in batches]


def window_join(batches, join, delay, lateness=0, assign=None, gap_of=None):
    """Flink's window join: per key and window firing, join(l, r) for each left l, each right r.

    Returns (key, window start, window end, outputs) per firing, in firing order.
    """
    fired, _ = run(
        gate_order(batches),
        key_of=lambda t: t[1][1],
        ts_of=lambda t: t[1][2],
        assign=assign,
        result=list,
        delay=delay,
        lateness=lateness,
        gap_of=(lambda t: gap_of(t[1])) if gap_of else None,
    )
    out = []
    for k, s, e, tagged in fired:
        lefts = [r for side, r in tagged if side == 0]
        rights = [r for side, r in tagged if side == 1]
        out.append((k, s, e, [join(a, b) for a in lefts for b in rights]))
    return out


def co_group(batches, co_group_fn, delay, assign=None, gap_of=None):
    fired, _ = run(
        gate_order(batches),
        key_of=lambda t: t[1][1],
        ts_of=lambda t: t[1][2],
        assign=assign,
        result=list,
        delay=delay,
        gap_of=(lambda t: gap_of(t[1])) if gap_of else None,
    )
    out = []
    for k, s, e, tagged in fired:
        lefts = [r for side, r in tagged if side == 0]
        rights = [r for side, r in tagged if side == 1]
        out.append((k, s, e, list(co_group_fn(lefts, rights))))
    return out


def _watermarks(batches, delay):
    """Each batch in gate order, the watermark in force while it is processed, and the one after."""
    wm, max_ts = MIN, MIN
    for b in batches:
        before = wm
        max_ts = max([max_ts] + [r[2] for r in b])
        new = max_ts - delay - 1 if max_ts > MIN else MIN
        wm = max(wm, new)
        yield gate_order([b])[0], before, wm


def interval_join(batches, lower, upper, delay):
    """Flink's IntervalJoinOperator with inclusive bounds (exclusive ones are moved by 1 ms first).

    Records join with records of the other side with the same key (field 1). Returns (pairs as
    (left, right, output timestamp), late left records, late right records).
    """
    buffers = ([], [])  # per side: (timestamp, record)
    pairs, late = [], ([], [])

    def cleanup_time(side, ts):
        hi = upper if side == 0 else -lower
        return ts + hi if hi > 0 else ts

    def expire(wm):
        for side in (0, 1):
            buffers[side][:] = [(t, r) for t, r in buffers[side] if cleanup_time(side, t) > wm]

    for batch, wm, after in _watermarks(batches, delay):
        for side, r in batch:
            ts = r[2]
            if wm != MIN and ts < wm:
                late[side].append(r)
                continue
            buffers[side].append((ts, r))
            lo, hi = (lower, upper) if side == 0 else (-upper, -lower)
            for t, other in buffers[1 - side]:
                if other[1] == r[1] and ts + lo <= t <= ts + hi:
                    left, right = (r, other) if side == 0 else (other, r)
                    pairs.append((left, right, max(ts, t)))
        expire(after)
    expire(MAX)
    return pairs, late[0], late[1]


def band_join(batches, bound, predicate, delay):
    """Every pair of non-late left/right records at most ``bound`` apart satisfying ``predicate``,
    as (left, right, output timestamp); and the records buffered after each batch."""
    buffers = ([], [])
    pairs, buffered = [], []
    for batch, wm, after in _watermarks(batches, delay):
        for side, r in batch:
            ts = r[2]
            if wm != MIN and ts < wm:
                continue
            for t, other in buffers[1 - side]:
                left, right = (r, other) if side == 0 else (other, r)
                if abs(ts - t) <= bound and predicate(left, right):
                    pairs.append((left, right, max(ts, t)))
            buffers[side].append((ts, r))
        for side in (0, 1):
            buffers[side][:] = [(t, r) for t, r in buffers[side] if t >= after - bound]
        buffered.append(sorted(r for s in buffers for _, r in s))
    return pairs, buffered
