"""A rolling aggregate's state as readers outside the job see it (runtime.operators.aggregate):
a key that is there has its value, also while new keys arrive by the thousand."""

from __future__ import annotations

import threading

from stretch import channels
from stretch.common import Types
from stretch.datastream import StreamExecutionEnvironment
from stretch.datastream.connectors import DiscardingSink
from stretch.datastream.connectors.channel import ChannelSource


def test_a_queryable_read_never_sees_a_new_string_key_without_its_sum():
    """String keys take the aggregate's general path (not the fused one for integer keys): it
    marks the key groups it writes, so a reader retries instead of seeing a key whose value is
    not set yet."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    pair = Types.TUPLE([Types.STRING(), Types.LONG()])
    source = env.from_source(ChannelSource("in", pair), None, "in")
    source.key_by("f0").sum("f1").name("sums").sink_to(DiscardingSink())
    client = env.execute_async("rolling-reads")
    writer = channels.open_writer(client, "in")
    batches = [[(f"k{b}-{i}", i % 7 + 1) for i in range(2000)] for b in range(150)]
    done = threading.Event()

    def write():
        try:
            for batch in batches:
                writer.write(batch)
        except Exception:  # the job was cancelled: the test failed already
            pass
        finally:
            done.set()

    feeder = threading.Thread(target=write)
    feeder.start()
    try:
        reads = 0
        while not done.is_set() or reads < 3:
            table = client.query_state("sums")
            if "sum(f1)" in table.column_names:  # once its first batch registered the state
                reads += 1
                assert table.column("sum(f1)").null_count == 0, f"read {reads} saw keys without sums"
        feeder.join()
        writer.end()
    except BaseException:
        client.cancel()
        raise
    finally:
        feeder.join()
        client.wait()
