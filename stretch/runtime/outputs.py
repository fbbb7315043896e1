"""Where a stage's results go, and what happens to a record a user function rejects.

Under the default error policy a failure fails the job with a ``StepError`` that names the operator,
the record and the key; under the dead-letter policy the record, the error and the time go to the
job's dead-letter channel and the stage goes on with the next record.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import pyarrow as pa

from stretch.contracts.functions import Function


class StepError(Exception):
    """A user function failed on a record; carries what the job error must name."""

    def __init__(self, operator: str, record, key, cause: BaseException, what: str = "user function"):
        self.operator = operator
        self.record = record
        self.key = key
        self.cause = cause
        self.what = what
        self.user_traceback = user_traceback(cause)
        super().__init__(describe_failure(operator, record, key, cause, what))


_ENGINE = str(Path(__file__).resolve().parents[1]) + os.sep  # the stretch package's files


def user_traceback(cause: BaseException) -> str:
    """The traceback of a user function's error from its first frame outside the engine: the
    engine's frames that called the function say nothing to its author (all of them are kept when
    the error arose in the engine itself)."""
    tb = cause.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_ENGINE):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(cause), cause, tb or cause.__traceback__))


def describe_failure(operator: str, record, key, cause: BaseException, what: str = "user function") -> str:
    key_part = "" if key is NO_KEY else f", key {short(key)}"
    reason = f"{type(cause).__name__}: {exception_text(cause)}"
    if record is NO_RECORD:
        return f"{what} of operator {operator!r} failed: {reason}"
    return f"{what} of operator {operator!r} failed on record {short(record)}{key_part}: {reason}"


NO_KEY = object()
NO_RECORD = object()  # a failure outside any record: open()


def open_function(fn, runtime_context, operator: str) -> None:
    """``fn.open(runtime_context)``; its failure names the operator and says it was open()."""
    try:
        fn.open(runtime_context)
    except Exception as e:
        raise StepError(operator, NO_RECORD, NO_KEY, e, what="open()") from e


def exception_text(e: BaseException) -> str:
    """``str(e)``, or a placeholder when the exception's own ``__str__`` raises: reporting a
    user's error must not fail in its turn."""
    try:
        return str(e)
    except Exception as inner:
        try:
            why = f"{type(inner).__name__}: {inner}"
        except Exception:
            why = type(inner).__name__
        return f"<exception str() failed: {why}>"


def safe_repr(value) -> str:
    """``repr(value)``, or a placeholder when the value's ``__repr__`` raises."""
    try:
        return repr(value)
    except Exception as inner:
        return f"<{type(value).__name__} object: repr() failed: {type(inner).__name__}>"


def short(value, limit: int = 200) -> str:
    text = safe_repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call_of(fn, method: str):
    """The callable behind a user function object or plain callable."""
    if isinstance(fn, Function):
        return getattr(fn, method)
    if callable(fn):
        return fn
    raise TypeError(f"{fn!r} is neither a {method} function nor callable")


class Outputs:
    """Where a stage's terminal steps write: gates, sink gates and chained sinks by id."""

    def __init__(
        self, gates: dict, sink_gates: dict, sinks: dict, producer: int, count_out, producer_id: int = 0
    ):
        self.gates = gates
        self.sink_gates = sink_gates
        self.sinks = sinks  # sink id -> SinkSpec, for sinks chained into this stage
        self.producer = producer  # 1-based instance index (print prefixes)
        self.producer_id = producer_id  # stage and instance, in watermark records
        self.count_out = count_out
        self.dead_letter_gate = None  # the job's dead-letter policy: where rejected records go
        self.txn = 0  # the input transaction being processed: its results carry it (runtime.transactions)
        self.round: str | None = None  # the writer's micro-batch it arrived in (ditto)
        self.judge: int | None = None  # the watermark replayed rows are judged by (event_time.JUDGE_KEY)

    def dead_letter(self, error: StepError) -> None:
        """Under the dead-letter policy: the record, the error and the time go to the job's
        dead-letter channel; the caller skips the record. Otherwise the error fails the job."""
        if self.dead_letter_gate is None:
            raise error
        self.dead_letter_gate.append_batch(dead_letter_batch(error), producer=self.producer)


DEAD_LETTER_SCHEMA = pa.schema(
    [
        ("operator", pa.string()),
        ("function", pa.string()),
        ("record", pa.string()),
        ("key", pa.string()),
        ("error", pa.string()),
        ("traceback", pa.string()),
        ("time", pa.timestamp("ms", tz="UTC")),
    ]
)


def dead_letter_batch(error: StepError) -> pa.RecordBatch:
    key = None if error.key is NO_KEY else safe_repr(error.key)
    values = [
        error.operator,
        error.what,
        safe_repr(error.record),
        key,
        f"{type(error.cause).__name__}: {exception_text(error.cause)}",
        error.user_traceback,
        int(time.time() * 1000),
    ]
    return pa.record_batch(
        [pa.array([v], f.type) for v, f in zip(values, DEAD_LETTER_SCHEMA)], DEAD_LETTER_SCHEMA
    )


def per_record(items: list, f, stage: str, what: str, outputs: Outputs) -> tuple[list, list[int]]:
    """``f`` of each record, one by one, after a batch failed: the failing records go to dead
    letters (or the first fails the job). Returns the results and the indexes they belong to."""
    out, kept = [], []
    for i, r in enumerate(items):
        try:
            out.append(f(r))
        except Exception as e:
            e.__suppress_context__ = True  # raised while handling the batch's failure: unrelated
            err = StepError(stage, r, NO_KEY, e, what)
            err.__cause__ = e
            outputs.dead_letter(err)
            continue
        kept.append(i)
    return out, kept
