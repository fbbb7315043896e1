"""The environment's PyFlink settings: accepted where stretch has one way, acted on where it matters."""

from __future__ import annotations

import pytest

from stretch.common import ExecutionConfig, RestartStrategies, Time, Types
from stretch.datastream import (
    HashMapStateBackend,
    SlotSharingGroup,
    StreamExecutionEnvironment,
    TimeCharacteristic,
)


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
