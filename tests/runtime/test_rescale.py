"""Live rescale: random schedules under load and backpressure give exactly the sequential results."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pytest

from stretch import channels
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.errors import UnknownOperator
from stretch.state.key_groups import key_group

# the every-state function and its reference from the keyed-process tests
from tests.datastream.test_keyed_process import EveryState, by_key, reference

RECORD = Types.TUPLE([Types.STRING(), Types.LONG(), Types.STRING()])


class Job:
    """A job fed through channel "in", with its output read into ``self.out`` by a thread."""

    def __init__(
        self,
        build,
        name: str,
        parallelism: int = 2,
        gate_slots: int | None = None,
        gate_bytes: int | None = None,
    ):
        env = StreamExecutionEnvironment.get_execution_environment()
        env.set_parallelism(parallelism)
        if gate_slots:
            env.engine_config.gate_slots = gate_slots
        if gate_bytes:
            env.engine_config.gate_bytes = gate_bytes
        build(env).sink_to(ChannelSink("out"))
        self.client = env.execute_async(name)
        self.writer = channels.open_writer(self.client, "in")
        self.out: list = []
        reader = channels.open_reader(self.client, "out")
        self._reader = threading.Thread(target=lambda: self.out.extend(reader), daemon=True)
        self._reader.start()

    def finish(self) -> list:
        self.writer.end()
        self._reader.join(120)
        assert not self._reader.is_alive(), "output never ended"
        assert self.client.wait().name == "FINISHED"
        return self.out


def feed(job: Job, records: list, rng: random.Random, chunks: int) -> threading.Thread:
    """Write the records in random-sized chunks with random pauses, from a thread."""

    def run():
        i = 0
        while i < len(records):
            n = rng.randint(1, max(2, 2 * len(records) // chunks))
            job.writer.write(records[i : i + n])
            i += n
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.01)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def rescale_randomly(
    job: Job, operator: str, rng: random.Random, count: int, while_alive: threading.Thread | None = None
):
    reports = []
    for _ in range(count):
        reports.append(job.client.rescale(operator, rng.randint(1, 8)))
        time.sleep(rng.random() * 0.02)
    for r in reports:  # a rescale to the parallelism in force publishes nothing (no new epoch)
        assert r.state_bytes_copied == 0 and (r.epoch > 0 or r.new_parallelism == r.old_parallelism)
    return reports


def every_state_job(operator: str, name: str, parallelism: int = 2) -> Job:
    """EveryState keyed by user, named ``operator``, fed RECORDs through channel "in"."""
    return Job(
        lambda env: (
            env.from_source(ChannelSource("in", RECORD), None, "in")
            .key_by(lambda r: r[0])
            .process(EveryState())
            .name(operator)
        ),
        name,
        parallelism=parallelism,
    )


def every_state_records(n: int, seed: int) -> list:
    rng = random.Random(seed)
    users = [f"u{i}" for i in range(60)]
    return [(rng.choice(users), rng.randrange(1000), rng.choice("abcde")) for _ in range(n)]


def test_every_state_kind_under_random_rescales():
    rng = random.Random(11)
    records = every_state_records(6000, 11)
    job = every_state_job("every", "every state under rescales")
    writer = feed(job, records, rng, chunks=80)
    reports = rescale_randomly(job, "every", rng, 70)
    writer.join()
    assert by_key(job.finish()) == by_key(reference(records, lambda r: r[0]))
    assert len(reports) == 70


def test_vectorized_sum_under_random_rescales():
    rng = random.Random(12)
    n = 400_000
    keys = np.random.default_rng(12).integers(0, 5000, n)
    values = np.random.default_rng(13).integers(-100, 100, n)
    t = Types.TUPLE([Types.LONG(), Types.LONG()])
    job = Job(
        lambda env: env.from_source(ChannelSource("in", t), None, "in").key_by(0).sum(1).name("sum"),
        "sum under rescales",
    )

    def write():
        for start in range(0, n, 8000):
            job.writer.write(
                pa.record_batch({"f0": keys[start : start + 8000], "f1": values[start : start + 8000]})
            )
            time.sleep(0.003)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    rescale_randomly(job, "sum", rng, 60)
    writer.join()
    got = job.finish()
    acc, want = defaultdict(int), defaultdict(list)
    for k, v in zip(keys.tolist(), values.tolist()):
        acc[k] += v
        want[k].append(acc[k])
    have = defaultdict(list)
    for k, v in got:
        have[k].append(v)
    assert have == want


@pytest.mark.parametrize("key_groups", [16, 512])
def test_an_operator_with_key_groups_of_its_own_rescales(key_groups):
    """``set_max_parallelism`` on one operator: fewer or more key groups than the job's 128."""
    rng = random.Random(key_groups)
    records = every_state_records(3000, key_groups)
    job = Job(
        lambda env: (
            env.from_source(ChannelSource("in", RECORD), None, "in")
            .key_by(lambda r: r[0])
            .process(EveryState())
            .name("own")
            .set_max_parallelism(key_groups)
        ),
        f"own key groups {key_groups}",
    )
    assert job.client.describe()["operators"][0]["max_parallelism"] == key_groups
    writer = feed(job, records, rng, chunks=30)
    reports = rescale_randomly(job, "own", rng, 12)
    writer.join()
    assert by_key(job.finish()) == by_key(reference(records, lambda r: r[0]))
    assert len(reports) == 12


