"""Live code update: every record before the UPDATE record runs the old code, every record after
it the new, at any parallelism and under rescales; refused updates change nothing.

Records carry their position in the input (one writer: the gate's order), so the switch shows
in the output as a cut: the oracle runs the old code on the records before it and the new code
on the rest, over one state per key, and must give exactly the job's output.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import threading
import time

import pytest

from stretch import channels
from stretch.common import Duration, Types, WatermarkStrategy, user_code
from stretch.datastream import (
    AggregateFunction,
    CoMapFunction,
    KeyedProcessFunction,
    MapFunction,
    ProcessFunction,
    ReduceFunction,
    StreamExecutionEnvironment,
)
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.datastream.state import ListStateDescriptor, ValueStateDescriptor
from stretch.errors import RestoreRefused, UnknownOperator, UpdateRefused
from tests.runtime.test_rescale import Job

RECORD = Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG()])  # key, value, position
OUT = Types.TUPLE([Types.STRING(), Types.LONG(), Types.STRING(), Types.LONG(), Types.LONG()])


class Counting(KeyedProcessFunction):
    """Version 1: counts a key's records and sums its values."""

    tag = "v1"

    def open(self, ctx):
        self.count = ctx.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.total = ctx.get_state(ValueStateDescriptor("total", Types.LONG()))

    def step(self, count, total, value):
        return count + 1, total + value

    def process_element(self, value, ctx):
        count, total = self.step(self.count.value() or 0, self.total.value() or 0, value[1])
        self.count.update(count)
        self.total.update(total)
        yield value[0], value[2], self.tag, count, total


class Doubling(Counting):
    """Version 2: the same states, another rule, and a new state."""

    tag = "v2"

    def open(self, ctx):
        super().open(ctx)
        self.seen = ctx.get_list_state(ListStateDescriptor("seen", Types.LONG()))

    def step(self, count, total, value):
        return count + 1, total + 2 * value


class Tripling(Counting):
    tag = "v3"

    def step(self, count, total, value):
        return count + 3, total + 3 * value


VERSIONS = {"v1": Counting, "v2": Doubling, "v3": Tripling}


def oracle(records: list, switches: list) -> set:
    """Each record by the version in force at its position (switches: (first position, tag))."""
    state: dict = {}
    out = set()
    for key, value, pos in records:
        tag = [t for first, t in switches if first <= pos][-1]
        count, total = VERSIONS[tag]().step(*state.get(key, (0, 0)), value)
        state[key] = (count, total)
        out.add((key, pos, tag, count, total))
    return out


def cuts(output: list, tags: list) -> list:
    """Where the output says each version took over; fails unless each is one clean cut."""
    first = {t: min(o[1] for o in output if o[2] == t) for t in tags}
    last = {t: max(o[1] for o in output if o[2] == t) for t in tags}
    for a, b in itertools.pairwise(tags):
        assert last[a] < first[b], f"{a} ran after {b} had started: no single switching record"
    return [(first[t] if i else 0, t) for i, t in enumerate(tags)]


def records_of(n: int, seed: int) -> list:
    rng = random.Random(seed)
    return [(f"k{rng.randrange(50)}", rng.randrange(100), i) for i in range(n)]


def counting_job(name: str, parallelism: int) -> Job:
    return Job(
        lambda env: (
            env.from_source(ChannelSource("in", RECORD), None, "in")
            .key_by(lambda r: r[0])
            .process(Counting(), OUT)
            .name("count")
        ),
        name,
        parallelism=parallelism,
    )


def settle(client, operator: str, n: int) -> None:
    """Until ``operator`` has taken ``n`` records: what was written before is through the channel
    source's task and in the operator's gate, so an update now comes after it."""
    deadline = time.monotonic() + 30
    while next(o for o in client.describe()["operators"] if o["name"] == operator)["records_in"] < n:
        assert time.monotonic() < deadline, "the records never reached the operator"
        time.sleep(0.005)


def feed_slowly(job: Job, records: list, chunk: int = 20) -> threading.Thread:
    """Write from a thread, and return once the job's first results are out."""

    def run():
        for i in range(0, len(records), chunk):
            job.writer.write(records[i : i + chunk])
            time.sleep(0.005)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    while not job.out:
        time.sleep(0.01)
    return t


