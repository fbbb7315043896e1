"""The elasticity controller: up under load, back down when it eases, steady at a steady rate."""

from __future__ import annotations

import time

import pytest

from stretch import channels
from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource
from stretch.elasticity import OperatorLoad, ThresholdPolicy, TrendPolicy


class Slow(KeyedProcessFunction):
    """Half a millisecond per record, mostly waiting (like a lookup), so instances add capacity."""

    def process_element(self, value, ctx):
        time.sleep(0.0005)
        return []


def run_phases(policy, phases, max_parallelism=6):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    env.enable_elasticity(policy, 1, max_parallelism, interval_ms=400, cooldown_ms=800)
    ds = env.from_source(ChannelSource("in", Types.LONG()), None, "in")
    ds.key_by(lambda x: x % 97).process(Slow()).name("slow").sink_to(DiscardingSink())
    client = env.execute_async("elastic")
    writer = channels.open_writer(client, "in")
    levels = []
    i = 0
    try:
        for rate, seconds in phases:
            start_rescales = len(client._coordinator.rescales)
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                n = rate // 20
                writer.write(list(range(i, i + n)))
                i += n
                time.sleep(0.05)
            ops = client.describe()["operators"][0]
            levels.append((ops["parallelism"], len(client._coordinator.rescales) - start_rescales))
    finally:
        writer.end()
        client.wait()
    parallelisms = [r["new_parallelism"] for r in client._coordinator.rescales]
    return levels, parallelisms


@pytest.mark.parametrize("policy", [ThresholdPolicy(), TrendPolicy()], ids=["threshold", "trend"])
def test_stepped_rate_goes_up_and_comes_back_down_within_bounds(policy):
    levels, parallelisms = run_phases(policy, [(400, 4), (6000, 9), (400, 9)])
    (low1, _), (high, _), (low2, _) = levels
    assert low1 == 1
    assert high >= 3, f"did not scale up under load: {levels}"
    assert low2 < high and low2 <= 2, f"did not scale back down: {levels}"
    assert all(1 <= p <= 6 for p in parallelisms)


def test_no_oscillation_at_a_steady_rate():
    levels, _ = run_phases(ThresholdPolicy(), [(3000, 8), (3000, 8)])
    _, rescales_in_steady_phase = levels[1]
    assert rescales_in_steady_phase <= 1, f"kept rescaling at a steady rate: {levels}"


def load(p, busy, growth=0, throughput=1000.0):
    return OperatorLoad("op", p, (busy,) * p, throughput, 0, growth, 1, 8)


def test_threshold_policy_aims_at_the_target():
    policy = ThresholdPolicy()
    assert policy.decide(load(2, 0.95)) == 3  # ceil(2 * 0.95 / 0.7)
    assert policy.decide(load(4, 0.95)) == 6
    assert policy.decide(load(4, 0.3)) == 2
    assert policy.decide(load(2, 0.6)) == 2
    assert policy.decide(load(8, 1.0)) == 8  # bounded


def test_trend_policy_backs_off_when_widening_does_not_pay():
    policy = TrendPolicy()
    assert policy.decide(load(2, 0.95, throughput=1000)) == 3
    assert policy.decide(load(3, 0.95, throughput=1020)) == 2  # +2 %: go back
    assert policy.decide(load(2, 0.95, throughput=1000)) == 2  # and stay while the load is the same
    assert policy.decide(load(2, 0.95, throughput=1500)) == 3  # the load changed: try again
    assert policy.decide(load(3, 0.95, throughput=2000)) == 4  # it paid: keep widening
