"""A user function that cannot be shipped to the workers (it captures a lock, a socket) fails the
job's start with an error naming the function, its operator and what it captures, not with
pickle's bare ``cannot pickle '_thread.lock' object``."""

from __future__ import annotations

import socket
import threading

import pytest

from stretch.common import Types
from stretch.datastream import KeyedProcessFunction, StreamExecutionEnvironment
from stretch.errors import UnpicklableFunction

PAIR = Types.TUPLE([Types.STRING(), Types.LONG()])
LOCK = threading.Lock()


def _env():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    return env, env.from_collection([("a", 1), ("b", 2)], type_info=PAIR)


def _refusal(env) -> UnpicklableFunction:
    with pytest.raises(UnpicklableFunction) as refused:
        env.execute("unshippable")
    return refused.value


def test_a_map_capturing_a_lock_is_named_by_its_operator_with_pickles_error_as_cause():
    def guarded(r):
        with LOCK:
            return r

    env, ds = _env()
    ds.key_by(lambda r: r[0]).sum(1).name("tot").map(guarded, output_type=PAIR).name("after").print()
    error = _refusal(env)
    message = str(error)
    assert message.startswith(
        "map function of operator 'after' cannot be shipped to the workers: "
        "it captures a '_thread.lock' object (as 'LOCK'), which cannot be pickled."
    )
    assert "open()" in message and "self.LOCK" in message
    assert isinstance(error, TypeError)  # what pickle raised, so `except TypeError` still holds
    assert isinstance(error.__cause__, TypeError) and "cannot pickle" in str(error.__cause__)


def test_a_socket_in_a_lambdas_closure_a_lock_in_a_function_object_and_a_key_selector():
    conn, other = socket.socketpair()
    try:
        env, ds = _env()
        ds.map(lambda r: (conn.fileno(), r)[1], output_type=PAIR).name("send").print()
        message = str(_refusal(env))
        assert message.startswith("map function of operator 'send' cannot be shipped")
        assert "a 'socket' object (as 'conn')" in message
    finally:
        conn.close()
        other.close()

    class Guarded(KeyedProcessFunction):
        def __init__(self):
            self.guard = threading.Lock()

        def process_element(self, value, ctx):
            yield value

    env, ds = _env()
    ds.key_by(lambda r: r[0]).process(Guarded(), PAIR).name("guarded").print()
    message = str(_refusal(env))
    assert message.startswith("process function of operator 'guarded' cannot be shipped")
    assert "(as 'guard')" in message

    env, ds = _env()
    ds.key_by(lambda r: (LOCK, r[0])[1]).sum(1).name("totals").print()
    assert str(_refusal(env)).startswith("key selector of operator 'totals' cannot be shipped")