class SlowSum(KeyedProcessFunction):
    """Slow enough that a tiny gate stays full."""

    def open(self, ctx):
        from stretch.datastream.state import ValueStateDescriptor

        self.total = ctx.get_state(ValueStateDescriptor("total", Types.LONG()))

    def process_element(self, value, ctx):
        time.sleep(0.0002)
        t = (self.total.value() or 0) + value[1]
        self.total.update(t)
        yield value[0], t


def test_rescales_while_the_gate_is_full():
    rng = random.Random(13)
    records = [(f"k{rng.randrange(300)}", rng.randrange(50)) for _ in range(6000)]
    t = Types.TUPLE([Types.STRING(), Types.LONG()])
    job = Job(
        lambda env: (
            env.from_source(ChannelSource("in", t), None, "in")
            .key_by(lambda r: r[0])
            .process(SlowSum())
            .name("slow")
        ),
        "rescale under backpressure",
        gate_slots=4,
    )
    writer = feed(job, records, rng, chunks=300)
    time.sleep(0.3)
    c = job.client._coordinator
    gate = c.gates[c.plan.stage("slow").input_gate]
    full_seen = 0
    for _ in range(40):
        full_seen += gate.depth() >= 3
        job.client.rescale("slow", rng.randint(1, 8))
    writer.join()
    got = job.finish()
    assert full_seen >= 10, "the gate was never full during the rescales"
    acc, want = defaultdict(int), defaultdict(list)
    for k, v in records:
        acc[k] += v
        want[k].append((k, acc[k]))
    assert by_key(got) == {k: v for k, v in want.items()}


