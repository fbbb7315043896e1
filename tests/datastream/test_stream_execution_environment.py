"""The environment's PyFlink settings: accepted where stretch has one way, acted on where it matters."""

from __future__ import annotations

import pytest

from stretch import channels
from stretch.common import ExecutionConfig, RestartStrategies, Time, Types
from stretch.datastream import (
    HashMapStateBackend,
    SlotSharingGroup,
    StreamExecutionEnvironment,
    TimeCharacteristic,
)
from stretch.datastream.connectors.channel import ChannelSink


def test_get_config_reaches_the_environment():
    env = StreamExecutionEnvironment.get_execution_environment()
    config = env.get_config()
    assert isinstance(config, ExecutionConfig)
    config.set_parallelism(3).set_auto_watermark_interval(50).set_global_job_parameters({"a": 1})
    assert env.get_parallelism() == 3
    assert config.get_auto_watermark_interval() == 50
    assert config.get_global_job_parameters() == {"a": "1"}


def test_recorded_settings_and_their_checks():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_stream_time_characteristic(TimeCharacteristic.EventTime)
    assert env.get_stream_time_characteristic() is TimeCharacteristic.EventTime
    strategy = RestartStrategies.fixed_delay_restart(3, Time.seconds(1))
    env.set_restart_strategy(strategy)
    assert env.get_restart_strategy().restart_attempts == 3
    assert env.get_restart_strategy().delay_ms == 1000
    backend = HashMapStateBackend()
    assert env.set_state_backend(backend).get_state_backend() is backend
    with pytest.raises(TypeError):
        env.set_state_backend("rocksdb")
    with pytest.raises(TypeError):
        env.set_stream_time_characteristic("EventTime")
    group = SlotSharingGroup.builder("g").set_cpu_cores(1.0).set_task_heap_memory_mb(100).build()
    assert group.get_name() == "g" and group.get_task_heap_memory() == 100
    env.from_collection([1]).map(lambda x: x).slot_sharing_group(group).print()


def test_add_python_file_makes_a_module_importable_by_the_job(tmp_path):
    module = tmp_path / "porting_helper_mod.py"
    module.write_text("def triple(x):\n    return 3 * x\n")
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.add_python_file(str(module))

    def triple(x):
        import porting_helper_mod

        return porting_helper_mod.triple(x)

    out = env.from_collection(list(range(20))).key_by(lambda x: x % 3).map(triple, Types.LONG())
    assert sorted(out.execute_and_collect()) == [3 * x for x in range(20)]
    with pytest.raises(FileNotFoundError):
        env.add_python_file(str(tmp_path / "missing.py"))


@pytest.mark.parametrize("call", ["shuffle", "rebalance", "rescale", "forward"])
def test_partitioning_calls_keep_the_records(call):
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    ds = getattr(env.from_collection(list(range(50))), call)()
    out = ds.key_by(lambda x: x % 4).map(lambda x: x * 2, Types.LONG()).execute_and_collect()
    assert sorted(out) == [2 * x for x in range(50)]
    with pytest.raises(Exception, match="Cannot override partitioning for KeyedStream"):
        getattr(ds.key_by(lambda x: x), call)()


def test_partition_custom_is_checked_and_keeps_the_records():
    env = StreamExecutionEnvironment.get_execution_environment()
    ds = env.from_collection([1, 2, 3]).partition_custom(lambda key, n: key % n, lambda x: x)
    assert sorted(ds.execute_and_collect()) == [1, 2, 3]
    with pytest.raises(TypeError, match="partitioner"):
        env.from_collection([1]).partition_custom(5, lambda x: x)


def test_project_picks_tuple_fields():
    env = StreamExecutionEnvironment.get_execution_environment()
    typ = Types.TUPLE([Types.INT(), Types.STRING(), Types.DOUBLE()])
    ds = env.from_collection([(1, "a", 0.5), (2, "b", 1.5)], typ).project(2, 0)
    assert ds.get_type() == Types.TUPLE([Types.DOUBLE(), Types.INT()])
    assert sorted(ds.execute_and_collect()) == [(0.5, 1), (1.5, 2)]
    with pytest.raises(Exception, match="Only Tuple DataStreams can be projected"):
        env.from_collection([1, 2]).project(0)


