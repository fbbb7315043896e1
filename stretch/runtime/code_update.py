"""Live update of an operator's code (``JobClient.update``).

An update is a reconfiguration as cheap as a rescale: every instance reads the same gate, so all of
them switch code at one position of it (an epoch with the new version, placed at the readers'
frontier), in order with the data. Before that, a spare worker checks the new code against the
operator's state, with nothing changed if it is refused. Each operator's
versions are kept as pickled stages beside the checkpoints, and a checkpoint records the version
each operator ran, so a recovery or a restore runs the code that was active at the checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
import types
from pathlib import Path

import cloudpickle

from stretch.common.wording import a, described, not_a_class
from stretch.contracts.functions import (
    FilterFunction,
    FlatMapFunction,
    Function,
    JoinFunction,
    KeyedProcessFunction,
    MapFunction,
    ProcessFunction,
)
from stretch.errors import RestoreRefused, UnknownOperator, UpdateRefused
from stretch.plan.shipping import pickled_stage
from stretch.plan.stages import JobPlan, StageSpec, Step, walk_steps
from stretch.runtime.operators import InstanceRuntimeContext, make_operator
from stretch.runtime.state_dir import make_private_dir, write_private
from stretch.state.codecs import storage_entry
from stretch.state.keyed_table import KeyedTable
from stretch.state.ttl import stamps_descriptor

ROLLING = ("sum", "min", "max")  # built-in rolling aggregates: one state layout, so swappable
# chained steps that run a user function: what may replace it (and whether a plain callable may)
STEPS = {
    "map": ((MapFunction,), True),
    "flat_map": ((FlatMapFunction,), True),
    "filter": ((FilterFunction,), True),
    "stateless_process": ((ProcessFunction,), False),
}


def target(plan: JobPlan, name: str) -> tuple[StageSpec, str]:
    """What ``name`` names: a keyed operator (its stage, "") or a chained step (its stage, name)."""
    for stage in plan.stages:
        if stage.kind == "keyed" and stage.name == name:
            return stage, ""
    found = [s for s in plan.stages if any(step.name == name for step in walk_steps(s.chain))]
    if len(found) > 1 or sum(step.name == name for s in found for step in walk_steps(s.chain)) > 1:
        raise UpdateRefused(f"several steps are named {name!r}: name them apart with .name(...)")
    if not found:
        keyed = [s.name for s in plan.stages if s.kind == "keyed"]
        steps = sorted({step.name for s in plan.stages for step in walk_steps(s.chain) if step.kind in STEPS})
        raise UnknownOperator(
            f"no operator named {name!r} in this job (keyed operators: {', '.join(keyed) or 'none'}; "
            f"chained steps: {', '.join(steps) or 'none'})"
        )
    return found[0], name


def updated_step(stage: StageSpec) -> Step:
    """The chained step a version changed (with its new function)."""
    return next(s for s in walk_steps(stage.chain) if s.name == stage.updated_step)


def swapped_stage(stage: StageSpec, function, output_type=None, step: str = "") -> StageSpec:
    """The stage with its user function replaced by ``function`` (an operator's adapter says which
    of its functions that is), or, with ``step``, that chained step's function; refused if
    ``function`` is not of a kind the operator or step runs."""
    if (wrong := not_a_class(function, Function)) is not None:  # update("op", AMap): AMap() was meant
        raise UpdateRefused(f"the new code for {step or stage.name!r}: {wrong}")
    if step:
        return dataclasses.replace(
            stage, chain=_swapped_steps(stage.chain, step, function, output_type), updated_step=step
        )
    spec = stage.operator
    if output_type is not None and spec.output_type is not None and output_type != spec.output_type:
        raise UpdateRefused(
            f"operator {stage.name!r} feeds {spec.output_type} downstream; the new code declares "
            f"{output_type}: the operators after it would receive records of another type"
        )
    changes: dict = {"output_type": spec.output_type or output_type}
    adapter = getattr(spec.fn, "_with_user_function", None)
    if spec.kind == "aggregate":
        if function not in ROLLING:
            raise UpdateRefused(
                f"operator {stage.name!r} is the built-in rolling {spec.op}; it is swapped only for "
                f"another built-in over the same fields: one of {', '.join(map(repr, ROLLING))}"
            )
        changes.update(op=function, fn=spec.fn._with_user_function(function))
    elif adapter is not None:
        changes["fn"] = adapter(function)
    elif spec.kind == "process":
        if not isinstance(function, KeyedProcessFunction):
            raise UpdateRefused(
                f"operator {stage.name!r} runs a KeyedProcessFunction ({type(spec.fn).__name__}); "
                f"the new code is {described(function)}"
            )
        changes["fn"] = function
    elif spec.kind == "band_join":
        if not (isinstance(function, JoinFunction) or callable(function)):
            raise UpdateRefused(f"band join {stage.name!r} takes a JoinFunction or a callable")
        changes["fn"] = dataclasses.replace(spec.fn, function=function)
    else:
        raise UpdateRefused(
            f"operator {stage.name!r} is a vectorized {spec.kind}: it has no user function to update"
        )
    return dataclasses.replace(stage, operator=dataclasses.replace(spec, **changes), updated_step="")


def _swapped_steps(steps: list[Step], name: str, function, output_type) -> list[Step]:
    out = []
    for step in steps:
        fn = _checked_step_function(step, function, output_type) if step.name == name else step.fn
        children = _swapped_steps(step.children, name, function, output_type)
        out.append(dataclasses.replace(step, fn=fn, children=children))
    return out


def _checked_step_function(step: Step, function, output_type):
    if step.kind not in STEPS:
        raise UpdateRefused(f"step {step.name!r} ({step.kind}) runs no user function to update")
    kinds, callables = STEPS[step.kind]
    if not (
        isinstance(function, kinds) or (callables and callable(function) and not isinstance(function, type))
    ):
        names = " or ".join(a(k.__name__) for k in kinds) + (" or a callable" if callables else "")
        raise UpdateRefused(f"step {step.name!r} runs {names}; the new code is {described(function)}")
    if output_type is not None and step.output_type is not None and output_type != step.output_type:
        raise UpdateRefused(
            f"step {step.name!r} feeds {step.output_type} downstream; the new code declares {output_type}"
        )
    return function


def fingerprint(stage: StageSpec) -> str:
    """A digest of the code an operator runs: its functions' bytecode, constants and names, not
    where they were defined (line numbers, files) nor how cloudpickle happened to name them."""
    h = hashlib.sha256()
    seen: set[int] = set()

    def code(c: types.CodeType) -> None:
        h.update(c.co_name.encode())
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
        for const in c.co_consts:
            code(const) if isinstance(const, types.CodeType) else h.update(repr(const).encode())

    def walk(obj, depth: int) -> None:
        if depth > 6 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            code(obj.__code__)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o, depth + 1)
        elif isinstance(obj, dict):
            for k in sorted(obj, key=repr):
                h.update(repr(k).encode())
                walk(obj[k], depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType)):
            cls = type(obj)
            h.update(cls.__qualname__.encode())
            for klass in cls.__mro__:
                if klass.__module__.startswith(("stretch.", "builtins")):
                    continue
                for name in sorted(vars(klass)):
                    attr = vars(klass)[name]
                    if isinstance(attr, (types.FunctionType, staticmethod, classmethod)):
                        code(getattr(attr, "__func__", attr).__code__)
            walk(vars(obj), depth + 1)
        else:
            h.update(repr(obj).encode())

    walk(stage.operator, 0)
    return h.hexdigest()[:16]


def load_version(directory: str, stage_id: int, version: int) -> StageSpec:
    """A version of a keyed operator's stage, as ``CodeHistory`` saved it."""
    return cloudpickle.loads((Path(directory) / f"{stage_id}-{version}.pkl").read_bytes())


