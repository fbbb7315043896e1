"""Restart strategies (``pyflink.common.restart_strategy``).

stretch recovers a checkpointed job from its latest checkpoint whenever a worker dies, without a
restart of the other instances; a strategy set with ``env.set_restart_strategy`` is recorded (and
returned by ``get_restart_strategy``) but does not change that."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartStrategyConfiguration:
    kind: str
    restart_attempts: int | None = None
    delay_ms: int | None = None

    def get_description(self) -> str:
        return self.kind if self.restart_attempts is None else f"{self.kind} ({self.restart_attempts})"


def _ms(delay) -> int:
    return int(delay.to_milliseconds()) if hasattr(delay, "to_milliseconds") else int(delay)


class RestartStrategies:
    """PyFlink's restart strategies: recorded, not acted on (a checkpointed job recovers its dead
    workers by itself)."""

    RestartStrategyConfiguration = RestartStrategyConfiguration

    @staticmethod
    def no_restart() -> RestartStrategyConfiguration:
        return RestartStrategyConfiguration("NoRestart")

    @staticmethod
    def fall_back_restart() -> RestartStrategyConfiguration:
        return RestartStrategyConfiguration("FallBack")

    @staticmethod
    def fixed_delay_restart(restart_attempts: int, delay_between_attempts) -> RestartStrategyConfiguration:
        return RestartStrategyConfiguration("FixedDelay", int(restart_attempts), _ms(delay_between_attempts))

    @staticmethod
    def failure_rate_restart(
        failure_rate: int, failure_interval, delay_interval
    ) -> RestartStrategyConfiguration:
        return RestartStrategyConfiguration("FailureRate", int(failure_rate), _ms(delay_interval))
