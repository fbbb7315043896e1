"""A stage pickled as the workers get it, and, when it does not pickle, which user function is at
fault: cloudpickle's own error (``cannot pickle '_thread.lock' object``) names no operator, and a
job of many functions leaves its author to guess which one captured the lock or the socket."""

from __future__ import annotations

import inspect
import re

from stretch.common import user_code
from stretch.errors import UnpicklableFunction
from stretch.plan.stages import StageSpec, walk_steps

# what each part of a stage is called in errors (as runtime errors name them: "map function of operator 'x'")
_STEP_ROLES = {
    "map": "map function",
    "flat_map": "flat_map function",
    "filter": "filter function",
    "stateless_process": "process function",
    "assign": "watermark strategy",
}
_OPERATOR_ROLES = {
    "process": "process function",
    "aggregate": "aggregate function",
    "vector_window": "window function",
    "band_join": "join function",
    "broadcast_process": "broadcast process function",
}
_UNPICKLABLE = re.compile(r"(?:cannot|can't) pickle '?([\w.<>]+)'? object", re.I)


def pickled_stage(stage: StageSpec) -> bytes:
    """The stage as workers get it (see ``pickled``)."""
    return pickled(stage, [stage])


def pickled(obj, stages: list[StageSpec]) -> bytes:
    """``user_code.dumps(obj)`` of something that holds ``stages``; if it does not pickle, and one
    of their user functions does not on its own, ``UnpicklableFunction`` names that function and
    its operator (``__cause__``: pickle's error)."""
    try:
        return user_code.dumps(obj)
    except Exception as e:
        for role, operator, part in _parts(stages):
            try:
                user_code.dumps(part)
            except Exception as own:
                raise UnpicklableFunction(_describe(role, operator, part, own)) from e
        raise


def _parts(stages: list[StageSpec]):
    """(role, operator name, object) of every user-given part of the stages, in the job's order."""
    for stage in stages:
        if stage.source is not None:
            yield "source", stage.name, stage.source
        op = stage.operator
        if op is not None:
            if op.key is not None and op.key.selector is not None:
                yield "key selector", stage.name, op.key.selector
            if op.fn is not None:
                yield _OPERATOR_ROLES.get(op.kind, "function"), stage.name, op.fn
        for step in walk_steps(stage.chain):
            name = step.name or stage.name
            if step.key is not None and step.key.selector is not None:
                yield "key selector", name, step.key.selector
            if step.fn is not None and step.kind != "side":
                yield _STEP_ROLES.get(step.kind, "function"), name, step.fn


def _describe(role: str, operator: str, part, error: Exception) -> str:
    what = f"{role} of operator {operator!r} cannot be shipped to the workers"
    found = _UNPICKLABLE.search(str(error))
    if found is None:
        return f"{what}: it does not pickle: {type(error).__name__}: {error}"
    kind = found.group(1)
    holder = _holder(part, kind)
    where = f" (as {holder!r})" if holder else ""
    sets = f"sets self.{holder.rsplit('.', 1)[-1]}" if holder else "makes it"
    return (
        f"{what}: it captures a {kind!r} object{where}, which cannot be pickled. Make it where the "
        f"function runs instead: in open() of a function class (e.g. a MapFunction whose open() "
        f"{sets}), not in the program around the function"
    )


def _holder(part, kind: str, depth: int = 3) -> str | None:
    """Where ``part`` holds the object of type ``kind``, within ``depth`` steps: a variable its code
    refers to (closure or global), an attribute, or a path of these ("fn.lock")."""
    level, seen = [("", part)], {id(part)}
    for _ in range(depth):
        below = []
        for path, obj in level:
            for name, value in _referred(obj).items():
                if id(value) in seen:
                    continue
                seen.add(id(value))
                where = f"{path}.{name}" if path else name
                t = type(value)
                if kind in (t.__name__, t.__qualname__, f"{t.__module__}.{t.__qualname__}"):
                    return where
                below.append((where, value))
        level = below
    return None


def _referred(obj) -> dict:
    """The names an object refers to: a function's free and global variables, else its attributes."""
    if inspect.ismethod(obj):
        return {**_referred(obj.__func__), **_referred(obj.__self__)}
    if inspect.isfunction(obj):
        try:
            found = inspect.getclosurevars(obj)
        except (TypeError, ValueError):
            return {}
        return {**found.globals, **found.nonlocals}
    if inspect.ismodule(obj) or isinstance(obj, type):
        return {}
    try:
        return dict(vars(obj))
    except TypeError:
        return {}
