"""The frontier handshake: readers in several processes and a coordinator placing epochs at random
moments; every reader switches exactly at each epoch's position, never having read past it, and
readers kept ahead of a slower one by its pace never deadlock."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from stretch.runtime import control_block as cbk
from stretch.runtime import frontier
from stretch.runtime.control_block import ControlBlock

OP, READERS, END = 0, 3, 400_000


def _read(name: str, index: int, seed: int, out: str) -> None:
    """A reader: pieces of random size, each claimed first; at an epoch's position it switches."""
    cb = ControlBlock.attach(name, 1, 128)
    rng = random.Random(seed)
    f = frontier.Frontier(cb, OP, index, epoch=0)
    here, switches, read_under = 0, {}, {0: 0}  # epoch -> where it switched; -> furthest read under it
    while here < END:
        end = min(END, here + rng.randrange(1, 1000))
        limit = f.keep_up(here, READERS, lambda: None)
        if limit is not None:
            end = min(end, limit)
        position = f.claim(end, lambda: None)
        if position == here:  # the next epoch applies here
            f.epoch += 1
            cb.announce(OP, index, cbk.I_EPOCH, f.epoch)
            f.passed(READERS)  # it reads on only as far as readers still before the position
            switches[f.epoch] = here
            read_under[f.epoch] = here
            continue
        if position is not None:
            end = min(end, position)
        assert end > here
        if rng.random() < 0.5:
            time.sleep(rng.random() * 0.004)  # readers drift apart
        f.publish_rate(rng.choice((50.0, 200.0)))
        read_under[f.epoch] = end
        here = end
    with open(out, "w") as file:
        json.dump({"switches": switches, "read_under": read_under}, file)


def test_readers_switch_exactly_at_each_placed_position(shm_prefix, forked, tmp_path):
    cb = ControlBlock.create(shm_prefix, 1, 128)
    try:
        outs = [str(tmp_path / f"{i}.json") for i in range(READERS)]
        procs = [forked.start(_read, cb.segment.name, i, 100 + i, outs[i]) for i in range(READERS)]
        rng = random.Random(7)
        placed = {0: 0}
        epoch = 0
        while any(p.is_alive() for p in procs) and epoch < 150:
            time.sleep(rng.random() * 0.004)
            behind = min(int(cb.instances(OP)[i, cbk.I_EPOCH]) for i in range(READERS))
            if epoch + 1 - behind >= cbk.TABLE_RING:  # as the coordinator: the ring holds 8 epochs
                continue
            epoch += 1
            position = frontier.place(cb, OP, epoch, range(READERS), floor=placed[epoch - 1])
            if position >= END:  # a reader finished: nothing left that every reader has yet to read
                frontier.withdraw(cb, OP, epoch)
                break
            table = cb.table(OP, epoch - 1).copy()
            cb.publish(OP, epoch, table, 0, position)
            placed[epoch] = position
        forked.join(timeout=60)
        assert len(placed) > 40, "too few epochs were placed while the readers read"
        for out in outs:
            got = json.loads(Path(out).read_text())
            switches = {int(e): p for e, p in got["switches"].items()}
            read_under = {int(e): p for e, p in got["read_under"].items()}
            assert switches == {e: p for e, p in placed.items() if e > 0}
            for e, p in placed.items():  # nothing read under an epoch at or past the next one's position
                if e + 1 in placed:
                    assert read_under[e] <= placed[e + 1]
    finally:
        cb.close()


def test_pace_is_the_share_of_an_instances_own_rows_and_maps_back_to_positions(shm_prefix):
    """Two instances that read a batch laid out by key group, each its own run, have the same pace
    when each has read the same share of its run, though a run apart in positions; ``position_at``
    inverts ``pace`` within the entry; outside the entry, and for rows not in runs, pace is the
    position."""
    cb = ControlBlock.create(shm_prefix, 1, 128)
    try:
        start, n = 1000, 400
        first = frontier.Frontier(cb, OP, 0, epoch=0)
        second = frontier.Frontier(cb, OP, 1, epoch=0)
        first.reading(start, n, [(0, 100)])  # rows 0..99 of the entry are its own
        second.reading(start, n, [(100, 160), (300, 400)])  # two runs, 160 rows
        for share in (0.0, 0.25, 0.5, 0.75):
            a, k = start + round(100 * share), round(160 * share)  # k of the second's 160 rows
            b = start + (100 + k if k < 60 else 300 + k - 60)
            assert first.pace(a) == second.pace(b) == start + round(n * share)
        for f in (first, second):
            paces = [f.pace(p) for p in range(start, start + n)]
            assert paces == sorted(paces) and paces[0] == start
            for p in range(start, start + n):  # the furthest position not past a pace is at least p
                assert f.pace(f.position_at(f.pace(p))) == f.pace(p)
            assert f.pace(start + n) == start + n and f.pace(start - 5) == start - 5
        nothing = frontier.Frontier(cb, OP, 2, epoch=0)
        nothing.reading(start, n, [])  # no rows of its own: done with the entry at once
        assert nothing.pace(start) == start + n
        scattered = frontier.Frontier(cb, OP, 3, epoch=0)
        scattered.reading(start, n, None)
        assert [scattered.pace(p) for p in (start, start + 7)] == [start, start + 7]
        assert scattered.position_at(start + 7) == start + 7
    finally:
        cb.close()


def test_an_instance_past_an_epochs_position_reads_no_further_than_one_still_before_it(shm_prefix):
    """Within an epoch an instance may lead a slower one by ``lead_ns`` of the slower one's work;
    once past the next epoch's position, not at all while the other is still before it (also one
    that retires there), and freely again once every instance of the previous epoch has passed."""
    cb = ControlBlock.create(shm_prefix, 1, 128)
    try:
        ahead, behind = frontier.Frontier(cb, OP, 0, epoch=0), frontier.Frontier(cb, OP, 1, epoch=0)
        for f in (ahead, behind):
            f.publish_rate(100.0)  # ns per position
        assert behind.claim(1_000, lambda: None) is None
        lead = ahead.lead_ns // 100
        assert ahead.lead_limit(5_000, 2) == 1_000 + lead
        ahead.epoch = 1
        cb.announce(OP, 0, cbk.I_EPOCH, 1)
        ahead.passed(2)
        assert ahead.lead_limit(5_000, 2) == 1_000
        assert ahead.paced(1) and ahead.lead_limit(5_000, 1) == 1_000  # the new epoch without it
        assert ahead.lead_limit(800, 1) is None  # not ahead of it
        cb.announce(OP, 1, cbk.I_EPOCH, 1)  # it reached the position, and retired there
        assert ahead.lead_limit(5_000, 1) is None and not ahead.paced(1)
        assert ahead.lead_limit(5_000, 2) == 1_000 + lead  # one that stays: the lead again
    finally:
        cb.close()
