"""Names of a job's shared-memory segments, as handed to every worker."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class JobResources:
    """Everything a worker needs to attach to the job's segments (names only, no handles)."""

    prefix: str
    control: str
    n_keyed: int
    max_parallelism: int
    gates: dict[int, str] = field(default_factory=dict)  # gate id -> segment
    sink_gates: dict[int, str] = field(default_factory=dict)  # sink id -> segment
    arenas: dict[int, str] = field(default_factory=dict)  # stage id -> state segment
    keyed_index: dict[int, int] = field(default_factory=dict)  # stage id -> control block operator
    boards: dict[int, str] = field(default_factory=dict)  # stage id -> broadcast hand-off segment
    channels: dict[str, str] = field(default_factory=dict)  # input channel name -> gate segment
    sinks: dict = field(default_factory=dict)  # sink id -> SinkSpec, for sinks chained into instances
    producers: dict[int, list[int]] = field(default_factory=dict)  # gate id -> initial watermark producers
    dead_letter_sink: int | None = None  # the sink of rejected records, under the dead-letter policy
    checkpoints: str | None = None  # directory of the job's checkpoints, if it takes them
    code: str = ""  # directory of the keyed operators' code versions (runtime.code_update)
    channel_logs: dict[str, tuple[str, str]] = field(default_factory=dict)  # input channel -> (log, tail)
    aborted_txns: set[int] = field(default_factory=set)  # stage transactions a restored run skips
    job_parameters: dict[str, str] = field(default_factory=dict)  # the plan's global job parameters
