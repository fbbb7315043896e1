"""What `stretch status` and ``JobClient.describe()`` show: a job's operators, their instances and
counters (read from the control block), and its checkpoints."""

from __future__ import annotations

import time
from collections import deque

from stretch.common.job_status import JobStatus
from stretch.plan.stages import walk_steps
from stretch.runtime import control_block as cbk


def describe_job(job, live: bool = False) -> dict:
    """The job's operators and counters; after the job ended, their values at its end.

    ``live``: read the segments now (the job's shutdown keeps what they said before they go)."""
    if live:
        return _describe_live(job)
    deadline = time.monotonic() + job.config.shutdown_timeout
    while job.final_status is None:
        generation = job.generation
        try:
            return _describe_live(job)
        except ValueError:  # segments released while reading: the job just ended or recovers
            recovering = job.status is JobStatus.RESTARTING or job.generation != generation
            if job.final_status is None and not (recovering and time.monotonic() < deadline):
                raise
            time.sleep(0.01)  # a recovery builds them anew: read those
    return {**job.final_status, "status": job.status.name}


def _describe_live(job) -> dict:
    ops = []
    for stage in job.plan.stages:
        if stage.kind != "keyed" or job.control is None:
            continue
        op = job.resources.keyed_index[stage.id]
        epoch = job.control.epoch(op)
        p = job.control.parallelism(op, epoch)
        inst = job.control.instances(op)[:p]
        now = time.monotonic()
        rates = [
            job.rates.of(stage.id, i, inst[i, cbk.I_RECORDS_IN], inst[i, cbk.I_BUSY_NS], now)
            for i in range(p)
        ]
        ops.append(
            {
                "name": stage.name,
                "kind": stage.operator.kind,  # process | aggregate | vector_window (vectorized)
                "parallelism": p,
                "max_parallelism": stage.max_parallelism,  # its key groups
                "epoch": epoch,
                "code_version": stage.code_version,  # 0: the script's code; more: live updates
                "gate_depth": job.gates[stage.input_gate].depth(),
                # totals over every instance slot ever used: they never go down on a rescale
                "records_in": int(job.control.instances(op)[:, cbk.I_RECORDS_IN].sum()),
                "records_out": int(job.control.instances(op)[:, cbk.I_RECORDS_OUT].sum()),
                "state_bytes": job.arenas[stage.id].resident_bytes(),
                "instances": [
                    {
                        "index": i,
                        "records_in": int(inst[i, cbk.I_RECORDS_IN]),
                        "records_out": int(inst[i, cbk.I_RECORDS_OUT]),
                        "busy_ms": int(inst[i, cbk.I_BUSY_NS]) // 1_000_000,
                        "busy_ns": int(inst[i, cbk.I_BUSY_NS]),
                        "epoch": int(inst[i, cbk.I_EPOCH]),
                        "position": int(inst[i, cbk.I_GATE_SEQ]),
                        "max_stall_ns": int(inst[i, cbk.I_MAX_STALL_NS]),
                        "watermark": int(inst[i, cbk.I_WATERMARK]) or None,
                        # over about the last second (None until the job has run that long)
                        "rate": rates[i][0],
                        "busy": rates[i][1],
                    }
                    for i in range(p)
                ],
            }
        )
    return {
        "ok": True,
        "job_id": job.job_id,
        "name": job.job_name,
        "status": job.status.name,
        "operators": ops,
        "graph": job_graph(job.plan),
        "rescales": list(job.rescales),  # every completed live rescale's report, in order
        "updates": list(job.updater.reports),  # every completed live code update's report, in order
        "checkpoints": _describe_checkpoints(job),
    }


class InstanceRates:
    """Each keyed instance's records read per second and busy fraction over about the last
    second, from counters the job samples as it runs (``tick``), so that a status answers them at
    once: ``stretch status`` need not ask twice and wait between."""

    EVERY = 0.25  # seconds between samples
    SPAN = 0.5  # the shortest span a rate is measured over

    def __init__(self):
        self.samples: deque = deque(maxlen=8)  # (monotonic time, {(stage, index): (records, busy ns)})

    def tick(self, job) -> None:
        now = time.monotonic()
        if (self.samples and now - self.samples[-1][0] < self.EVERY) or job.control is None:
            return
        counters = {}
        try:
            for stage in job.plan.stages:
                if stage.kind == "keyed":
                    slots = job.control.instances(job.resources.keyed_index[stage.id])
                    for i in range(len(slots)):
                        counters[(stage.id, i)] = (
                            int(slots[i, cbk.I_RECORDS_IN]),
                            int(slots[i, cbk.I_BUSY_NS]),
                        )
        except ValueError:  # the segments went away (the job ends or recovers)
            return
        self.samples.append((now, counters))

    def of(self, stage: int, index: int, records: int, busy_ns: int, now: float):
        """(records/s, busy fraction) since the newest sample at least SPAN old; (None, None)
        before there is one."""
        for t, counters in reversed(self.samples):
            if now - t >= self.SPAN and (stage, index) in counters:
                then_records, then_busy = counters[(stage, index)]
                dt = now - t
                return max(int(records) - then_records, 0) / dt, min(
                    max(int(busy_ns) - then_busy, 0) / (dt * 1e9), 1.0
                )
        return None, None


def job_graph(plan) -> dict:
    """The job as the UI draws it: ``nodes`` (sources, keyed operators and sinks, each with the
    stateless steps chained into it) and ``edges`` ([from, to] node ids, data flowing that way)."""
    nodes, edges = [], []
    for stage in plan.stages:
        node_id = f"stage-{stage.id}"
        kind = "source" if stage.kind == "source" else stage.operator.kind
        chained = [step.name for step in walk_steps(stage.chain) if step.kind not in _EDGES and step.name]
        nodes.append({"id": node_id, "name": stage.name, "kind": kind, "chained": chained})
        if stage.kind == "keyed":
            edges += [[f"stage-{p}", node_id] for p in plan.gate_producers.get(stage.input_gate, [])]
    for sink in plan.sinks:
        nodes.append({"id": f"sink-{sink.id}", "name": sink.name, "kind": "sink", "chained": []})
        edges += [[f"stage-{p}", f"sink-{sink.id}"] for p in dict.fromkeys(sink.producers)]
    return {"nodes": nodes, "edges": [list(e) for e in dict.fromkeys(map(tuple, edges))]}


_EDGES = ("to_gate", "to_sink", "to_chained_sink")  # a step that leaves its stage: an edge, not a box


def _describe_checkpoints(job) -> dict | None:
    c = job.checkpointer
    if c is None:
        return None
    return {
        "interval_ms": c.settings.interval_ms,
        "completed": c.completed,
        "latest": c.history[-1] if c.history else None,
        "failed": job.checkpoint_failures,
        "last_error": job.last_checkpoint_error,
        "restored_from": job.restored_from,
        "recoveries": len(job.recoveries),
        "last_recovery": job.recoveries[-1] if job.recoveries else None,
        "directory": str(c.store.dir),
    }
