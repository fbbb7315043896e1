"""State TTL against a plain-Python model of Flink's TTL semantics, on a controlled clock."""

from __future__ import annotations

import random

import pytest

from stretch.common import Time, Types
from stretch.datastream.state import (
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
)
from stretch.state import ttl as ttl_module
from tests.state.test_states import Driver, arena  # noqa: F401 (fixture)

TTL = 10
UPDATES = {"write": "update_ttl_on_create_and_write", "read": "update_ttl_on_read_and_write"}
VISIBILITY = {"never": "never_return_expired", "if_not_cleaned": "return_expired_if_not_cleaned_up"}


@pytest.fixture
def clock(monkeypatch):
    now = [1_000]
    monkeypatch.setattr(ttl_module, "now_ms", lambda: now[0])
    return now


def config(update: str, visibility: str) -> StateTtlConfig:
    builder = StateTtlConfig.new_builder(Time.milliseconds(TTL))
    return getattr(getattr(builder, UPDATES[update])(), VISIBILITY[visibility])().build()


class Cell:
    """Flink's TTL for one stored value: (value, stamp), cleared when found expired."""

    def __init__(self, update: str, visibility: str):
        self.on_read = update == "read"
        self.return_expired = visibility == "if_not_cleaned"
        self.entries: dict = {}

    def read(self, k, now):
        if k not in self.entries:
            return None
        value, stamp = self.entries[k]
        if stamp + TTL <= now:
            del self.entries[k]
            return value if self.return_expired else None
        if self.on_read:
            self.entries[k] = (value, now)
        return value

    def write(self, k, value, now):
        self.entries[k] = (value, now)


def _run(driver, clock, rng, keys, step) -> None:
    for _ in range(40):
        batch = [rng.choice(keys) for _ in range(rng.randrange(1, 12))]
        for k in driver.each(batch):
            clock[0] += rng.choice((0, 0, 1, 2, 4, 7))
            step(k, clock[0])


@pytest.mark.parametrize("visibility", sorted(VISIBILITY))
@pytest.mark.parametrize("update", sorted(UPDATES))
def test_value_state_expires_like_flink(arena, clock, update, visibility):  # noqa: F811
    driver, rng = Driver(arena), random.Random(f"{update}{visibility}")
    desc = ValueStateDescriptor("v", Types.LONG())
    desc.enable_time_to_live(config(update, visibility))
    state = driver.backend.state(desc)
    model = Cell(update, visibility)

    def step(k, now):
        if rng.random() < 0.5:
            assert state.value() == model.read(k, now), (k, now)
        else:
            v = rng.randrange(1000)
            state.update(v)
            model.write(k, v, now)

    _run(driver, clock, rng, list(range(6)), step)


@pytest.mark.parametrize("update", sorted(UPDATES))
def test_map_entries_expire_one_by_one(arena, clock, update):  # noqa: F811
    driver, rng = Driver(arena), random.Random(update)
    desc = MapStateDescriptor("m", Types.STRING(), Types.LONG())
    desc.enable_time_to_live(config(update, "never"))
    state = driver.backend.state(desc)
    models: dict = {}

    def step(k, now):
        model = models.setdefault(k, Cell(update, "never"))
        field = rng.choice("abc")
        r = rng.random()
        if r < 0.4:
            assert state.get(field) == model.read(field, now)
        elif r < 0.5:
            want = {f: model.read(f, now) for f in list(model.entries)}
            assert dict(state.items()) == {f: v for f, v in want.items() if v is not None}
        else:
            v = rng.randrange(1000)
            state.put(field, v)
            model.write(field, v, now)

    _run(driver, clock, rng, list(range(4)), step)


def test_list_elements_expire_one_by_one(arena, clock):  # noqa: F811
    driver, rng = Driver(arena), random.Random(3)
    desc = ListStateDescriptor("l", Types.LONG())
    desc.enable_time_to_live(config("write", "never"))
    state = driver.backend.state(desc)
    model: dict = {}

    def step(k, now):
        elements = model.setdefault(k, [])
        if rng.random() < 0.4:
            elements[:] = [(v, s) for v, s in elements if s + TTL > now]
            assert list(state.get()) == [v for v, _ in elements]
        else:
            v = rng.randrange(1000)
            state.add(v)
            elements.append((v, now))

    _run(driver, clock, rng, list(range(4)), step)


def test_reducing_state_starts_afresh_after_expiry(arena, clock):  # noqa: F811
    driver, rng = Driver(arena), random.Random(4)
    desc = ReducingStateDescriptor("r", lambda a, b: a + b, Types.LONG())
    desc.enable_time_to_live(config("write", "never"))
    state = driver.backend.state(desc)
    model = Cell("write", "never")

    def step(k, now):
        if rng.random() < 0.4:
            assert state.get() == model.read(k, now)
        else:
            v = rng.randrange(1000)
            model.write(k, (model.read(k, now) or 0) + v, now)
            state.add(v)

    _run(driver, clock, rng, list(range(5)), step)
