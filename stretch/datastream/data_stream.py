"""DataStream and KeyedStream, with PyFlink's names: each call records a transformation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stretch.common.typeinfo import TupleTypeInfo, TypeInformation, Types
from stretch.common.watermark_strategy import WatermarkStrategy
from stretch.common.wording import a, not_a_class
from stretch.contracts.connectors import Sink
from stretch.contracts.evictors import Evictor
from stretch.contracts.functions import (
    AggregateFunction,
    FilterFunction,
    FlatMapFunction,
    Function,
    KeyedProcessFunction,
    KeySelector,
    MapFunction,
    ProcessFunction,
    ProcessWindowFunction,
    ReduceFunction,
)
from stretch.contracts.output_tag import OutputTag
from stretch.contracts.triggers import Trigger
from stretch.contracts.window import (
    CountSlidingWindowAssigner,
    CountTumblingWindowAssigner,
    GlobalWindows,
    SlidingEventTimeWindows,
    TumblingEventTimeWindows,
    WindowAssigner,
    to_millis,
)
from stretch.datastream import aggregates
from stretch.datastream import keyed_functions as kf
from stretch.datastream.aggregates import as_builtins
from stretch.datastream.all_windowed_stream import AllWindowedStream
from stretch.datastream.broadcast_stream import BroadcastConnectedStream, BroadcastStream
from stretch.datastream.connected_streams import ConnectedStreams
from stretch.datastream.connectors.print_sink import CollectSink, PrintSink
from stretch.datastream.field_checks import check_fields
from stretch.datastream.join import BandJoinedStreams, CoGroupedStreams, IntervalJoin, JoinedStreams
from stretch.datastream.triggered_windows import TriggeredWindowOperator
from stretch.datastream.windowing import WindowOperator
from stretch.plan.graph import Transformation
from stretch.plan.specs import VectorWindowSpec

if TYPE_CHECKING:
    from stretch.datastream.stream_execution_environment import StreamExecutionEnvironment


def _check_function(func, cls, what: str):
    if (wrong := not_a_class(func, Function)) is not None:  # map(AMap): AMap() was meant
        raise TypeError(f"{what}: {wrong}")
    if isinstance(func, cls) or callable(func):
        return func
    raise TypeError(f"The input must be {a(cls.__name__)} or a callable function! ({what} got {func!r})")


class DataStream:
    """A stream of records; transformations return new streams, nothing runs until execute()."""

    _is_keyed = False  # a KeyedStream's is True: connected, two keyed streams make a keyed operator

    def __init__(self, env: StreamExecutionEnvironment, transformation: Transformation):
        self._env = env
        self._t = transformation

    # ---- naming and parallelism ---------------------------------------------------------
    def name(self, name: str) -> DataStream:
        self._t.name = name
        return self

    def get_name(self) -> str:
        return self._t.name

    def uid(self, uid: str) -> DataStream:
        self._t.uid = uid
        return self

    def set_description(self, description: str) -> DataStream:
        return self

    def set_parallelism(self, parallelism: int) -> DataStream:
        """Instances of this operator; stateless steps run chained inside their producer's instances."""
        if not self._t.max_parallelism:
            self._env._fit_max_parallelism(parallelism)
        mp = self._t.max_parallelism or self._env.get_max_parallelism()
        check_parallelism(parallelism, mp)
        self._t.parallelism = parallelism
        return self

    def set_max_parallelism(self, max_parallelism: int) -> DataStream:
        check_max_parallelism(max_parallelism)
        if self._t.parallelism and self._t.parallelism > max_parallelism:
            raise ValueError(
                f"max parallelism {max_parallelism} is below the parallelism {self._t.parallelism}"
            )
        self._t.max_parallelism = max_parallelism
        return self

    def get_type(self) -> TypeInformation | None:
        return self._t.output_type

    def get_execution_environment(self) -> StreamExecutionEnvironment:
        return self._env

    def force_non_parallel(self) -> DataStream:
        return self.set_parallelism(1)

    def disable_chaining(self) -> DataStream:
        return self

    def set_buffer_timeout(self, timeout_millis: int) -> DataStream:
        """Accepted for PyFlink programs: there are no network buffers to flush (see the env's)."""
        if not isinstance(timeout_millis, int) or timeout_millis < -1:
            raise ValueError(f"timeout_millis must be an int >= -1, got {timeout_millis!r}")
        return self

    def start_new_chain(self) -> DataStream:
        return self

    def slot_sharing_group(self, slot_sharing_group) -> DataStream:
        """Recorded only: every instance is a worker process of its own."""
        self._t.spec["slot_sharing_group"] = slot_sharing_group
        return self

    # ---- stateless steps -----------------------------------------------------------------
    def _then(self, kind: str, name: str, spec: dict, output_type=None) -> DataStream:
        return DataStream(self._env, Transformation(kind, [self._t], name, spec, output_type))

    def map(self, func, output_type: TypeInformation | None = None) -> DataStream:
        return self._then("map", "Map", {"fn": _check_function(func, MapFunction, "map")}, output_type)

    def flat_map(self, func, output_type: TypeInformation | None = None) -> DataStream:
        return self._then(
            "flat_map", "FlatMap", {"fn": _check_function(func, FlatMapFunction, "flat_map")}, output_type
        )

    def filter(self, func) -> DataStream:
        return self._then(
            "filter", "Filter", {"fn": _check_function(func, FilterFunction, "filter")}, self._t.output_type
        )

    def process(self, func: ProcessFunction, output_type: TypeInformation | None = None) -> DataStream:
        if not isinstance(func, ProcessFunction):
            raise TypeError("ProcessFunction is required for DataStream.")
        return self._then("stateless_process", "Process", {"fn": func}, output_type)

    def assign_timestamps_and_watermarks(self, watermark_strategy) -> DataStream:
        """Event timestamps and watermarks for this stream, from a WatermarkStrategy.

        Beyond PyFlink, the strategy's timestamp assigner may be a field name: the timestamps are
        then read as a column (epoch milliseconds or an Arrow timestamp), with no Python call per
        record.
        """

        if not isinstance(watermark_strategy, WatermarkStrategy):
            raise TypeError(f"expected a WatermarkStrategy, got {watermark_strategy!r}")
        return self._then("assign", "Timestamps/Watermarks", {"fn": watermark_strategy}, self._t.output_type)

    def union(self, *streams: DataStream) -> DataStream:
        inputs = [self._t] + [s._values()._t if isinstance(s, KeyedStream) else s._t for s in streams]
        return DataStream(self._env, Transformation("union", inputs, "Union", {}, self._t.output_type))

    # ---- partitioning ----------------------------------------------------------------------
    # Flink's partitioning calls choose which instance of the next operator gets each record. In
    # stretch a stateless step runs chained in the instance that produced its input, and records
    # cross processes only at a key_by, into the one gate every instance of the keyed operator
    # reads (each taking its key groups). There is no per-instance channel to pick, so these are
    # no-ops that return the same records: balance comes from key groups and live rescaling.
    def shuffle(self) -> DataStream:
        """No-op here (records are not sent to a chosen instance); see the note above."""
        return self

    def rebalance(self) -> DataStream:
        """No-op here: see ``shuffle``."""
        return self

    def rescale(self) -> DataStream:
        """No-op here: see ``shuffle``."""
        return self

    def broadcast(self, *broadcast_state_descriptors) -> DataStream | BroadcastStream:
        """With MapStateDescriptors: a BroadcastStream, to ``connect`` to another stream (broadcast
        state). Without: Flink's partitioning call that sends every record to every instance of the
        next operator, a no-op here as ``shuffle`` is (see the note above)."""
        if broadcast_state_descriptors:
            return BroadcastStream(self._values(), broadcast_state_descriptors)
        return self

    def forward(self) -> DataStream:
        """What stretch does anyway: a stateless step runs in its producer's instance."""
        return self

    def partition_custom(self, partitioner, key_selector) -> DataStream:
        """Checked as in PyFlink, then a no-op (see ``shuffle``): the records are unchanged."""
        if not callable(getattr(partitioner, "partition", partitioner)):
            raise TypeError("Parameter partitioner should be type of Partitioner or a callable function.")
        if not (isinstance(key_selector, KeySelector) or callable(key_selector)):
            raise TypeError("Parameter key_selector should be type of KeySelector or a callable function.")
        return self

    def project(self, *field_indexes: int) -> DataStream:
        """The given fields of each tuple, in that order (Tuple streams only, as in PyFlink)."""
        in_type = self._t.output_type
        if not isinstance(in_type, TupleTypeInfo):
            raise Exception("Only Tuple DataStreams can be projected.")
        types = in_type.get_field_types()
        for i in field_indexes:
            if not isinstance(i, int) or not 0 <= i < len(types):
                raise IndexError(f"project: field index {i!r} is out of range for {len(types)} fields")
        out_type = Types.TUPLE([types[i] for i in field_indexes])
        return self._then("map", "Projection", {"fn": kf.Project(list(field_indexes))}, out_type)

    # ---- joins (stretch.datastream.join) -----------------------------------------------------
    def join(self, other_stream: DataStream):
        """Window join: ``.where(key).equal_to(key).window(assigner).apply(join_function)``."""

        return JoinedStreams(self, other_stream)

    def co_group(self, other_stream: DataStream):
        """Window co-group: ``.where(key).equal_to(key).window(assigner).apply(co_group_function)``."""

        return CoGroupedStreams(self, other_stream)

    def connect(self, data_stream):
        """Two streams into one operator, each input with its own method (see ConnectedStreams);
        with a BroadcastStream, a BroadcastConnectedStream (see ``process`` there)."""
        if isinstance(data_stream, BroadcastStream):
            return BroadcastConnectedStream(self, data_stream)
        return ConnectedStreams(self, data_stream)

    def window_all(self, window_assigner) -> AllWindowedStream:
        """Windows over the whole stream, not per key: one instance sees every element, as in Flink."""
        return AllWindowedStream(self._values(), window_assigner)

    def count_window_all(self, size: int, slide: int = 0) -> AllWindowedStream:
        """Windows of ``size`` records of the whole stream (sliding by ``slide`` records if given),
        at one instance, as PyFlink's: ``window_all`` with a count window assigner."""
        if slide:
            return self.window_all(CountSlidingWindowAssigner(size, slide))
        return self.window_all(CountTumblingWindowAssigner(size))

    def band_join(self, other_stream: DataStream):
        """Beyond PyFlink, a non-equi time-band join: ``.on(predicate).within(ms).apply(fn)``."""

        return BandJoinedStreams(self, other_stream)

    # ---- keying --------------------------------------------------------------------------
    def key_by(self, key_selector, key_type: TypeInformation | None = None) -> KeyedStream:
        """Partition by key. Beyond PyFlink, a field name or position selects a field directly,
        which keeps the whole path vectorized (no Python call per record)."""
        spec: dict[str, Any] = {"key_type": key_type}
        if isinstance(key_selector, (str, int)) and not isinstance(key_selector, bool):
            check_fields(self._t.output_type, [key_selector], "key_by")
            spec["field"] = key_selector
        elif isinstance(key_selector, KeySelector) or callable(key_selector):
            spec["selector"] = key_selector
        else:
            raise TypeError(
                "Parameter key_selector should be type of KeySelector, a callable function, or a field"
            )
        return KeyedStream(
            self._env, Transformation("key_by", [self._t], "KeyBy", spec, self._t.output_type), self
        )

    # ---- sinks ---------------------------------------------------------------------------
    def sink_to(self, sink: Sink) -> DataStreamSink:
        return self._sink(sink, "sink_to")

    def add_sink(self, sink_func: Sink) -> DataStreamSink:
        return self._sink(sink_func, "add_sink")

    def _sink(self, sink: Sink, method: str) -> DataStreamSink:
        if (wrong := not_a_class(sink, Sink)) is not None:
            raise TypeError(f"{method}: {wrong}")
        if not isinstance(sink, Sink):
            raise TypeError(f"{method} expects a stretch Sink (stretch.datastream.connectors), got {sink!r}")
        t = Transformation("sink", [self._t], type(sink).__name__, {"sink": sink})
        self._env._add_sink(t)
        return DataStreamSink(t)

    def print(self, sink_identifier: str | None = None) -> DataStreamSink:
        return self.sink_to(PrintSink(sink_identifier)).name("Print to Std. Out")

    def execute_and_collect(self, job_execution_name: str | None = None, limit: int | None = None):
        """Run the job and iterate its results here (a CloseableIterator; a list if ``limit``)."""
        t = Transformation("sink", [self._t], "Collect", {"sink": CollectSink()})
        iterator = self._env._execute_collect(t, job_execution_name)
        if limit is None:
            return iterator
        out = []
        with iterator:
            for item in iterator:
                if len(out) >= limit:
                    break
                out.append(item)
        return out

    def _values(self) -> DataStream:
        return self

    def get_side_output(self, output_tag) -> DataStream:
        """The records this operator yielded as ``(output_tag, value)`` (late window data too)."""

        if not isinstance(output_tag, OutputTag):
            raise TypeError(f"expected an OutputTag, got {output_tag!r}")
        spec = {"tag": output_tag}
        return DataStream(
            self._env,
            Transformation(
                "side_output", [self._t], f"SideOutput({output_tag.tag_id})", spec, output_tag.type_info
            ),
        )