def test_overlapping_rescales_of_two_operators_in_a_rekeying_pipeline():
    rng = random.Random(14)
    records = [(f"user{rng.randrange(200)}", rng.randrange(10)) for _ in range(8000)]
    t = Types.TUPLE([Types.STRING(), Types.LONG()])

    def build(env):
        ds = env.from_source(ChannelSource("in", t), None, "in")
        per_user = ds.key_by(lambda r: r[0]).sum(1).name("per-user")
        return (
            per_user.map(lambda r: (int(r[0][4:]) % 13, r[1]))
            .key_by(lambda r: r[0])
            .sum(1)
            .name("per-bucket")
        )

    job = Job(build, "two operators under rescales")
    writer = feed(job, records, rng, chunks=100)
    threads = [
        threading.Thread(target=rescale_randomly, args=(job, name, random.Random(seed), 20), daemon=True)
        for name, seed in (("per-user", 1), ("per-bucket", 2))
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    writer.join()
    got = job.finish()
    # the second operator sums the first one's running sums; only order-free facts compare
    per_user, expected = defaultdict(int), defaultdict(int)
    for u, v in records:
        per_user[u] += v
        expected[int(u[4:]) % 13] += per_user[u]
    final = {}
    for bucket, total in got:  # values are >= 0, so each bucket's running sum only grows
        final[bucket] = max(final.get(bucket, 0), total)
    assert len(got) == len(records)
    assert final == dict(expected)


class SlowForSome(KeyedProcessFunction):
    def __init__(self, slow_keys):
        self.slow_keys = set(slow_keys)

    def process_element(self, value, ctx):
        if ctx.get_current_key() in self.slow_keys:
            time.sleep(0.02)
        yield value


def test_an_instance_that_gains_nothing_never_waits():
    # p=2 -> 3 with max parallelism 128: instance 0 keeps key groups 0..42 and gains none;
    # instance 2 gains 86..127 from instance 1, which we keep busy with slow keys (1.2 s of work).
    # The epoch applies at the readers' frontier, ahead of most of that work: instance 2 waits for
    # instance 1 to finish the record it is at, instance 0 for nothing.
    maxp = 128
    slow = [k for k in range(100_000) if key_group(k, maxp) >= 86][:60]
    fast = [k for k in range(100_000) if key_group(k, maxp) < 43][:20]
    job = Job(
        lambda env: (
            env.from_source(ChannelSource("in", Types.LONG()), None, "in")
            .key_by(lambda k: k)
            .process(SlowForSome(slow))
            .name("op")
        ),
        "non-gaining instance",
    )
    for i in range(0, len(slow), 5):  # entries of 0.1 s of work each
        job.writer.write(slow[i : i + 5])
    time.sleep(0.1)
    report = job.client.rescale("op", 3)
    assert report.queued > 0  # it applied ahead of slow records still queued
    fast_writes = 0
    for _ in range(5):
        job.writer.write(fast)
        fast_writes += 1
        time.sleep(0.05)
    insts = job.client.describe()["operators"][0]["instances"]
    assert insts[0]["max_stall_ns"] < 50_000_000
    got = job.finish()
    assert sorted(got) == sorted(slow + fast * fast_writes)


@pytest.mark.parametrize("bad", [0, 129, "x"])
def test_rescale_errors(bad):
    job = Job(
        lambda env: (
            env.from_source(ChannelSource("in", Types.LONG()), None, "in")
            .key_by(lambda k: k)
            .sum(0)
            .name("op")
        ),
        "errors",
    )
    try:
        with pytest.raises(ValueError, match=r"parallelism must be an int in 1\.\.128"):
            job.client.rescale("op", bad)
        with pytest.raises(UnknownOperator, match="no operator named 'nope'"):
            job.client.rescale("nope", 2)
    finally:
        job.finish()


def test_a_rescale_to_the_current_parallelism_publishes_nothing_and_a_barrier_waits_for_the_gate():
    def build(env):
        src = env.from_source(ChannelSource("in", Types.TUPLE([Types.LONG(), Types.LONG()])), None, "in")
        return src.key_by(0).sum(1).name("sums")  # keyed by a field: writers append to its gate

    job = Job(build, "rescale no-op")
    co = job.client._coordinator
    op = co.resources.keyed_index[co.plan.stage("sums").id]
    before = int(co.control.epoch(op))
    same = job.client.rescale("sums", 2)
    assert (same.old_parallelism, same.new_parallelism, same.epoch) == (2, 2, before)
    assert int(co.control.epoch(op)) == before and co.rescales == []
    n = 20_000
    job.writer.write([(i % 13, 1) for i in range(n)])
    co.barrier("sums")  # every record appended before it has been processed when it returns
    assert job.client.describe()["operators"][0]["records_in"] == n
    assert int(co.control.epoch(op)) == before + 1 and co.rescales == []  # a barrier is not a rescale
    out = job.finish()
    assert sorted(max(v for k2, v in out if k2 == k) for k in range(13)) == sorted(
        sum(1 for i in range(n) if i % 13 == k) for k in range(13)
    )


@pytest.mark.parametrize("trial", range(8))
def test_a_job_finishes_when_its_scaled_away_instances_report_after_the_rest_ended(trial):
    """Up then down while records arrive, then the input ends: the instances removed by the second
    rescale may say they ended after the remaining one ended; the job still finishes, and exactly."""
    records = [(f"user-{i % 100}", 1) for i in range(20_000)]
    t = Types.TUPLE([Types.STRING(), Types.LONG()])
    job = Job(
        lambda env: (
            env.from_source(ChannelSource("in", t), None, "in").key_by(lambda r: r[0]).sum(1).name("sum")
        ),
        f"up and down {trial}",
    )
    job.writer.write(records[:10_000])
    job.client.rescale("sum", 4)
    job.writer.write(records[10_000:])
    job.client.rescale("sum", 1)
    got = job.finish()
    assert by_key(got) == {f"user-{u}": [(f"user-{u}", n) for n in range(1, 201)] for u in range(100)}


def test_a_rescale_does_not_wait_for_the_warm_pool_to_refill(monkeypatch):
    # A rescale that took spares makes the job thread fork new ones; each fork is a round trip to
    # the zygote (tens of ms on busy cores). Here the refill's forks hang until released: the next
    # rescale, which needs no new worker, still takes effect, and the pool refills afterwards.
    from stretch.runtime import zygote

    forks_go, refill_forking = threading.Event(), threading.Event()
    hold = {"on": False}
    held: list[int] = []  # pids of the forks held
    fork = zygote.Zygote.fork

    def held_fork(self, *args, **kwargs):
        if not hold["on"]:
            return fork(self, *args, **kwargs)
        refill_forking.set()
        assert forks_go.wait(60), "the forks were never released"
        held.append(fork(self, *args, **kwargs))
        return held[-1]

    monkeypatch.setattr(zygote.Zygote, "fork", held_fork)
    job = every_state_job("op", "refill", parallelism=1)
    records = every_state_records(3000, seed=11)
    job.writer.write(records[:1000])
    hold["on"] = True
    job.client.rescale("op", 3)  # takes two spares: the job thread refills the pool
    assert refill_forking.wait(30)
    job.writer.write(records[1000:2000])
    down = threading.Thread(target=lambda: job.client.rescale("op", 1), daemon=True)
    down.start()
    down.join(30)
    assert not down.is_alive(), "the rescale waited for the pool's forks"
    forks_go.set()
    co = job.client._coordinator
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
        len(held) == 2 and {w.pid for w in co.workers.idle()} >= set(held)
    ):
        time.sleep(0.01)
    assert len(held) == 2 and {w.pid for w in co.workers.idle()} >= set(held)  # the refill joined
    job.writer.write(records[2000:])
    assert by_key(job.finish()) == by_key(reference(records, lambda r: r[0]))