class Held(Counting):
    """Version 1, held back while the file ``hold`` exists: a backlog queues in its gate."""

    def __init__(self, hold: str):
        self.hold = hold

    def process_element(self, value, ctx):
        while os.path.exists(self.hold):
            time.sleep(0.005)
        yield from super().process_element(value, ctx)


def gate_rows(gate) -> int:
    """The records appended to a gate whose first entry no reader has passed: what it holds."""
    return sum(gate.read(seq).batch.num_rows for seq in range(gate.tail) if gate.read(seq).batch is not None)


def test_an_update_reports_the_records_queued_behind_it_which_run_the_new_code(tmp_path):
    """Records written while the operator is held back queue in its gate, a watermark after each
    write: the update applies ahead of them, and its report counts exactly the records that then
    run the new code, not the watermarks between them (a new user saw 0 for 20 k records)."""
    records = records_of(6000, 23)
    hold = tmp_path / "hold"
    hold.touch()
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(0)).with_timestamp_assigner(
        "f2"
    )
    job = Job(
        lambda env: (
            env.from_source(ChannelSource("in", RECORD), strategy, "in")
            .key_by(lambda r: r[0])
            .process(Held(str(hold)), OUT)
            .name("count")
        ),
        "update behind a backlog",
        parallelism=2,
    )
    for i in range(0, len(records), 300):
        job.writer.write(records[i : i + 300])
    co = job.client._coordinator
    gate = co.gates[co.plan.stage("count").input_gate]
    deadline = time.monotonic() + 30
    while gate_rows(gate) < len(records):  # all of them wait in the gate, the operator held back
        assert time.monotonic() < deadline, "the records never reached the operator's gate"
        time.sleep(0.01)
    assert gate.position > len(records)  # watermarks take positions among the records
    reports: list = []
    updating = threading.Thread(target=lambda: reports.append(job.client.update("count", Doubling())))
    updating.start()
    while job.client.describe()["operators"][0]["epoch"] < 1:  # placed: the held instances go on
        assert time.monotonic() < deadline + 30, "the update was never placed"
        time.sleep(0.01)
    hold.unlink()
    updating.join(60)
    (report,) = reports
    out = job.finish()
    assert len(out) == len(records)
    tag = {o[1]: o[2] for o in out}  # the version each record ran, by its position in the input
    # a batch is laid out by key group in the gate: the update applies at one position of it, so
    # the batches before its batch ran the old code, those after it the new, and per key the old
    # code ran the key's first records, the new code the rest
    ran = [{tag[r[2]] for r in records[i : i + 300]} for i in range(0, len(records), 300)]
    first = next(i for i, tags in enumerate(ran) if "v2" in tags)
    assert all(t == {"v1"} for t in ran[:first]) and all(t == {"v2"} for t in ran[first + 1 :])
    by_key: dict = {}
    for key, _, pos in records:
        by_key.setdefault(key, []).append(tag[pos])
    assert all(tags == sorted(tags) for tags in by_key.values())
    state: dict = {}
    model = set()
    for key, value, pos in records:  # each record by the version it ran, over one state per key
        count, total = VERSIONS[tag[pos]]().step(*state.get(key, (0, 0)), value)
        state[key] = (count, total)
        model.add((key, pos, tag[pos], count, total))
    assert set(out) == model
    ran_new = sum(t == "v2" for t in tag.values())
    assert 0 < ran_new < len(records)  # it applied ahead of most of the backlog, after its first records
    assert report.queued == ran_new
    assert f"({ran_new:,} queued records run the new code)" in str(report)


class SlowToOpen(Doubling):
    """Version 2, whose open() takes longer than an update's check may hold the instances."""

    def open(self, ctx):
        time.sleep(0.4)
        super().open(ctx)