def flinks_default_max_parallelism(parallelism: int) -> int:
    """Flink's KeyGroupRangeAssignment.computeDefaultMaxParallelism, written out."""
    wanted = parallelism + parallelism // 2
    power = 1
    while power < wanted:
        power *= 2
    return min(max(power, 128), 32768)


def test_unset_max_parallelism_follows_the_parallelism_as_in_flink():
    for parallelism in (1, 85, 86, 200, 341, 342, 30000):
        env = StreamExecutionEnvironment.get_execution_environment()
        env.set_parallelism(parallelism)  # Flink accepts any parallelism without a max parallelism
        assert env.get_max_parallelism() == flinks_default_max_parallelism(parallelism)
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.from_collection([1], Types.LONG()).key_by(lambda x: x).sum(0).set_parallelism(200)
    assert env.get_max_parallelism() == flinks_default_max_parallelism(200)
    env.set_parallelism(4)  # the max parallelism never falls below what an operator asked for
    assert env.get_max_parallelism() == flinks_default_max_parallelism(200)
    env = StreamExecutionEnvironment.get_execution_environment().set_max_parallelism(64)
    with pytest.raises(ValueError, match="above the max parallelism 64"):
        env.set_parallelism(65)  # set, it stays


def test_a_job_runs_with_the_key_groups_of_a_large_unset_max_parallelism():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(100)  # 256 key groups; the keyed operator itself runs at 2
    words = [f"w{i % 37}" for i in range(500)]
    ds = env.from_collection([(w, 1) for w in words], Types.TUPLE([Types.STRING(), Types.LONG()]))
    counts = ds.key_by(lambda r: r[0]).sum(1).set_parallelism(2)
    assert env.get_max_parallelism() == 256
    with counts.execute_and_collect() as results:
        final = {}
        for word, n in results:
            final[word] = max(n, final.get(word, 0))
    model = {}
    for w in words:
        model[w] = model.get(w, 0) + 1
    assert final == model


def test_buffer_timeout_and_chaining_are_recorded_for_pyflink_programs():
    env = StreamExecutionEnvironment.get_execution_environment()
    assert env.get_buffer_timeout() == 100 and env.is_chaining_enabled()  # Flink's defaults
    assert env.set_buffer_timeout(5).disable_operator_chaining() is env
    assert env.get_buffer_timeout() == 5 and not env.is_chaining_enabled()
    with pytest.raises(ValueError):
        env.set_buffer_timeout(-2)
    ds = env.from_collection([1, 2, 3], Types.LONG())
    doubled = ds.map(lambda x: 2 * x, Types.LONG()).set_buffer_timeout(0)
    with pytest.raises(ValueError):
        doubled.set_buffer_timeout(-5)
    with doubled.execute_and_collect() as results:  # the job runs as without them
        assert sorted(results) == [2 * x for x in (1, 2, 3)]


def test_a_second_execute_says_the_first_took_the_pipeline_as_in_flink():
    """A job takes the pipeline defined before it: executing the environment again without a new
    one is refused as Flink refuses it (no operators), saying why, not that there are no sinks."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    with pytest.raises(RuntimeError, match="the job has no sinks"):  # nothing was ever defined
        env.execute("never defined")
    data = [3, 1, 2]
    collected = env.from_collection(data).map(lambda x: x * 10).execute_and_collect(limit=3)
    assert sorted(collected) == [10, 20, 30]
    for again in (lambda: env.execute("second"), lambda: env.execute_async("second")):
        with pytest.raises(RuntimeError) as refused:
            again()
        said = str(refused.value)
        assert said.startswith("No operators defined in streaming topology. Cannot execute")
        assert "already ran job 'Flink Streaming Job'" in said and "no sinks" not in said
    env.from_collection(data).map(lambda x: x + 1).add_sink(ChannelSink("out"))  # a new pipeline runs
    client = env.execute_async("third")
    assert sorted(channels.open_reader(client, "out")) == [2, 3, 4]
    assert client.wait().name == "FINISHED"
