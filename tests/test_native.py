"""stretch._native.Region: atomics, futex wait/wake and the robust mutex, across real processes.

Every cross-process test forks helpers that share one POSIX shared-memory segment (the mapping is
inherited, as workers forked by the zygote inherit theirs) and reports results through words of
that segment, so that the test process checks them after joining the helpers.
"""

from __future__ import annotations

import mmap
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest

from stretch._native import Region
from stretch._shm import Segment

SIZE = 1 << 16
WAITERS_BIT = 0x80000000

# Word offsets used by the tests (each on its own cache line).
COUNTER = 0
LOCK = 64
INSIDE = 128
VIOLATIONS = 192
READY = 256
WORD = 320
RESULTS = 1024  # per-process result words: RESULTS + 64 * i
TICKETS = 8192  # one byte per ticket handed out by fetch_add64


@pytest.fixture
def seg(shm_prefix):
    s = Segment.create(shm_prefix, "native", SIZE)
    yield s
    s.close()


def _await(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def _owner(word: int) -> int:
    return word & ~WAITERS_BIT


# ---- single-process semantics ---------------------------------------------------------------


def test_load_store_and_fetch_add_semantics(seg):
    r = seg.region
    assert r.size == SIZE
    assert r.address != 0
    for v in (0, 1, -1, 2**63 - 1, -(2**63), 123456789012345):
        r.store64(COUNTER, v)
        assert r.load64(COUNTER) == v
    r.store64(COUNTER, 10)
    assert r.fetch_add64(COUNTER, 5) == 10
    assert r.fetch_add64(COUNTER, -20) == 15
    assert r.load64(COUNTER) == -5

    for v in (0, 1, 0xFFFFFFFF, 0x80000000):
        r.store32(WORD, v)
        assert r.load32(WORD) == v
    r.store32(WORD, 5)
    assert r.fetch_add32(WORD, 0xFFFFFFFF) == 5  # adding 2**32 - 1 is how the gate decrements
    assert r.load32(WORD) == 4
    r.store32(WORD, 0xFFFFFFFF)
    assert r.fetch_add32(WORD, 1) == 0xFFFFFFFF
    assert r.load32(WORD) == 0  # unsigned 32-bit wrap-around


def test_max64_raises_to_at_least_and_returns_result(seg):
    r = seg.region
    r.store64(COUNTER, 5)
    assert r.max64(COUNTER, 3) == 5
    assert r.load64(COUNTER) == 5
    assert r.max64(COUNTER, 9) == 9
    assert r.load64(COUNTER) == 9
    r.store64(COUNTER, -100)
    assert r.max64(COUNTER, -200) == -100
    assert r.max64(COUNTER, -50) == -50
    assert r.load64(COUNTER) == -50


def test_cas64_semantics(seg):
    r = seg.region
    r.store64(COUNTER, 5)
    assert r.cas64(COUNTER, 4, 9) is False
    assert r.load64(COUNTER) == 5  # a failed CAS writes nothing
    assert r.cas64(COUNTER, 5, 9) is True
    assert r.load64(COUNTER) == 9
    assert r.cas64(COUNTER, 5, 11) is False  # the old expected value no longer matches
    assert r.cas64(COUNTER, 9, -(2**63)) is True
    assert r.load64(COUNTER) == -(2**63)
    assert r.cas64(COUNTER, -(2**63), 2**63 - 1) is True
    assert r.load64(COUNTER) == 2**63 - 1
    assert r.cas64(COUNTER, 2**63 - 1, 2**63 - 1) is True  # same value: succeeds, unchanged
    assert r.load64(COUNTER) == 2**63 - 1


_BAD_OFFSETS = [
    ("load64", lambda r, o: r.load64(o), 8),
    ("store64", lambda r, o: r.store64(o, 1), 8),
    ("fetch_add64", lambda r, o: r.fetch_add64(o, 1), 8),
    ("cas64", lambda r, o: r.cas64(o, 0, 1), 8),
    ("max64", lambda r, o: r.max64(o, 1), 8),
    ("load32", lambda r, o: r.load32(o), 4),
    ("store32", lambda r, o: r.store32(o, 1), 4),
    ("fetch_add32", lambda r, o: r.fetch_add32(o, 1), 4),
    ("wait32", lambda r, o: r.wait32(o, 12345, 0.0), 4),
    ("wake32", lambda r, o: r.wake32(o), 4),
    ("lock", lambda r, o: r.lock(o, 0.0), 4),
    ("unlock", lambda r, o: r.unlock(o), 4),
]


@pytest.mark.parametrize(("name", "call", "width"), _BAD_OFFSETS, ids=[b[0] for b in _BAD_OFFSETS])
def test_out_of_bounds_and_misaligned_offsets_are_rejected(seg, name, call, width):
    r = seg.region
    for off in (-1, -width, SIZE, SIZE - width + 1, SIZE + width, 2**62):
        with pytest.raises(IndexError, match="out of range"):
            call(r, off)
    for off in (1, width // 2, width + 1, SIZE - 2 * width + 1):
        with pytest.raises(ValueError, match="not aligned"):
            call(r, off)
    # The last aligned word is in range (lock/unlock leave it free again).
    if name == "unlock":
        r.lock(SIZE - width)
    call(r, SIZE - width)
    if name == "lock":
        r.unlock(SIZE - width)


def test_released_region_and_read_only_buffer():
    m = mmap.mmap(-1, 4096)
    r = Region(m)
    r.store64(0, 7)
    assert r.load64(0) == 7
    r.release()
    with pytest.raises(ValueError, match="released"):
        r.load64(0)
    with pytest.raises(ValueError, match="released"):
        r.lock(0)
    assert r.size == 0
    m.close()  # the region no longer pins the buffer
    with pytest.raises((TypeError, BufferError)):
        Region(b"\0" * 64)


# ---- atomics across processes -------------------------------------------------------------


def test_fetch_add64_from_many_processes_is_exact(seg, forked):
    n_procs, per_proc = 4, 5000
    r = seg.region
    tickets = seg.bytes[TICKETS : TICKETS + n_procs * per_proc]

    def work():
        for _ in range(per_proc):
            t = r.fetch_add64(COUNTER, 1)
            tickets[t] += 1  # every old value is handed out to exactly one caller
            r.fetch_add32(WORD, 1)

    for _ in range(n_procs):
        forked.start(work)
    forked.join()
    assert r.load64(COUNTER) == n_procs * per_proc
    assert r.load32(WORD) == n_procs * per_proc
    assert np.array_equal(tickets, np.ones(n_procs * per_proc, dtype=np.uint8))


def test_cas64_increments_from_many_processes_are_exact(seg, forked):
    n_procs, per_proc = 4, 3000
    r = seg.region

    def work(i):
        failures = 0
        for _ in range(per_proc):
            while True:
                cur = r.load64(COUNTER)
                if r.cas64(COUNTER, cur, cur + 1):
                    break
                failures += 1
        r.store64(RESULTS + 64 * i, failures)

    for i in range(n_procs):
        forked.start(work, i)
    forked.join()
    assert r.load64(COUNTER) == n_procs * per_proc


def test_max64_from_many_processes_keeps_the_maximum(seg, forked):
    n_procs, per_proc = 4, 3000
    r = seg.region
    r.store64(COUNTER, -(2**63))

    def values(i):
        rng = random.Random(1000 + i)
        return [rng.randrange(-(2**62), 2**62) for _ in range(per_proc)]

    def work(i):
        for v in values(i):
            r.max64(COUNTER, v)

    for i in range(n_procs):
        forked.start(work, i)
    forked.join()
    assert r.load64(COUNTER) == max(max(values(i)) for i in range(n_procs))


# ---- futex wait / wake --------------------------------------------------------------------


def test_wait32_times_out_and_returns_false(seg):
    r = seg.region
    r.store32(WORD, 7)
    t0 = time.monotonic()
    assert r.wait32(WORD, 7, 0.2) is False
    elapsed = time.monotonic() - t0
    assert 0.15 <= elapsed < 2.0
    assert r.wait32(WORD, 7, 0.0) is False


def test_wait32_returns_at_once_when_the_word_differs(seg):
    r = seg.region
    r.store32(WORD, 7)
    t0 = time.monotonic()
    assert r.wait32(WORD, 8, 10.0) is True
    assert time.monotonic() - t0 < 0.5


def test_wake32_without_waiters_wakes_nobody(seg):
    assert seg.region.wake32(WORD) == 0


@pytest.mark.parametrize("n_waiters", [1, 3])
def test_wake32_from_another_process_wakes_waiters_quickly(seg, forked, n_waiters):
    r = seg.region
    timeout = 10.0

    def waiter(i):
        r.fetch_add32(READY, 1)
        ok = r.wait32(WORD, 0, timeout)
        r.store64(RESULTS + 64 * i, time.monotonic_ns())
        r.store64(RESULTS + 64 * i + 8, 1 if ok else 2)
        r.store64(RESULTS + 64 * i + 16, r.load32(WORD))

    for i in range(n_waiters):
        forked.start(waiter, i)
    _await(lambda: r.load32(READY) == n_waiters, what="waiters to start")
    time.sleep(0.2)  # let them reach the futex
    woken_at = time.monotonic_ns()
    r.store32(WORD, 1)
    woken = r.wake32(WORD)
    forked.join(timeout=5)
    assert 0 <= woken <= n_waiters
    for i in range(n_waiters):
        assert r.load64(RESULTS + 64 * i + 8) == 1, "wait32 reported a timeout although it was woken"
        assert r.load64(RESULTS + 64 * i + 16) == 1
        latency = (r.load64(RESULTS + 64 * i) - woken_at) / 1e9
        assert latency < 1.0, f"waiter {i} woke {latency:.3f} s after wake32 (timeout was {timeout} s)"


def test_wake32_wakes_at_most_n(seg, forked):
    r = seg.region
    n_waiters = 3

    def waiter(i):
        r.fetch_add32(READY, 1)
        r.store64(RESULTS + 64 * i, 1 if r.wait32(WORD, 0, 10.0) else 2)

    for i in range(n_waiters):
        forked.start(waiter, i)
    _await(lambda: r.load32(READY) == n_waiters, what="waiters to start")
    time.sleep(0.3)
    # The word is unchanged, so only woken waiters return; wake one, then the rest.
    first = r.wake32(WORD, 1)
    assert first <= 1
    time.sleep(0.3)
    returned = sum(r.load64(RESULTS + 64 * i) != 0 for i in range(n_waiters))
    assert returned == first
    r.store32(WORD, 1)
    r.wake32(WORD)
    forked.join(timeout=5)
    assert all(r.load64(RESULTS + 64 * i) == 1 for i in range(n_waiters))


# ---- robust mutex -------------------------------------------------------------------------


def test_lock_gives_mutual_exclusion_across_processes(seg, forked):
    n_procs, per_proc = 4, 400
    r = seg.region

    def work():
        for _ in range(per_proc):
            assert r.lock(LOCK, 30.0) is True
            if r.fetch_add64(INSIDE, 1) != 0:
                r.fetch_add64(VIOLATIONS, 1)
            v = r.load64(COUNTER)  # a non-atomic read-modify-write, safe only under the lock
            for _ in range(30):
                pass
            r.store64(COUNTER, v + 1)
            r.fetch_add64(INSIDE, -1)
            r.unlock(LOCK)

    t0 = time.monotonic()
    for _ in range(n_procs):
        forked.start(work)
    forked.join(timeout=60)
    assert r.load64(VIOLATIONS) == 0
    assert r.load64(COUNTER) == n_procs * per_proc
    assert r.load32(LOCK) == 0, "the lock word must be free after the last unlock"
    assert time.monotonic() - t0 < 20


def test_lock_and_unlock_in_one_process(seg):
    r = seg.region
    assert r.lock(LOCK) is True
    assert _owner(r.load32(LOCK)) == os.getpid()
    with pytest.raises(RuntimeError, match="already held by this process"):
        r.lock(LOCK, 0.1)
    r.unlock(LOCK)
    assert r.load32(LOCK) == 0
    assert r.lock(LOCK, 0.0) is True  # a free lock is taken even with a zero timeout
    r.unlock(LOCK)


def _hold_lock(r, hold_for=60.0):
    def holder():
        r.lock(LOCK)
        r.store32(READY, 1)
        time.sleep(hold_for)
        r.unlock(LOCK)

    return holder


def test_a_woken_waiter_keeps_the_waiters_bit_for_those_still_asleep(seg, forked):
    """Two processes sleep on a held lock; unlock wakes one. While the other still sleeps, the
    lock word must say so (its waiters bit), or the woken one's unlock wakes nobody and the other
    lies asleep until its 50 ms slice runs out (the stall that rescales of 8 instances hit)."""
    r = seg.region
    assert r.lock(LOCK) is True

    def waiter(i):
        r.store64(RESULTS + 64 * i, 1)  # about to wait
        assert r.lock(LOCK, 30.0) is True
        r.store64(RESULTS + 64 * i + 8, 1)  # holds it
        _await(lambda: r.load64(RESULTS + 64 * i + 16) == 1, what="the release")
        r.unlock(LOCK)

    procs = [forked.start(waiter, i) for i in range(2)]
    _await(lambda: all(r.load64(RESULTS + 64 * i) == 1 for i in range(2)), what="both waiters to start")
    _await(lambda: all(_proc_state(p.pid) == "S" for p in procs), what="both waiters to sleep")
    assert r.load32(LOCK) & WAITERS_BIT
    r.unlock(LOCK)
    _await(lambda: any(r.load64(RESULTS + 64 * i + 8) == 1 for i in range(2)), what="a waiter to take it")
    first = next(i for i in range(2) if r.load64(RESULTS + 64 * i + 8) == 1)
    assert _owner(r.load32(LOCK)) == procs[first].pid
    assert r.load64(RESULTS + 64 * (1 - first) + 8) == 0, "both hold the lock"
    assert r.load32(LOCK) & WAITERS_BIT, "the other waiter sleeps, but the lock word does not say so"
    r.store64(RESULTS + 64 * first + 16, 1)
    _await(lambda: r.load64(RESULTS + 64 * (1 - first) + 8) == 1, what="the second waiter to take it")
    r.store64(RESULTS + 64 * (1 - first) + 16, 1)
    forked.join(procs, timeout=10)
    assert r.load32(LOCK) == 0


def test_lock_times_out_while_another_process_holds_it(seg, forked):
    r = seg.region
    p = forked.start(_hold_lock(r))
    _await(lambda: r.load32(READY) == 1, what="the holder to take the lock")
    t0 = time.monotonic()
    assert r.lock(LOCK, 0.3) is False
    assert 0.25 <= time.monotonic() - t0 < 3.0
    assert _owner(r.load32(LOCK)) == p.pid


def test_unlock_by_a_non_owner_raises(seg, forked):
    r = seg.region
    with pytest.raises(RuntimeError, match="not held by this process"):
        r.unlock(LOCK)  # free lock
    forked.start(_hold_lock(r))
    _await(lambda: r.load32(READY) == 1, what="the holder to take the lock")
    with pytest.raises(RuntimeError, match="not held by this process"):
        r.unlock(LOCK)


def test_failed_unlock_by_a_non_owner_leaves_the_lock_held(seg, forked):
    r = seg.region
    p = forked.start(_hold_lock(r))
    _await(lambda: r.load32(READY) == 1, what="the holder to take the lock")
    with pytest.raises(RuntimeError):
        r.unlock(LOCK)
    assert _owner(r.load32(LOCK)) == p.pid, "a rejected unlock must not release the owner's lock"
    assert r.lock(LOCK, 0.2) is False, "the lock is still held by a live process"


def test_lock_is_taken_over_when_the_owner_is_sigkilled(seg, forked):
    """A waiter blocked in lock() gets the lock soon after its owner dies holding it."""
    r = seg.region
    owner = forked.start(_hold_lock(r))
    _await(lambda: r.load32(READY) == 1, what="the owner to take the lock")

    def waiter():
        r.store32(WORD, 1)
        got = r.lock(LOCK, 20.0)
        r.store64(RESULTS, time.monotonic_ns())
        r.store64(RESULTS + 8, 1 if got else 2)
        if got:
            r.store64(COUNTER, r.load64(COUNTER) + 1)
            r.unlock(LOCK)

    w = forked.start(waiter)
    _await(lambda: r.load32(WORD) == 1, what="the waiter to start")
    time.sleep(0.2)
    assert r.load64(RESULTS + 8) == 0, "the waiter must be blocked while the owner lives"
    owner.kill()
    owner.join()
    killed_at = time.monotonic_ns()
    forked.join([w], timeout=20)
    assert r.load64(RESULTS + 8) == 1, "the waiter did not take over the lock of the dead owner"
    assert (r.load64(RESULTS) - killed_at) / 1e9 < 2.0
    assert r.load64(COUNTER) == 1
    # The lock works normally afterwards.
    assert r.lock(LOCK, 1.0) is True
    assert _owner(r.load32(LOCK)) == os.getpid()
    r.unlock(LOCK)
    assert r.lock(LOCK, 0.0) is True
    r.unlock(LOCK)


def test_lock_is_taken_over_by_the_parent_of_a_killed_owner_before_reaping_it(seg, forked):
    """A process that died is dead even while it is a zombie its parent has not reaped yet.

    Here the waiter is that parent: while it waits in lock(), it cannot reap the dead owner, so a
    liveness check that counts zombies as alive never lets it take the lock over.
    """
    r = seg.region
    owner = forked.start(_hold_lock(r))
    _await(lambda: r.load32(READY) == 1, what="the owner to take the lock")
    os.kill(owner.pid, 9)
    _await(lambda: _proc_state(owner.pid) == "Z", what="the owner to die")
    try:
        assert r.lock(LOCK, 2.0) is True, "the lock of a dead (unreaped) owner was not taken over"
        r.unlock(LOCK)
    finally:
        owner.join()


def _proc_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rfind(")") + 2]