def test_a_slow_check_lets_the_instances_go_on_under_the_old_code_then_switches_at_one_record():
    """An update's epoch is placed as its check starts, the instances held at its position for
    the check's answer: a check slower than ``HOLD_S`` lets them go on under the old code (that
    epoch runs it) and the update takes an epoch of its own once checked."""
    records = records_of(8000, 31)
    job = counting_job("slow check", 2)
    writer = feed_slowly(job, records)
    reports: list = []
    updating = threading.Thread(target=lambda: reports.append(job.client.update("count", SlowToOpen())))
    count = lambda: job.client.describe()["operators"][0]["records_in"]  # noqa: E731
    updating.start()
    time.sleep(0.1)  # the check sleeps in open() for 0.4 s
    before = count()
    time.sleep(0.2)
    assert count() > before, "the instances waited for the check"
    assert updating.is_alive()
    updating.join(60)
    writer.join()
    (report,) = reports
    out = job.finish()
    assert report.epoch == 2  # the held epoch ran the old code; the update's is the next
    switches = cuts(out, ["v1", "v2"])
    assert 0 < switches[1][0] < len(records)
    assert set(out) == oracle(records, switches) and len(out) == len(records)


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_every_instance_switches_at_one_record(parallelism):
    records = records_of(4000, parallelism)
    job = counting_job(f"update p{parallelism}", parallelism)
    writer = feed_slowly(job, records)
    report = job.client.update("count", Doubling())
    writer.join()
    out = job.finish()
    assert report.version == 1 and not report.dry_run
    assert report.states_added == ["seen"] and report.states_orphaned == []
    assert report.elapsed_ms > 0 and report.checkpoint is None
    switches = cuts(out, ["v1", "v2"])
    assert 0 < switches[1][0] < len(records)  # it switched mid-stream
    assert set(out) == oracle(records, switches) and len(out) == len(records)


def test_updates_interleaved_with_random_rescales():
    rng = random.Random(5)
    records = records_of(6000, 5)
    job = counting_job("updates and rescales", 2)
    writer = feed_slowly(job, records)
    tags = ["v1"]
    for tag in ["v2", "v3", "v2"]:
        for _ in range(3):
            job.client.rescale("count", rng.randint(1, 6))
            time.sleep(rng.random() * 0.03)
        report = job.client.update("count", VERSIONS[tag]())
        tags.append(tag)
        assert report.version == len(tags) - 1
    writer.join()
    out = job.finish()
    # a tag may come back: cut the output by version number instead
    versions = {}
    for o in out:
        versions.setdefault(o[2], []).append(o[1])
    first_seen = sorted({t: min(p) for t, p in versions.items()}.items(), key=lambda kv: kv[1])
    assert [t for t, _ in first_seen] == ["v1", "v2", "v3"]
    # with v2 twice, check the cuts by replaying: the one assignment of cuts that the oracle matches
    v2 = sorted(versions["v2"])
    v3 = sorted(versions["v3"])
    assert max(versions["v1"]) < v2[0] and v3[0] > v2[0]
    second_v2 = [p for p in v2 if p > v3[-1]]
    assert second_v2 and all(p < v3[0] or p > v3[-1] for p in v2)
    switches = [(0, "v1"), (v2[0], "v2"), (v3[0], "v3"), (second_v2[0], "v2")]
    assert set(out) == oracle(records, switches) and len(out) == len(records)


class NotAProcessFunction(MapFunction):
    def map(self, value):
        return value


class AMap(NotAProcessFunction):
    pass


class CountAsText(Counting):
    def open(self, ctx):
        self.count = ctx.get_state(ValueStateDescriptor("count", Types.STRING()))


class FailsToOpen(Counting):
    def open(self, ctx):
        raise RuntimeError("no database here")


class Unpicklable(Counting):
    def __init__(self):
        self.lock = threading.Lock()


