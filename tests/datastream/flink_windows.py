"""A plain-Python model of Flink's event-time window semantics, the reference for the window tests.

Input arrives in batches; the watermark (bounded out-of-orderness: max timestamp - delay - 1)
advances after each batch, as stretch's sources emit it, and jumps to the maximum at the end.
A window fires once when the watermark passes its end - 1; with allowed lateness it is kept that
much longer and every late record for it fires it again at once; records whose windows are all
beyond the lateness are late (the side output).
"""

from __future__ import annotations

MAX = 2**63 - 1
MIN = -(2**63)


def tumbling(size):
    return lambda ts: [(ts - (ts % size + size) % size, ts - (ts % size + size) % size + size)]


def sliding(size, slide):
    def assign(ts):
        last = ts - (ts % slide + slide) % slide
        return [(s, s + size) for s in range(last, ts - size, -slide)]

    return assign


def run(batches, key_of, ts_of, assign=None, result=list, delay=0, lateness=0, gap_of=None):
    """Fired windows as (key, start, end, result(records)) in firing order, and the late records."""
    windows: dict = {}  # key -> {(start, end): [records]}
    fired, late = [], []
    wm = MIN
    max_ts = MIN

    def advance(new_wm):
        due = sorted((w[1] - 1, k, w) for k, ws in windows.items() for w in ws if wm < w[1] - 1 <= new_wm)
        for _, k, w in due:
            fired.append((k, w[0], w[1], result(windows[k][w])))
        for ws in windows.values():
            for w in [w for w in ws if w[1] - 1 + lateness <= new_wm]:
                del ws[w]

    for batch in batches:
        for r in batch:
            k, ts = key_of(r), ts_of(r)
            max_ts = max(max_ts, ts)
            ws = windows.setdefault(k, {})
            if gap_of is not None:  # merge with every overlapping session first, then judge lateness
                merged, records = (ts, ts + gap_of(r)), [r]
                for w in sorted(ws):
                    if w[0] <= merged[1] and w[1] >= merged[0]:
                        merged = (min(w[0], merged[0]), max(w[1], merged[1]))
                        records = ws.pop(w) + records
                if merged[1] - 1 + lateness <= wm:
                    late.append(r)
                    continue
                ws[merged] = records
                if merged[1] - 1 <= wm:
                    fired.append((k, merged[0], merged[1], result(records)))
                continue
            live = False
            for w in assign(ts):
                if w[1] - 1 + lateness <= wm:
                    continue
                live = True
                ws.setdefault(w, []).append(r)
                if w[1] - 1 <= wm:
                    fired.append((k, w[0], w[1], result(ws[w])))
            if not live:
                late.append(r)
        new_wm = max_ts - delay - 1 if max_ts > MIN else MIN
        if new_wm > wm:
            advance(new_wm)
            wm = new_wm
    advance(MAX)
    return fired, late


def by_key(outputs):
    d: dict = {}
    for o in outputs:
        d.setdefault(o[0], []).append(o)
    return d
