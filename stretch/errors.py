"""Errors a job raises in the user's process."""

from __future__ import annotations


class JobExecutionError(RuntimeError):
    """The job failed; the message says which operator and why."""


class UserFunctionError(JobExecutionError):
    """A user function raised: the message names the operator, the key and the record, and ends
    with the user code's traceback from the worker process; ``__cause__`` is the original error."""


class JobCancellationError(JobExecutionError):
    """The job was cancelled (``JobClient.cancel()``, SIGTERM) before it finished: its execution
    result, and ``env.execute()``, raise this, as Flink's do."""


class UpdateRefused(ValueError):
    """A live code update was refused before anything changed: the message says which check
    failed (the new code's kind, its open(), a state's kind or type, the output type); the job
    keeps running the old code."""


class RestoreRefused(ValueError):
    """A restore (``execute(restore=True)``, ``stretch run --restore``) was refused before the job
    started: the message says why (a job that finished, key groups that do not match, code older
    than the checkpoint's) and what to do instead."""


class JobEnded(RuntimeError):
    """The job has ended (finished, failed, was cancelled) or is ending, so it cannot do what was
    asked (a rescale, an update, a checkpoint): the message names the job and says how it ended."""


def job_ended(how: str, what: str) -> JobEnded:
    """The refusal, in the one wording the job's client and the command line share: ``how`` the
    job ended ("job 'clicks' has finished"), ``what`` it cannot be ("rescaled")."""
    return JobEnded(f"{how}: it cannot be {what}")


class UnpicklableFunction(TypeError):
    """A user function (a lambda, a function class, a key selector, a source) cannot be shipped to
    the worker processes because it, or something it captures, does not pickle: the message names
    the operator and what it captures; ``__cause__`` is pickle's error."""


class UnknownOperator(LookupError):
    """The job has no operator of the name a rescale, an update or a state query gave: the message
    lists the ones it has. Not a KeyError, whose message Python prints in quotes."""


class InputEnded(RuntimeError):
    """A rescale or a live update found nothing left to read where it could apply: the operator's
    instances have read (or are reading) the end of its input. The message says which."""