class WindowedStream:
    """A keyed stream cut into windows; reduce/aggregate/process/apply say what each one yields."""

    def __init__(self, keyed: KeyedStream, assigner):
        self._keyed = keyed
        self._assigner = assigner
        self._lateness = 0
        self._late_tag = None
        self._trigger = None
        self._evictor = None

    def allowed_lateness(self, time_ms: int) -> WindowedStream:
        """Keep windows this long after the watermark passed them; late records re-fire them."""

        self._lateness = to_millis(time_ms, "allowed lateness")
        if self._lateness < 0:
            raise ValueError("allowed lateness must not be negative")
        return self

    def side_output_late_data(self, output_tag) -> WindowedStream:
        """Records too late for every window they belong to go to this side output."""
        self._late_tag = output_tag
        return self

    def trigger(self, trigger: Trigger) -> WindowedStream:
        """When a window fires (and purges): instead of the assigner's default trigger."""
        self._trigger = trigger
        return self

    def evictor(self, evictor: Evictor) -> WindowedStream:
        """Elements removed from a window's pane before and/or after its function runs."""
        self._evictor = evictor
        return self

    def _window(self, mode: str, fn, window_fn, output_type, name: str) -> DataStream:
        a = self._assigner
        if self._trigger is not None or self._evictor is not None or isinstance(a, GlobalWindows):
            op = TriggeredWindowOperator(
                a, mode, fn, window_fn, self._lateness, self._late_tag, self._trigger, self._evictor
            )
            return self._keyed._keyed("process", f"Window({name})", {"fn": op}, output_type)
        op = WindowOperator(self._assigner, mode, fn, window_fn, self._lateness, self._late_tag)
        return self._keyed._keyed("process", f"Window({name})", {"fn": op}, output_type)

    def reduce(self, reduce_function, window_function=None, output_type=None) -> DataStream:
        f = (
            reduce_function
            if isinstance(reduce_function, ReduceFunction)
            else _check_function(reduce_function, ReduceFunction, "reduce")
        )
        out_type = output_type if window_function is not None else (output_type or self._keyed._t.output_type)
        return self._window("reduce", f, window_function, out_type, "reduce")

    def aggregate(
        self, aggregate_function, window_function=None, accumulator_type=None, output_type=None
    ) -> DataStream:
        """An AggregateFunction per window, or built-ins (``stretch.datastream.aggregates``):
        ``aggregate([aggregates.count(), aggregates.sum("price")])``, vectorized where possible."""

        builtins = as_builtins(aggregate_function)
        if builtins is not None:
            if window_function is not None:
                raise TypeError(
                    "built-in aggregates yield Row(key, window_start, window_end, ...) themselves"
                )
            return self._builtins(builtins)
        if not isinstance(aggregate_function, AggregateFunction):
            raise TypeError("The input must be a pyflink.datastream.functions.AggregateFunction!")
        return self._window("aggregate", aggregate_function, window_function, output_type, "aggregate")

    def count(self) -> DataStream:
        """Records per key and window: Row(key, window_start, window_end, count)."""

        return self._builtins([aggregates.count()])

    def sum(self, field: str | int) -> DataStream:

        return self._builtins([aggregates.sum(field)])

    def min(self, field: str | int) -> DataStream:

        return self._builtins([aggregates.min(field)])

    def max(self, field: str | int) -> DataStream:

        return self._builtins([aggregates.max(field)])

    def mean(self, field: str | int) -> DataStream:

        return self._builtins([aggregates.mean(field)])

    def _builtins(self, builtins: list) -> DataStream:
        """Built-in aggregates: numba kernels when keyed by a field over tumbling or sliding
        event-time windows without lateness, else the per-record window operator."""

        key_by = self._keyed._t
        in_type = key_by.output_type
        out_type = aggregates.output_type(
            builtins,
            key_by.spec.get("key_type") or _field_type(in_type, key_by.spec.get("field")),
            lambda f: _field_type(in_type, f),
        )
        name = f"Window({', '.join(map(repr, builtins))})"
        a = self._assigner
        vectorized = (
            "field" in key_by.spec
            and type(a) in (TumblingEventTimeWindows, SlidingEventTimeWindows)
            and self._lateness == 0
            and self._trigger is None
            and self._evictor is None
        )
        if not vectorized:
            op = aggregates.BuiltinAggregates(builtins)
            return self._window("aggregate", op, aggregates.AsRow(builtins), out_type, name)
        slide = getattr(a, "slide", a.size)
        spec = VectorWindowSpec(a.size, slide, a.offset, builtins, self._late_tag)
        return self._keyed._keyed("vector_window", name, {"fn": spec}, out_type)

    def process(self, process_window_function, output_type=None) -> DataStream:

        if not isinstance(process_window_function, ProcessWindowFunction):
            raise TypeError("process() needs a ProcessWindowFunction")
        return self._window("list", None, process_window_function, output_type, "process")

    def apply(self, window_function, output_type=None) -> DataStream:
        return self._window("list", None, window_function, output_type, "apply")


