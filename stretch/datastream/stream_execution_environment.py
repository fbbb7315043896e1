"""StreamExecutionEnvironment: where a job is defined and submitted (PyFlink's names)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from stretch.common.configuration import Configuration
from stretch.common.execution_config import ExecutionConfig
from stretch.common.records import to_batch
from stretch.common.typeinfo import TypeInformation
from stretch.contracts.connectors import RecordPositionedSource, Source
from stretch.contracts.execution import RuntimeExecutionMode, StateBackend, TimeCharacteristic
from stretch.datastream.checkpoint_config import CheckpointConfig, CheckpointingMode
from stretch.datastream.connectors.arrow import ArrowSource
from stretch.datastream.connectors.channel import ChannelSink, check_channel_name
from stretch.datastream.data_stream import DataStream, check_max_parallelism, check_parallelism
from stretch.datastream.execution_plan import execution_plan, in_batch_mode
from stretch.datastream.job_client import CloseableIterator, JobClient, JobExecutionResult
from stretch.elasticity import ThresholdPolicy
from stretch.errors import RestoreRefused
from stretch.plan.graph import Transformation
from stretch.plan.stages import compile_plan
from stretch.runtime.coordinator import Coordinator, EngineConfig
from stretch.runtime.elastic_controller import ElasticityConfig
from stretch.runtime.metrics import require_prometheus
from stretch.state.key_groups import DEFAULT_MAX_PARALLELISM, MAX_MAX_PARALLELISM
from stretch.ui.config import UIConfig

DEFAULT_JOB_NAME = "Flink Streaming Job"
# the API's own functions and connectors that jobs run: workers import them before they are needed
_FUNCTION_LIBRARIES = (
    "stretch.datastream.keyed_functions",
    "stretch.datastream.windowing",
    "stretch.datastream.aggregates",
    "stretch.datastream.join",
    "stretch.datastream.connectors",
)


class _CollectionSource(RecordPositionedSource):
    """from_collection: the records, converted (and type-checked) to Arrow when the call is made."""

    def __init__(self, batch, chunk_rows: int = 65536):
        self.batch = batch
        self.chunk_rows = chunk_rows

    def create_reader(self, context=None):
        for start in range(self.resume_at(context), self.batch.num_rows, self.chunk_rows):
            yield self.batch.slice(start, self.chunk_rows)


RESTORE_ENV = "STRETCH_RESTORE"  # set by `stretch run --restore`
RESTORE_CODE_ENV = "STRETCH_RESTORE_CODE"  # set by `stretch run --restore-code`


def default_max_parallelism(parallelism: int) -> int:
    """Flink's max parallelism for a job that sets none: 1.5 x the parallelism rounded up to a
    power of two, at least 128 (so a job of parallelism 200 gets 512 key groups, not an error)."""
    return min(
        max(1 << (parallelism + parallelism // 2 - 1).bit_length(), DEFAULT_MAX_PARALLELISM),
        MAX_MAX_PARALLELISM,
    )


class StreamExecutionEnvironment:
    """Collects the transformations of a job; ``execute`` runs them on this machine's cores."""

    def __init__(self):
        self._parallelism = os.cpu_count() or 1
        self._max_parallelism = default_max_parallelism(self._parallelism)
        self._max_parallelism_set = False  # unset, it follows the parallelism as in Flink
        self._sinks: list[Transformation] = []
        self._dead_letter_channel: str | None = None  # set_error_policy("dead_letter", ...)
        self.engine_config = EngineConfig(preload=_FUNCTION_LIBRARIES)
        self._checkpoint_config = CheckpointConfig(self.engine_config)
        self._runtime_mode = RuntimeExecutionMode.STREAMING
        self._time_characteristic = TimeCharacteristic.EventTime
        self._execution_config = ExecutionConfig(self)
        self._restart_strategy = None
        self._state_backend: StateBackend | None = None
        self._python_files: list[str] = []
        self._buffer_timeout = 100  # Flink's default, in ms
        self._chaining = True
        self._executed: str | None = None  # the name of the latest job it ran: that took its sinks

    @staticmethod
    def get_execution_environment(configuration: Configuration | None = None) -> StreamExecutionEnvironment:
        """A new environment; ``configuration`` may set ``execution.runtime-mode``,
        ``parallelism.default`` and ``pipeline.max-parallelism`` (Flink's keys)."""
        env = StreamExecutionEnvironment()
        if configuration is not None:
            mode = configuration.get_string("execution.runtime-mode", "STREAMING").upper()
            if mode not in RuntimeExecutionMode.__members__:
                raise ValueError(
                    f"execution.runtime-mode must be STREAMING, BATCH or AUTOMATIC, got {mode!r}"
                )
            env.set_runtime_mode(RuntimeExecutionMode[mode])
            mp = configuration.get_integer("pipeline.max-parallelism", -1)
            if mp > 0:
                env.set_max_parallelism(mp)
            p = configuration.get_integer("parallelism.default", -1)
            if p > 0:
                env.set_parallelism(p)
        return env

    # ---- configuration -----------------------------------------------------------------
    def set_parallelism(self, parallelism: int) -> StreamExecutionEnvironment:
        self._fit_max_parallelism(parallelism)
        check_parallelism(parallelism, self._max_parallelism)
        self._parallelism = parallelism
        return self

    def _fit_max_parallelism(self, parallelism) -> None:
        """Unset, the max parallelism (the job's number of key groups) is Flink's default for the
        largest parallelism asked for."""
        if self._max_parallelism_set or not isinstance(parallelism, int) or parallelism < 1:
            return
        self._max_parallelism = max(default_max_parallelism(parallelism), self._max_parallelism)

    def get_parallelism(self) -> int:
        return self._parallelism

    def set_max_parallelism(self, max_parallelism: int) -> StreamExecutionEnvironment:
        check_max_parallelism(max_parallelism)
        if self._parallelism > max_parallelism:
            raise ValueError(
                f"max parallelism {max_parallelism} is below the parallelism {self._parallelism}"
            )
        self._max_parallelism = max_parallelism
        self._max_parallelism_set = True
        return self

    def get_max_parallelism(self) -> int:
        return self._max_parallelism

    def set_runtime_mode(self, execution_mode: RuntimeExecutionMode) -> StreamExecutionEnvironment:
        """STREAMING (the default), BATCH or AUTOMATIC, as in Flink. In BATCH mode (and in
        AUTOMATIC, which is BATCH here when every source is bounded) the rolling reductions
        (reduce, sum, min, max, min_by, max_by) emit only each key's final value, at the end of
        input; process functions run per record, and their timers (event and processing time)
        fire at the end of input: processing time stands still until then, as in Flink."""
        if not isinstance(execution_mode, RuntimeExecutionMode):
            raise TypeError(f"expected a RuntimeExecutionMode, got {execution_mode!r}")
        self._runtime_mode = execution_mode
        return self

    def get_config(self) -> ExecutionConfig:
        return self._execution_config

    def set_stream_time_characteristic(
        self, characteristic: TimeCharacteristic
    ) -> StreamExecutionEnvironment:
        """Accepted for PyFlink programs (deprecated there): event time is used wherever records
        carry timestamps, processing time by processing-time windows and timers."""
        if not isinstance(characteristic, TimeCharacteristic):
            raise TypeError(f"expected a TimeCharacteristic, got {characteristic!r}")
        self._time_characteristic = characteristic
        return self

    def get_stream_time_characteristic(self) -> TimeCharacteristic:
        return self._time_characteristic

    def add_python_file(self, file_path: str) -> StreamExecutionEnvironment:
        """Make a Python file, package directory or archive importable by the job's functions.
        Workers are forked from this process, so adding it to ``sys.path`` here reaches them."""
        path = os.path.abspath(file_path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"add_python_file: no such file or directory: {file_path!r}")
        entry = (
            path if os.path.isdir(path) or path.endswith((".zip", ".egg", ".whl")) else os.path.dirname(path)
        )
        if entry not in sys.path:
            sys.path.append(entry)
        self._python_files.append(path)
        return self

    def set_buffer_timeout(self, timeout_millis: int) -> StreamExecutionEnvironment:
        """Recorded only: records leave a step in the batches it makes (the gate, not network
        buffers, carries them), so there is no flush interval to set."""
        if not isinstance(timeout_millis, int) or timeout_millis < -1:
            raise ValueError(f"timeout_millis must be an int >= -1, got {timeout_millis!r}")
        self._buffer_timeout = timeout_millis
        return self

    def get_buffer_timeout(self) -> int:
        return self._buffer_timeout

    def disable_operator_chaining(self) -> StreamExecutionEnvironment:
        """Recorded only: stateless steps always run in the instance that produces their input."""
        self._chaining = False
        return self

    def is_chaining_enabled(self) -> bool:
        return self._chaining

    def set_restart_strategy(self, restart_strategy_configuration) -> StreamExecutionEnvironment:
        """Recorded only: a checkpointed job recovers its lost workers from the latest checkpoint."""
        self._restart_strategy = restart_strategy_configuration
        return self

    def get_restart_strategy(self):
        return self._restart_strategy

    def set_state_backend(self, state_backend: StateBackend) -> StreamExecutionEnvironment:
        """Accepted for PyFlink programs: every backend is keyed state in shared memory here."""
        if not isinstance(state_backend, StateBackend):
            raise TypeError(f"expected a state backend such as HashMapStateBackend(), got {state_backend!r}")
        self._state_backend = state_backend
        return self

    def get_state_backend(self) -> StateBackend | None:
        return self._state_backend

    def get_execution_plan(self) -> str:
        """The job graph as JSON, in the shape of Flink's (nodes with id, type, pact, contents,
        parallelism and predecessors with their ship strategy)."""
        return json.dumps(execution_plan(self._sinks, self._parallelism), indent=2)

    def enable_elasticity(
        self,
        policy=None,
        min_parallelism: int = 1,
        max_parallelism: int | None = None,
        interval_ms: int = 1000,
        cooldown_ms: int = 3000,
        operators: list[str] | None = None,
    ) -> StreamExecutionEnvironment:
        """Let the job rescale its keyed operators by itself (beyond PyFlink).

        Every ``interval_ms`` the controller measures each operator (or those named in
        ``operators``) and applies ``policy`` (default ``stretch.elasticity.ThresholdPolicy()``),
        keeping parallelism within [min_parallelism, max_parallelism] and waiting ``cooldown_ms``
        after each rescale before judging the operator again. The shipped policies judge a window
        of two intervals, act only if the predicted busy fraction after a change stays inside
        their band (no rescale back and forth under a steady load), and do not widen past a
        parallelism that measured no more throughput; their rules: ``stretch.elasticity``.
        """

        hi = (
            max_parallelism
            if max_parallelism is not None
            else min(4 * (os.cpu_count() or 1), self._max_parallelism)
        )
        if not 1 <= min_parallelism <= hi <= self._max_parallelism:
            raise ValueError(
                f"need 1 <= min_parallelism ({min_parallelism}) <= max_parallelism ({hi}) <= "
                f"the job's max parallelism ({self._max_parallelism})"
            )
        if policy is not None and not callable(getattr(policy, "decide", None)):
            raise TypeError("policy must have a decide(load) -> int method (see stretch.elasticity)")
        self.engine_config.elasticity = ElasticityConfig(
            policy or ThresholdPolicy(), min_parallelism, hi, interval_ms, cooldown_ms, operators
        )
        return self

    def enable_metrics(self, port: int = 0, host: str = "127.0.0.1") -> StreamExecutionEnvironment:
        """Serve the job's metrics for Prometheus at ``http://host:port/metrics`` (port 0: any free
        one; ``stretch jobs --json`` shows it, as the ``metrics`` of the job's entry). Loopback
        unless told otherwise; ``stretch metrics JOB`` prints the same without any endpoint.
        Instance counters cover every instance slot ever used, so operator totals never go down
        on a rescale."""

        require_prometheus()  # fail here, not when the job starts, without the metrics extra
        self.engine_config.metrics = (host, int(port))
        return self

    def enable_checkpointing(
        self, interval: int | None = None, mode: CheckpointingMode | None = None
    ) -> StreamExecutionEnvironment:
        """Take a checkpoint every ``interval`` ms (None, beyond PyFlink: only when triggered),
        making the job fault tolerant: a worker that dies is recovered from the latest checkpoint,
        and the job's sinks and output channels publish each result exactly once, when the
        checkpoint covering it completes. Sources must be replayable (every built-in source and
        durable channel is). More settings: ``get_checkpoint_config()``.
        """
        if interval is not None:
            self._checkpoint_config.set_checkpoint_interval(interval)
        if mode is not None:
            self._checkpoint_config.set_checkpointing_mode(mode)
        self.engine_config.checkpointing = True
        return self

    def get_checkpoint_config(self) -> CheckpointConfig:
        return self._checkpoint_config

    def get_checkpoint_interval(self) -> int:
        return self._checkpoint_config.get_checkpoint_interval()

    def get_checkpointing_mode(self) -> CheckpointingMode:
        return self._checkpoint_config.get_checkpointing_mode()

    def set_error_policy(
        self, policy: str, dead_letter_channel: str = "dead-letters"
    ) -> StreamExecutionEnvironment:
        """What a record that a user function raises on does to the job (beyond PyFlink).

        ``"fail"`` (the default): the job fails with an error naming the operator, the function,
        the key and the record, and the user's traceback. ``"dead_letter"``: the record, the error
        and the time go to the output channel ``dead_letter_channel`` (read it like any channel)
        and the job goes on. It covers map, flat_map, filter, key selectors and process_element.
        """
        if policy == "fail":
            self._dead_letter_channel = None
        elif policy == "dead_letter":
            self._dead_letter_channel = check_channel_name(dead_letter_channel)
        else:
            raise ValueError(f"policy must be 'fail' or 'dead_letter', got {policy!r}")
        return self

    def is_checkpointing_enabled(self) -> bool:
        return self.engine_config.checkpointing

    # ---- sources -----------------------------------------------------------------------
    def _source(self, source: Source, name: str, type_info=None, watermark_strategy=None) -> DataStream:
        spec = {"source": source, "watermark_strategy": watermark_strategy}
        t = Transformation("source", [], name, spec, type_info)
        t.parallelism = 1
        return DataStream(self, t)

    def from_collection(self, collection, type_info: TypeInformation | None = None) -> DataStream:
        """A bounded stream of the given records; they are checked against ``type_info`` here."""
        batch = to_batch(list(collection), type_info)
        if type_info is None:
            batch = batch.replace_schema_metadata(
                {**(batch.schema.metadata or {}), b"stretch.inferred": b"1"}
            )
        return self._source(_CollectionSource(batch), "Collection Source", type_info)

    def from_source(
        self, source, watermark_strategy=None, source_name: str = "Source", type_info=None
    ) -> DataStream:
        if not isinstance(source, Source):
            raise TypeError(f"from_source expects a stretch Source, got {source!r}")
        return self._source(source, source_name, type_info or source.type_info, watermark_strategy)

    def from_arrow(self, data, source_name: str = "Arrow Source") -> DataStream:
        """Beyond PyFlink: a pyarrow Table or batches as a stream of Rows, without per-record work."""
        return self._source(ArrowSource(data), source_name)

    # ---- execution -----------------------------------------------------------------------
    def _add_sink(self, t: Transformation) -> None:
        self._sinks.append(t)

    def _take_sinks(self, job_name: str, needed: bool = True) -> list[Transformation]:
        """The sinks defined since the last job: a job takes its graph along, as in Flink (one that
        brings a sink of its own, execute_and_collect's, ``needed`` no others)."""
        sinks, self._sinks = self._sinks, []
        if needed and not sinks and self._executed is not None:
            raise RuntimeError(
                "No operators defined in streaming topology. Cannot execute: this environment already "
                f"ran job {self._executed!r}, and a job takes the sources, operators and sinks defined "
                "before it (as in Flink). Define the pipeline again before executing again, or follow "
                "the running job with the JobClient that execute_async() returned"
            )
        if sinks or not needed:
            self._executed = job_name
        return sinks

    def _compile(self, sinks: list[Transformation], restore: bool | None = None):
        """The job's plan and a snapshot of the engine configuration to run it with."""
        dead_letters = ChannelSink(self._dead_letter_channel) if self._dead_letter_channel else None
        batch = self._runtime_mode is not RuntimeExecutionMode.STREAMING and in_batch_mode(
            sinks, self._runtime_mode is RuntimeExecutionMode.BATCH
        )
        plan = compile_plan(sinks, self._parallelism, self._max_parallelism, dead_letters)
        for stage in plan.stages:
            stage.batch = batch
        plan.job_parameters = self._execution_config.get_global_job_parameters()
        if restore is None:
            restore = os.environ.get(RESTORE_ENV) == "1"
        if restore and not self.engine_config.checkpointing:
            raise RestoreRefused("restore needs checkpointing: call env.enable_checkpointing() first")
        config = dataclasses.replace(  # a snapshot: later changes to the environment leave the job be
            self.engine_config, restore=restore, checkpoint=dataclasses.replace(self.engine_config.checkpoint)
        )
        config.restore_code = os.environ.get(RESTORE_CODE_ENV, config.restore_code)
        return plan, config

    def _submit(
        self, sinks: list[Transformation], job_name: str | None, restore: bool | None = None
    ) -> tuple[Coordinator, JobClient]:
        plan, config = self._compile(sinks, restore)
        coordinator = Coordinator(plan, job_name or DEFAULT_JOB_NAME, config)
        return coordinator, JobClient(coordinator)

    def execute_async(
        self, job_name: str = DEFAULT_JOB_NAME, restore: bool | None = None, cluster=None, ui=False
    ):
        """Start the job and return at once; the JobClient follows, rescales or cancels it.

        ``restore``: start from the latest complete checkpoint of the job of this name (a job whose
        process died), at this job's parallelism. Default: ``stretch run --restore`` sets it.
        ``cluster``: a ``stretch.cluster.StretchCluster``; the job runs on each of its nodes, for
        the key groups the node owns, and the cluster's job client is returned.
        ``ui``: serve the job's web page from this process while it runs (True: a free loopback
        port; a port number; or a ``stretch.ui.UIConfig``); ``client.ui_url`` is its address
        with the secret that lets a browser rescale. Needs the ``ui`` extra.
        """
        sinks = self._take_sinks(job_name)
        if cluster is not None:
            if ui is not False:
                raise ValueError(
                    "a cluster job is shown by its cluster's UI: StretchCluster.local(..., ui=True)"
                )
            plan, config = self._compile(sinks, restore)
            return cluster.submit(plan, job_name, config)
        _, client = self._submit(sinks, job_name, restore)
        if ui is not False:
            client._serve_ui(UIConfig.of(ui))
        try:
            return client._start()
        except BaseException:
            if client._ui is not None:
                client._ui.stop()
            raise

    def execute(self, job_name: str | None = None, restore: bool | None = None) -> JobExecutionResult:
        """Run the job to completion (bounded inputs) and return its result; raises if it fails."""
        client = self.execute_async(job_name or DEFAULT_JOB_NAME, restore)
        try:
            client.wait()
        except KeyboardInterrupt:
            client.cancel()
            raise
        return client.get_job_execution_result().result()

    def _execute_collect(self, sink: Transformation, job_name: str | None) -> CloseableIterator:
        sinks = [*self._take_sinks(job_name or DEFAULT_JOB_NAME, needed=False), sink]
        coordinator, client = self._submit(sinks, job_name)
        sink_id = next(s.id for s in coordinator.plan.sinks if s.sink is sink.spec["sink"])
        client._start()
        return CloseableIterator(client, sink_id)

    def close(self) -> None:
        self._sinks = []