class CodeHistory:
    """Each stage's code versions: pickled stages in ``directory`` and their history.

    Version 0 is the code the job was started with. Instances load version files when they read an
    epoch's position (or start after one); recoveries and restores load the checkpoint's versions.
    """

    def __init__(self, directory: Path, stages: list[StageSpec], restore: bool):
        self.dir = directory
        if not restore:
            shutil.rmtree(directory, ignore_errors=True)
        make_private_dir(directory)
        index = directory / "history.json"
        self.entries: dict[str, list[dict]] = json.loads(index.read_text()) if index.exists() else {}
        self.current: dict[int, int] = {}
        self.script: dict[int, StageSpec] = {}  # what this run's script built (version 0 at a first run)
        for stage in stages:
            self.script[stage.id] = stage
            if stage.name not in self.entries:
                self._save(stage, 0, "the job's script")
            self.current[stage.id] = 0

    def _save(self, stage: StageSpec, version: int, source: str) -> None:
        stage = dataclasses.replace(stage, code_version=version)
        self.record(stage, self.write(stage, pickled_stage(stage), source))
        self.save_index()

    def next_version(self, stage: StageSpec) -> int:
        return self.entries[stage.name][-1]["version"] + 1

    def numbered(self, stage: StageSpec) -> StageSpec:
        """``stage`` as its operator's next code version."""
        return dataclasses.replace(stage, code_version=self.next_version(stage))

    def write(self, stage: StageSpec, blob: bytes, source: str) -> dict:
        """Save a numbered ``stage`` (pickled as ``blob``) as the version file instances load;
        returns its history entry, for ``record`` once the version is checked (an update writes
        the file while a spare checks the code)."""
        write_private(self._file(stage), blob)
        return {
            "version": stage.code_version,
            "at": time.time(),
            "source": source,
            "fingerprint": fingerprint(stage),
        }

    def unwrite(self, stage: StageSpec) -> None:
        """Remove the file of a version ``write`` saved that will not run (its check refused it)."""
        self._file(stage).unlink(missing_ok=True)

    def record(self, stage: StageSpec, entry: dict) -> None:
        """Note a written version in the history; ``save_index`` writes the history out (an
        update does that once its switch is done, off the switch's path)."""
        versions = self.entries.setdefault(stage.name, [])
        versions[:] = [e for e in versions if e["version"] != stage.code_version] + [entry]

    def save_index(self) -> None:
        write_private(self.dir / "history.json", json.dumps(self.entries))

    def _file(self, stage: StageSpec) -> Path:
        return self.dir / f"{stage.id}-{stage.code_version}.pkl"

    def versions(self, stages: list[StageSpec]) -> dict[str, int]:
        """Operator name -> the version it runs (what a checkpoint records)."""
        return {s.name: self.current[s.id] for s in stages if s.id in self.current}

    def at_checkpoint(self, stage: StageSpec, version: int, mode: str) -> StageSpec:
        """The code a restore runs for an operator that ran ``version`` at the checkpoint.

        The script's code, unless the checkpoint ran a live update and the script holds code older
        than it (an earlier version's): then, by ``mode``, ``"checkpoint"`` runs the recorded
        version, ``"script"`` the script's code, and ``"refuse"`` fails with why. A script with
        code of its own (no recorded version's) runs, as a restart with new code does in Flink.
        """
        script = self.script[stage.id]
        mine = fingerprint(script)
        history = {e["version"]: e for e in self.entries.get(stage.name, ())}
        recorded = history.get(version)
        older = any(e["fingerprint"] == mine for v, e in history.items() if v < version)
        chosen = script
        if recorded is not None and version > 0 and recorded["fingerprint"] != mine and mode != "script":
            if mode == "checkpoint":
                chosen = load_version(str(self.dir), stage.id, version)
            elif older:
                at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(recorded["at"]))
                raise RestoreRefused(
                    f"operator {stage.name!r} ran code version {version} at the checkpoint (updated live "
                    f"from {recorded['source']} at {at}), but this script's code for it is older: bring "
                    "the script up to date, or restore with restore_code='checkpoint' (CLI: "
                    "--restore-code checkpoint) to run the live-updated code, or restore_code='script' "
                    "to run the script's code anyway"
                )
        self.current[stage.id] = version
        return dataclasses.replace(chosen, code_version=version)

    def describe(self) -> dict[str, list[dict]]:
        return self.entries