class DataStreamSink:
    """Returned by sink_to/print; names the sink."""

    def __init__(self, transformation: Transformation):
        self._t = transformation

    def name(self, name: str) -> DataStreamSink:
        self._t.name = name
        return self

    def uid(self, uid: str) -> DataStreamSink:
        self._t.uid = uid
        return self

    def set_parallelism(self, parallelism: int) -> DataStreamSink:
        return self

    def set_description(self, description: str) -> DataStreamSink:
        return self


class KeyedStream(DataStream):
    """A stream partitioned by key: keyed state, process functions and rolling aggregates."""

    _is_keyed = True

    def __init__(self, env, transformation: Transformation, original: DataStream):
        super().__init__(env, transformation)
        self._original = original

    def _values(self) -> DataStream:
        return self._original

    def _keyed(self, kind: str, name: str, spec: dict, output_type=None) -> DataStream:
        t = Transformation(kind, [self._t], name, spec, output_type)
        return DataStream(self._env, t)

    def process(self, func: KeyedProcessFunction, output_type: TypeInformation | None = None) -> DataStream:
        if not isinstance(func, KeyedProcessFunction):
            raise TypeError("KeyedProcessFunction is required for KeyedStream.")
        return self._keyed("process", "KeyedProcess", {"fn": func}, output_type)

    def map(self, func, output_type: TypeInformation | None = None) -> DataStream:
        f = _check_function(func, MapFunction, "map")
        return self._keyed("process", "Map", {"fn": kf.KeyedMap(f)}, output_type)

    def flat_map(self, func, output_type: TypeInformation | None = None) -> DataStream:
        f = _check_function(func, FlatMapFunction, "flat_map")
        return self._keyed("process", "FlatMap", {"fn": kf.KeyedFlatMap(f)}, output_type)

    def filter(self, func) -> DataStream:
        f = _check_function(func, FilterFunction, "filter")
        return self._keyed("process", "Filter", {"fn": kf.KeyedFilter(f)}, self._t.output_type)

    def reduce(self, func) -> DataStream:
        """Rolling reduce: one output per input, the reduction of the key's records so far."""
        f = _check_function(func, ReduceFunction, "reduce")
        return self._keyed("process", "Keyed Reduce", {"fn": kf.RollingReduce(f)}, self._t.output_type)

    def _aggregate(self, op: str, fields, name: str) -> DataStream:
        fields = list(fields) if isinstance(fields, (list, tuple)) else [fields]
        if not fields or not all(isinstance(f, (int, str)) and not isinstance(f, bool) for f in fields):
            raise TypeError(f"{op} takes a field position or name (or a list of them), got {fields!r}")
        check_fields(self._t.output_type, fields, op, numeric=op == "sum")
        spec = {"op": op, "fields": fields, "fn": kf.RollingAggregate(op, fields)}
        return self._keyed("aggregate", name, spec, self._t.output_type)

    def sum(self, position_to_sum: int | str | list = 0) -> DataStream:
        """Rolling sum of a field (or, beyond PyFlink, of several fields at once)."""
        return self._aggregate("sum", position_to_sum, "Sum")

    def min(self, position_to_min: int | str | list = 0) -> DataStream:
        return self._aggregate("min", position_to_min, "Min")

    def max(self, position_to_max: int | str | list = 0) -> DataStream:
        return self._aggregate("max", position_to_max, "Max")

    def min_by(self, position_to_min_by: int | str = 0) -> DataStream:
        fn = kf.RollingReduce(kf.by_reducer("min_by", position_to_min_by))
        return self._keyed("process", "MinBy", {"fn": fn}, self._t.output_type)

    def max_by(self, position_to_max_by: int | str = 0) -> DataStream:
        fn = kf.RollingReduce(kf.by_reducer("max_by", position_to_max_by))
        return self._keyed("process", "MaxBy", {"fn": fn}, self._t.output_type)

    def key_by(self, key_selector, key_type: TypeInformation | None = None) -> KeyedStream:
        return self._original.key_by(key_selector, key_type)

    def window(self, window_assigner) -> WindowedStream:
        """Group each key's records into windows (event-time, processing-time or session)."""

        if not isinstance(window_assigner, WindowAssigner):
            raise TypeError(
                f"expected a window assigner such as TumblingEventTimeWindows.of(...), got {window_assigner!r}"
            )
        return WindowedStream(self, window_assigner)

    def interval_join(self, other_stream: KeyedStream):
        """Interval join with another keyed stream: ``.between(lower, upper).process(fn)``."""

        if not isinstance(other_stream, KeyedStream):
            raise TypeError("interval_join needs a KeyedStream (other.key_by(...))")
        return IntervalJoin(self, other_stream)

    def count_window(self, size: int, slide: int = 0) -> WindowedStream:
        """Windows of ``size`` records per key (sliding by ``slide`` records if given)."""

        assigner = CountSlidingWindowAssigner(size, slide) if slide else CountTumblingWindowAssigner(size)
        return WindowedStream(self, assigner)

    def name(self, name: str):
        raise Exception("Setting name is not allowed on a KeyedStream; name the operator that follows it")

    def uid(self, uid: str):
        raise Exception("Setting uid is not allowed on a KeyedStream")

    def set_parallelism(self, parallelism: int):
        raise Exception("Set parallelism for KeyedStream is not supported")

    def print(self, sink_identifier: str | None = None) -> DataStreamSink:
        return self._original.print()

    def sink_to(self, sink: Sink) -> DataStreamSink:
        return self._original.sink_to(sink)

    def add_sink(self, sink_func: Sink) -> DataStreamSink:
        return self._original.add_sink(sink_func)

    def execute_and_collect(self, job_execution_name: str | None = None, limit: int | None = None):
        """As in PyFlink, a KeyedStream's records come out as ``Row(f0=key, f1=value)``."""
        spec = self._t.spec
        with_keys = self._original.map(kf.KeyAndValue(spec.get("selector"), spec.get("field")))
        return with_keys.execute_and_collect(job_execution_name, limit)

    def union(self, *streams: DataStream) -> DataStream:
        return self._original.union(*streams)

    def project(self, *field_indexes: int) -> DataStream:
        return self._original.project(*field_indexes)

    def _no_partitioning(self, *args, **kwargs):
        raise Exception("Cannot override partitioning for KeyedStream.")

    def broadcast(self, *broadcast_state_descriptors):
        """A BroadcastStream of the records (with MapStateDescriptors); a partitioning call without."""
        if not broadcast_state_descriptors:
            self._no_partitioning()
        return self._original.broadcast(*broadcast_state_descriptors)

    shuffle = rebalance = rescale = forward = partition_custom = _no_partitioning  # type: ignore[assignment]


