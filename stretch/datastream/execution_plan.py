"""What the environment says about a job before it runs: Flink's JSON execution plan, and the
rewrite of a job's graph for BATCH execution mode."""

from __future__ import annotations

from stretch.datastream.keyed_functions import RollingReduce
from stretch.plan.graph import Transformation, reachable

_PASS_THROUGH = ("key_by", "union", "side_output")  # edges in Flink's plan, not nodes


def execution_plan(sinks: list[Transformation], default_parallelism: int) -> dict:
    """Flink's plan shape: ``{"nodes": [{id, type, pact, contents, parallelism, predecessors}]}``.

    A key_by is the HASH ship strategy of the edge into the keyed operator; every other edge is
    FORWARD (stateless steps run chained into the instances that produce their input).
    """
    ids: dict[int, int] = {}
    parallelism: dict[int, int] = {}
    nodes = []
    for t in reachable(sinks):
        if t.kind in _PASS_THROUGH:
            continue
        preds = [p for i in t.inputs for p in _producers(i, "FORWARD")]
        if t.kind == "source":
            kind, pact, p = f"Source: {t.name}", "Data Source", 1
        elif t.kind == "sink":
            kind, pact = f"Sink: {t.name}", "Data Sink"
            p = max((parallelism[q.id] for q, _ in preds), default=1)
        else:
            kind, pact = t.name, "Operator"
            keyed = any(s == "HASH" for _, s in preds)
            p = (
                (t.parallelism or default_parallelism)
                if keyed
                else max((parallelism[q.id] for q, _ in preds), default=1)
            )
        ids[t.id] = len(nodes) + 1
        parallelism[t.id] = p
        node = {"id": ids[t.id], "type": kind, "pact": pact, "contents": kind, "parallelism": p}
        if preds:
            node["predecessors"] = [{"id": ids[q.id], "ship_strategy": s, "side": "second"} for q, s in preds]
        nodes.append(node)
    return {"nodes": nodes}


def _producers(t: Transformation, strategy: str) -> list[tuple[Transformation, str]]:
    if t.kind == "key_by":
        strategy = "HASH"
    if t.kind in _PASS_THROUGH:
        return [p for i in t.inputs for p in _producers(i, strategy)]
    return [(t, strategy)]


def in_batch_mode(sinks: list[Transformation], required: bool) -> bool:
    """Rewrite the job for BATCH mode, as Flink runs it: rolling reductions emit each key's final
    value only. ``required`` (BATCH): an unbounded source is an error; otherwise (AUTOMATIC) the
    job stays in STREAMING mode if any source is unbounded. Returns whether BATCH applies."""
    nodes = reachable(sinks)
    unbounded = [t for t in nodes if t.kind == "source" and not getattr(t.spec["source"], "bounded", True)]
    if unbounded:
        if required:
            raise ValueError(
                f"BATCH execution mode needs bounded sources, and {unbounded[0].name!r} is unbounded; "
                "use RuntimeExecutionMode.STREAMING (or AUTOMATIC) for this job"
            )
        return False
    for t in nodes:
        fn = t.spec.get("fn")
        if t.kind in ("process", "aggregate") and isinstance(fn, RollingReduce):
            t.kind = "process"  # the vectorized rolling path emits per record: the per-key one it is
            t.spec = {**t.spec, "fn": fn.in_batch_mode()}
    return True
