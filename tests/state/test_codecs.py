"""State values of classes defined in the user's script: a worker cannot import the script (its
``__main__`` is not the script), so such values are stored by value and read back in any worker."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json
    from collections import namedtuple
    from dataclasses import dataclass

    from stretch.common import Types
    from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
    from stretch.datastream.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor

    Click = namedtuple("Click", ["user", "amount"])


    @dataclass
    class Total:
        clicks: int
        amount: int


    class Totals(KeyedProcessFunction):
        def open(self, ctx):
            self.total = ctx.get_state(ValueStateDescriptor("total", Types.PICKLED_BYTE_ARRAY()))
            self.last = ctx.get_map_state(MapStateDescriptor("last", Types.STRING(), Types.PICKLED_BYTE_ARRAY()))
            self.seen = ctx.get_list_state(ListStateDescriptor("seen", Types.PICKLED_BYTE_ARRAY()))

        def process_element(self, click, ctx):
            t = self.total.value() or Total(0, 0)
            t = Total(t.clicks + 1, t.amount + click.amount)
            self.total.update(t)
            self.last.put("click", click)
            self.seen.add(click)
            yield [click.user, t.clicks, t.amount, self.last.get("click").amount, len(list(self.seen.get()))]


    clicks = [Click("u%d" % (i % 7), i) for i in range(300)]
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    keyed = env.from_collection(clicks).key_by(lambda c: c.user)
    with keyed.process(Totals()).execute_and_collect() as it:
        processed = sorted(it)
    with keyed.reduce(lambda a, b: Click(a.user, a.amount + b.amount)).execute_and_collect() as it:
        reduced = sorted([c.user, c.amount] for c in it)
    print(json.dumps({"processed": processed, "reduced": reduced}))
    """
)


def test_values_of_classes_of_the_script_live_in_keyed_state(tmp_path):
    script = tmp_path / "clicks.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    processed, reduced, totals = [], [], {}
    for i in range(300):  # the plain-Python model: per user, running clicks and amounts
        user = f"u{i % 7}"
        clicks, amount = totals.get(user, (0, 0))
        totals[user] = (clicks + 1, amount + i)
        processed.append([user, clicks + 1, amount + i, i, clicks + 1])
        reduced.append([user, amount + i])
    assert got == {"processed": sorted(processed), "reduced": sorted(reduced)}