class _Recorder:
    """A state backend that only notes which states a function declares in ``open()``."""

    def __init__(self):
        self.declared: dict[str, dict] = {}

    def state(self, descriptor):
        self.declared[descriptor.name] = storage_entry(descriptor)
        ttl = descriptor._ttl_config
        if ttl is not None and ttl.is_enabled():
            self.state(stamps_descriptor(descriptor))
        return _Unbound(descriptor.name)


class _Unbound:
    """A state handle during the check: there is no current key to read or write."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        raise RuntimeError(f"state {self._name!r} was used in open(): keyed state has no current key there")


def declared_states(stage: StageSpec, table: KeyedTable, max_parallelism: int) -> dict[str, dict]:
    """The states ``stage``'s code declares when opened (name -> registry entry)."""
    recorder = _Recorder()
    operator = make_operator(stage.operator, stage.name, table)
    operator.open(InstanceRuntimeContext(stage.name, 0, lambda: 1, max_parallelism, recorder))
    operator.close()
    return recorder.declared


def check(old: StageSpec, new: StageSpec, table: KeyedTable | None) -> dict:
    """What a spare worker checks before an update: the new code opens against the operator's
    state, and every state name it keeps keeps its kind and type. Returns the states it adds and
    the operator's states it no longer declares (orphaned: kept, unless the update drops them).

    The operator's states are those in its table and those its current code declares (its
    instances may not have opened yet). A chained step's function has no keyed state: it only has
    to open."""
    if new.updated_step:
        function = updated_step(new).fn
        try:
            if hasattr(function, "open"):
                function.open(InstanceRuntimeContext(new.name, 0, lambda: 1, new.max_parallelism))
                function.close()
        except Exception as e:
            raise UpdateRefused(
                f"the new code of step {new.updated_step!r} failed in open(): {type(e).__name__}: {e}"
            ) from e
        return {"added": [], "orphaned": []}
    registry = {e["name"]: e for e in table.arena.registry()}
    try:
        current = declared_states(old, table, old.max_parallelism)
    except Exception:  # its instances opened it, or will fail on their own
        current = {}
    registry = {**current, **registry}
    try:
        after = declared_states(new, table, new.max_parallelism)
    except Exception as e:
        raise UpdateRefused(
            f"the new code of operator {new.name!r} failed in open(): {type(e).__name__}: {e}"
        ) from e
    for name, entry in after.items():
        kept = registry.get(name)
        if kept is not None and kept != entry:
            raise UpdateRefused(
                f"operator {new.name!r}: state {name!r} keeps its name but changes from "
                f"{_kind(kept)} to {_kind(entry)}; one name must keep one kind and type "
                "(give the new state another name)"
            )
    return {
        "added": sorted(n for n in after if n not in registry),
        "orphaned": sorted(n for n in registry if n not in after and entry_is_declared(registry[n])),
    }


def entry_is_declared(entry: dict) -> bool:
    """A state the operator's code declares, not one the engine keeps for it (its timers' heaps and
    per-key sets, named ``__...`` as every state of the engine's): only those can be orphaned."""
    return not entry["name"].startswith("__")


def _kind(entry: dict) -> str:
    t = entry.get("type")
    return f"a {entry['kind']} state of {json.dumps(t) if t is not None else 'any type'}"