def check_max_parallelism(max_parallelism: int) -> None:
    if not isinstance(max_parallelism, int) or not 0 < max_parallelism <= 32768:
        raise ValueError(f"max parallelism must be an int in 1..32768, got {max_parallelism!r}")


def check_parallelism(parallelism: int, max_parallelism: int) -> None:
    if not isinstance(parallelism, int) or isinstance(parallelism, bool) or parallelism < 1:
        raise ValueError(f"parallelism must be a positive int, got {parallelism!r}")
    if parallelism > max_parallelism:
        raise ValueError(
            f"parallelism {parallelism} is above the max parallelism {max_parallelism} (the number "
            "of key groups): raise it with set_max_parallelism"
        )


def _field_type(type_info, field) -> TypeInformation | None:
    """The type of a record field given by position or name, where the record type says."""
    if type_info is None or field is None:
        return None
    types = getattr(type_info, "get_field_types", lambda: None)()
    if not types:
        return None
    if isinstance(field, int):
        return types[field] if 0 <= field < len(types) else None
    names = list(type_info.get_field_names()) if hasattr(type_info, "get_field_names") else []
    if field in names:
        return types[names.index(field)]
    if field[:1] == "f" and field[1:].isdigit() and int(field[1:]) < len(types):
        return types[int(field[1:])]
    return None