class Orphaning(KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.get_state(ValueStateDescriptor("count", Types.LONG()))

    def process_element(self, value, ctx):
        c = (self.count.value() or 0) + 1
        self.count.update(c)
        yield value[0], value[2], "v2", c, -1


def test_refused_updates_change_nothing_and_a_dry_run_only_checks():
    records = records_of(1500, 9)
    job = counting_job("refused updates", 2)
    job.writer.write(records[:500])
    refusals = {
        NotAProcessFunction(): "runs a KeyedProcessFunction (Counting); the new code is a NotAProcessFunction",
        AMap(): "the new code is an AMap",
        Doubling: "got the class Doubling; pass an instance, Doubling()",  # the class, not Doubling()
        CountAsText(): "state 'count' keeps its name but changes",
        FailsToOpen(): "failed in open(): RuntimeError: no database here",
        # what a job's start says of a function that does not pickle (stretch.plan.shipping)
        Unpicklable(): "process function of operator 'count' cannot be shipped to the workers: it captures "
        "a '_thread.lock' object (as 'lock')",
    }
    for function, why in refusals.items():
        with pytest.raises(UpdateRefused, match=why.replace("(", r"\(").replace(")", r"\)")):
            job.client.update("count", function)
    with pytest.raises(UpdateRefused, match="feeds"):
        job.client.update("count", Doubling(), output_type=Types.STRING())
    with pytest.raises(UnknownOperator, match="no operator named 'nope'"):
        job.client.update("nope", Doubling())
    dry = job.client.update("count", Orphaning(), dry_run=True)
    assert dry.dry_run and dry.states_orphaned == ["total"] and dry.states_added == []
    saved = job.client._coordinator.updater.history.dir  # a refused version leaves no file behind
    assert sorted(p.name for p in saved.iterdir() if p.suffix == ".pkl") == sorted(
        f"{s.id}-0.pkl" for s in job.client._coordinator.plan.stages
    )
    job.writer.write(records[500:])
    out = job.finish()
    assert {o[2] for o in out} == {"v1"}
    assert set(out) == oracle(records, [(0, "v1")])
    assert job.client.code_history()["count"][-1]["version"] == 0


def test_orphaned_state_is_kept_unless_dropped():
    records = records_of(800, 3)
    job = counting_job("orphaned states", 2)
    job.writer.write(records[:400])
    settle(job.client, "count", 400)
    kept = job.client.update("count", Orphaning())
    assert kept.states_orphaned == ["total"]
    totals = job.client.query_state("count").column("total").to_pylist()
    assert all(t is not None for t in totals) and len(totals) == 50
    dropped = job.client.update("count", Orphaning(), drop_orphaned=True)
    assert dropped.version == 2
    assert job.client.query_state("count").column("total").to_pylist() == [None] * 50
    job.writer.write(records[400:])
    out = job.finish()
    assert sorted(o[1] for o in out if o[2] == "v2") == list(range(400, 800))


class Summing(ReduceFunction):
    def reduce(self, a, b):
        return a[0], a[1] + b[1], b[2]


class Keeping(ReduceFunction):
    def reduce(self, a, b):
        return a[0], max(a[1], b[1]), b[2]


def test_keyed_map_and_rolling_reduce_switch_at_the_record():
    records = records_of(1200, 4)
    env_jobs = {
        "map": (lambda ds: ds.map(lambda r: (r[0], r[2], "old")), lambda r: (r[0], r[2], "new")),
        "reduce": (lambda ds: ds.reduce(Summing()), Keeping()),
    }
    for kind, (build, new) in env_jobs.items():
        job = Job(
            lambda env, build=build: build(
                env.from_source(ChannelSource("in", RECORD), None, "in").key_by(lambda r: r[0])
            ).name("op"),
            f"update {kind}",
        )
        job.writer.write(records[:600])
        settle(job.client, "op", 600)
        job.client.update("op", new)
        job.writer.write(records[600:])
        out = job.finish()
        if kind == "map":
            assert sorted(out, key=lambda o: o[1]) == [
                (k, p, "old" if p < 600 else "new") for k, _, p in records
            ]
        else:
            acc: dict = {}
            want = []
            for k, v, p in records:
                a = acc.get(k)
                f = Summing() if p < 600 else Keeping()
                acc[k] = (k, v, p) if a is None else f.reduce(a, (k, v, p))
                want.append(acc[k])
            assert sorted(out, key=lambda o: o[2]) == want


class Stamping(ProcessFunction):
    tag = "old"

    def process_element(self, value, ctx):
        yield value[0], value[2], self.tag


class StampingAnew(Stamping):
    tag = "new"


def wait_out(job: Job, n: int) -> None:
    deadline = time.monotonic() + 30
    while len(job.out) < n:
        assert time.monotonic() < deadline, "the results never came"
        time.sleep(0.005)


@pytest.mark.parametrize(
    "where", ["map after the source", "process after the source", "map after a keyed operator"]
)
def test_a_chained_step_switches_at_the_record(where):
    records = records_of(800, 14)

    def build(env):
        ds = env.from_source(ChannelSource("in", RECORD), None, "in")
        if where == "map after the source":
            return ds.map(lambda r: (r[0], r[2], "old")).name("step")
        if where == "process after the source":
            return ds.process(Stamping()).name("step")
        keyed = ds.key_by(lambda r: r[0]).process(Counting(), OUT).name("count")
        return keyed.map(lambda o: (o[0], o[1], "old")).name("step")

    job = Job(build, f"chained step update: {where}")
    job.writer.write(records[:400])
    wait_out(job, 400)
    new = (
        StampingAnew()
        if where.startswith("process")
        else (lambda r: (r[0], r[1 if "keyed" in where else 2], "new"))
    )
    with pytest.raises(UpdateRefused, match="runs a"):
        job.client.update("step", Doubling())
    report = job.client.update("step", new)
    assert report.version == 1
    # nothing was queued behind a keyed operator's switch (all 400 were out); a source's step
    # switches between two of the source's reads: what the source has not read is not counted
    assert report.queued == (0 if "keyed" in where else None)
    job.writer.write(records[400:])
    out = job.finish()
    assert sorted(out, key=lambda o: o[1]) == [(k, p, "old" if p < 400 else "new") for k, _, p in records]


def test_after_a_source_steps_update_the_keyed_operator_updates_and_rescales():
    """A source's chained step updated live reached every worker, the spares too: a spare that
    then died could neither check the next update nor take an instance of a rescale (found in a
    new-user trial)."""
    records = records_of(900, 15)

    def build(env):
        ds = env.from_source(ChannelSource("in", RECORD), None, "in").map(lambda r: r).name("step")
        return ds.key_by(lambda r: r[0]).process(Counting(), OUT).name("count")

    job = Job(build, "keyed update after a step update")
    job.writer.write(records[:300])
    settle(job.client, "count", 300)
    job.client.update("step", lambda r: (r[0], r[1] + 1000, r[2]))
    job.writer.write(records[300:600])
    settle(job.client, "count", 600)
    job.client.update("count", Doubling())
    job.client.rescale("count", 1)
    job.client.rescale("count", 3)
    job.writer.write(records[600:])
    out = job.finish()
    acc: dict = {}
    want = []
    for k, v, p in records:  # the model: the step adds 1000 from record 300, Doubling from 600
        f = Doubling() if p >= 600 else Counting()
        count, total = f.step(*acc.get(k, (0, 0)), v + 1000 if p >= 300 else v)
        acc[k] = (count, total)
        want.append((k, p, f.tag, count, total))
    assert sorted(out, key=lambda o: o[1]) == want


def test_an_unknown_name_lists_the_operators_and_steps():
    job = counting_job("unknown update target", 1)
    job.writer.write(records_of(10, 1))
    with pytest.raises(UnknownOperator, match="keyed operators: count; chained steps: none"):
        job.client.update("nope", Doubling())
    job.finish()


class Reminding(KeyedProcessFunction):
    """Version 1 sets one processing-time timer per key; its on_timer is never reached."""

    tag = "v1"

    def open(self, ctx):
        self.set = ctx.get_state(ValueStateDescriptor("set", Types.BOOLEAN()))

    def process_element(self, value, ctx):
        if not self.set.value():
            self.set.update(True)
            ctx.timer_service().register_processing_time_timer(
                ctx.timer_service().current_processing_time() + 400
            )
        return ()

    def on_timer(self, timestamp, ctx):
        yield ctx.get_current_key(), -1, self.tag, 0, 0


class RemindingV2(Reminding):
    tag = "v2"


@pytest.mark.parametrize("drop_orphaned", [False, True])
def test_timers_set_by_the_old_code_fire_into_the_new_code(drop_orphaned):
    """Timers are the engine's, not states the code declares: never orphaned, never dropped."""
    records = records_of(300, 6)
    job = Job(
        lambda env: (
            env.from_source(ChannelSource("in", RECORD), None, "in")
            .key_by(lambda r: r[0])
            .process(Reminding(), OUT)
            .name("remind")
        ),
        "timers across an update",
    )
    job.writer.write(records)
    settle(job.client, "remind", len(records))
    report = job.client.update("remind", RemindingV2(), drop_orphaned=drop_orphaned)
    assert report.elapsed_ms < 400
    assert report.states_orphaned == []  # the same states: the timers' are not the code's
    time.sleep(1.0)
    out = job.finish()
    assert sorted(o[0] for o in out) == sorted({r[0] for r in records})
    assert {o[2] for o in out} == {"v2"}


def test_a_count_window_reduce_switches_at_the_record():
    records = records_of(900, 8)
    job = Job(
        lambda env: (
            env.from_source(ChannelSource("in", RECORD), None, "in")
            .key_by(lambda r: r[0])
            .count_window(3)
            .reduce(Summing())
            .name("windows")
        ),
        "window reduce update",
    )
    job.writer.write(records[:450])
    settle(job.client, "windows", 450)
    job.client.update("windows", Keeping())
    job.writer.write(records[450:])
    out = job.finish()
    acc: dict = {}
    want = []
    for k, v, p in records:
        a, n = acc.get(k, (None, 0))
        f = Summing() if p < 450 else Keeping()
        a = (k, v, p) if a is None else f.reduce(a, (k, v, p))
        if n + 1 == 3:
            want.append(a)
            acc[k] = (None, 0)
        else:
            acc[k] = (a, n + 1)
    assert sorted(out, key=lambda o: o[2]) == sorted(want, key=lambda o: o[2])


@pytest.mark.parametrize("kill_after", [0.0, 0.005, 0.5])
def test_a_kill_9_during_or_after_an_update_loses_and_duplicates_nothing(kill_after):
    """A worker dies while the update is under way (the recovery undoes it, and it is asked again)
    or after it (the recovery runs the version its checkpoint recorded): either way the output is
    the old code up to one record and the new code after it, each result once."""
    records = records_of(1500, 17)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_checkpointing(200)
    source = ChannelSource("in", RECORD, durable=True)
    ds = env.from_source(source, None, "in").key_by(lambda r: r[0]).process(Counting(), OUT).name("count")
    ds.sink_to(ChannelSink("out"))
    client = env.execute_async(f"update-kill-{random.randrange(1 << 40):x}")
    co = client._coordinator
    writer = channels.open_writer(client, "in")
    writer.write(records[:500])
    settle(client, "count", 500)
    stage = co.plan.stage("count").id

    def kill() -> None:
        time.sleep(kill_after)
        victims = [w for w in co.workers.all() if w.task and w.task[0] == stage and w.pid]
        os.kill(victims[0].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        report = client.update("count", Doubling())
        assert report.checkpoint is not None
    except RuntimeError:  # the recovery ended it: nothing of it stays
        deadline = time.monotonic() + 30
        while co.status.name != "RUNNING" or not co.recoveries:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        settle(client, "count", 500)  # the replay has caught up (else the update applies to it)
        report = client.update("count", Doubling())
        history = [e["version"] for e in client.code_history()["count"]]
        assert history == list(range(report.version + 1))  # an undone version's number is not reused
    killer.join()
    writer.write(records[500:])
    writer.end()
    assert client.wait(60).name == "FINISHED"
    assert len(co.recoveries) == 1
    out = [tuple(r) for r in channels.open_reader(client, "out")]
    assert set(out) == oracle(records, cuts(out, ["v1", "v2"])) and len(out) == len(records)


def test_a_restore_with_the_scripts_older_code_refuses_unless_told(tmp_path):
    from stretch.plan.stages import OperatorSpec, StageSpec
    from stretch.runtime.code_update import CodeHistory

    def stage(fn):
        return StageSpec(1, "count", "keyed", 2, 128, [], operator=OperatorSpec("process", fn))

    first = CodeHistory(tmp_path, [stage(Counting())], restore=False)
    doubling = first.numbered(stage(Doubling()))
    first.record(doubling, first.write(doubling, user_code.dumps(doubling), "tests:Doubling"))
    first.save_index()
    again = CodeHistory(tmp_path, [stage(Counting())], restore=True)  # the old script, restored
    with pytest.raises(RestoreRefused, match=r"ran code version 1 at the checkpoint .* tests:Doubling"):
        again.at_checkpoint(stage(Counting()), 1, "refuse")
    ran = again.at_checkpoint(stage(Counting()), 1, "checkpoint")
    assert type(ran.operator.fn) is Doubling and ran.code_version == 1
    assert type(again.at_checkpoint(stage(Counting()), 1, "script").operator.fn) is Counting
    assert again.at_checkpoint(stage(Counting()), 0, "refuse").code_version == 0
    updated = CodeHistory(tmp_path, [stage(Doubling())], restore=True)  # the script brought up to date
    assert type(updated.at_checkpoint(stage(Doubling()), 1, "refuse").operator.fn) is Doubling
    edited = CodeHistory(tmp_path, [stage(Tripling())], restore=True)  # new code of the script's own
    assert type(edited.at_checkpoint(stage(Tripling()), 1, "refuse").operator.fn) is Tripling


def test_a_built_in_rolling_sum_becomes_a_rolling_max():
    t = Types.TUPLE([Types.LONG(), Types.LONG()])
    rng = random.Random(31)
    records = [(rng.randrange(40), rng.randrange(-50, 50)) for _ in range(2000)]
    job = Job(
        lambda env: env.from_source(ChannelSource("in", t), None, "in").key_by(0).sum(1).name("agg"),
        "rolling sum to max",
    )
    job.writer.write(records[:1000])
    settle(job.client, "agg", 1000)
    with pytest.raises(UpdateRefused, match="'sum', 'min', 'max'"):
        job.client.update("agg", Keeping())
    job.client.update("agg", "max")
    job.writer.write(records[1000:])
    out = job.finish()
    acc: dict = {}
    want: dict = {}
    for i, (k, v) in enumerate(records):
        acc[k] = v if k not in acc else (acc[k] + v if i < 1000 else max(acc[k], v))
        want.setdefault(k, []).append((k, acc[k]))
    have: dict = {}
    for k, v in out:
        have.setdefault(k, []).append((k, v))
    assert have == want


class Averaging(AggregateFunction):
    def create_accumulator(self):
        return (0, 0)

    def add(self, value, accumulator):
        return accumulator[0] + value[1], accumulator[1] + 1

    def get_result(self, accumulator):
        return accumulator[0] / accumulator[1]


class Totalling(Averaging):
    def get_result(self, accumulator):
        return float(accumulator[0])


def test_a_window_aggregate_function_switches_at_the_record():
    records = records_of(900, 12)
    job = Job(
        lambda env: (
            env.from_source(ChannelSource("in", RECORD), None, "in")
            .key_by(lambda r: r[0])
            .count_window(3)
            .aggregate(Averaging())
            .name("windows")
        ),
        "window aggregate update",
    )
    job.writer.write(records[:450])
    settle(job.client, "windows", 450)
    job.client.update("windows", Totalling())
    job.writer.write(records[450:])
    out = job.finish()
    want, pending = [], {}
    for k, v, p in records:
        acc = pending.get(k, [])
        acc.append((v, p))
        if len(acc) == 3:  # a window fires on its third element: the code in force then decides
            total = sum(x for x, _ in acc)
            want.append(total / 3 if acc[-1][1] < 450 else float(total))
            acc = []
        pending[k] = acc
    assert sorted(out) == sorted(want)


class Tagging(CoMapFunction):
    tag = "old"

    def map1(self, value):
        return value[0], value[2], self.tag

    def map2(self, value):
        return value[0], -value[2], self.tag


class TaggingAnew(Tagging):
    tag = "new"


def test_a_connected_co_map_switches_at_the_record():
    records = records_of(600, 13)
    left, right = records[::2], records[1::2]

    def build(env):
        a = env.from_source(ChannelSource("left", RECORD), None, "left")
        b = env.from_source(ChannelSource("right", RECORD), None, "right")
        return a.connect(b).key_by(lambda r: r[0], lambda r: r[0]).map(Tagging()).name("co")

    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    build(env).sink_to(ChannelSink("out"))
    client = env.execute_async("co-map update")
    writers = channels.open_writer(client, "left"), channels.open_writer(client, "right")
    writers[0].write(left[:150])
    writers[1].write(right[:150])
    settle(client, "co", 300)
    with pytest.raises(UpdateRefused, match="CoMapFunction"):
        client.update("co", Doubling())
    client.update("co", TaggingAnew())
    writers[0].write(left[150:])
    writers[1].write(right[150:])
    for w in writers:
        w.end()
    out = sorted(tuple(r) for r in channels.open_reader(client, "out"))
    client.wait()
    want = [(k, p, "old" if i < 150 else "new") for i, (k, _, p) in enumerate(left)]
    want += [(k, -p, "old" if i < 150 else "new") for i, (k, _, p) in enumerate(right)]
    assert out == sorted(want)


def test_status_shows_each_operators_code_version_and_the_updates():
    job = counting_job("status after an update", 1)
    job.writer.write(records_of(100, 2))
    settle(job.client, "count", 100)
    assert job.client.describe()["operators"][0]["code_version"] == 0
    job.client.update("count", Doubling())
    status = job.client.describe()
    assert status["operators"][0]["code_version"] == 1
    assert [(u["operator"], u["version"]) for u in status["updates"]] == [("count", 1)]
    job.finish()
