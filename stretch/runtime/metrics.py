"""A job's metrics for Prometheus (``prometheus-client``), read from the control block when
scraped, so that keeping them costs the job nothing between scrapes.

Per operator: parallelism, gate depth, state bytes, rescales (count and durations); per instance:
records in and out, busy time, and the lag of its watermark behind the wall clock; per job, if it
takes checkpoints: checkpoints (count, durations, latest size, failures) and recoveries. Rates and busy
fractions are what Prometheus' ``rate()`` makes of the counters. The instance counters cover every
instance slot ever used (a retired instance's series stays), so that their sums never go down on a
rescale, as Prometheus counters must not. The user functions' own metrics follow
(``runtime.user_metrics``), each instance's latest report. Served only when asked
(``env.enable_metrics(port)``), on loopback unless told otherwise; ``stretch metrics JOB`` prints
the same text through the job's control socket without any listener.
"""

from __future__ import annotations

import time

from stretch.runtime import control_block as cbk
from stretch.runtime.event_time import MAX_WATERMARK
from stretch.runtime.user_metrics import families as user_families


def require_prometheus():
    try:
        import prometheus_client
    except ImportError:  # pragma: no cover - an install without the metrics extra
        raise ImportError("metrics need prometheus-client: pip install 'stretch[metrics]'") from None
    return prometheus_client


class JobCollector:
    """A prometheus-client collector over one job's coordinator."""

    def __init__(self, coordinator):
        self.coordinator = coordinator

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

        c = self.coordinator
        d = c.describe()
        job = d["name"]
        op_labels = ["job", "operator"]
        inst_labels = ["job", "operator", "instance"]
        parallelism = GaugeMetricFamily(
            "stretch_parallelism", "Instances of a keyed operator", labels=op_labels
        )
        depth = GaugeMetricFamily(
            "stretch_gate_depth", "Batches waiting in an operator's input gate", labels=op_labels
        )
        state = GaugeMetricFamily(
            "stretch_state_bytes", "Shared memory held by an operator's state", labels=op_labels
        )
        records_in = CounterMetricFamily(
            "stretch_records_in", "Records an instance took in", labels=inst_labels
        )
        records_out = CounterMetricFamily(
            "stretch_records_out", "Records an instance put out", labels=inst_labels
        )
        busy = CounterMetricFamily(
            "stretch_busy_seconds", "Time an instance spent processing", labels=inst_labels
        )
        lag = GaugeMetricFamily(
            "stretch_watermark_lag_seconds", "Wall clock minus an instance's watermark", labels=inst_labels
        )
        rescales = SummaryMetricFamily(
            "stretch_rescale_seconds", "Live rescales of an operator", labels=op_labels
        )
        updates = SummaryMetricFamily(
            "stretch_update_seconds",
            "Live code updates of an operator (dry runs not counted)",
            labels=op_labels,
        )
        now_ms = time.time() * 1000
        for op in d["operators"]:
            labels = [job, op["name"]]
            parallelism.add_metric(labels, op["parallelism"])
            depth.add_metric(labels, op["gate_depth"])
            state.add_metric(labels, op["state_bytes"])
            done = [r for r in c.rescales if r["operator"] == op["name"]]
            rescales.add_metric(labels, len(done), sum(r["elapsed_ms"] for r in done) / 1000)
            swapped = [r for r in c.updater.reports if r["operator"] == op["name"] and not r.get("dry_run")]
            updates.add_metric(labels, len(swapped), sum(r["elapsed_ms"] for r in swapped) / 1000)
            for inst in op["instances"]:
                wm = inst.get("watermark")
                if wm is not None and wm < MAX_WATERMARK:
                    lag.add_metric([*labels, str(inst["index"])], (now_ms - wm) / 1000)
            # counters of every instance slot the operator ever used, retired ones included, so
            # that their sum over instances never goes down when the operator scales down
            for index, records, out, busy_ns in self._slots(op["name"], op["instances"]):
                il = [*labels, str(index)]
                records_in.add_metric(il, records)
                records_out.add_metric(il, out)
                busy.add_metric(il, busy_ns / 1e9)
        yield from (parallelism, depth, state, records_in, records_out, busy, lag, rescales, updates)
        yield from self._checkpoints(job)
        yield from user_families(job, dict(c.user_metrics))

    def _slots(self, name: str, instances: list[dict]):
        """(index, records in, records out, busy ns) of each instance slot ever used: the running
        instances' from ``describe()``, retired ones' from the control block, where their counters
        stay (a slot used again later continues them)."""
        c = self.coordinator
        running = {
            i["index"]: (i["index"], i["records_in"], i["records_out"], i["busy_ns"]) for i in instances
        }
        stage = next((s for s in c.plan.stages if s.name == name and s.kind == "keyed"), None)
        control = c.control
        if stage is None or control is None or c.final_status is not None:  # ended: its segments are gone
            yield from running.values()
            return
        try:
            slots = control.instances(c.resources.keyed_index[stage.id]).copy()
        except ValueError:  # the segments went away (the job ended or recovers)
            yield from running.values()
            return
        for index in range(len(slots)):
            if index in running:
                yield running[index]
            elif slots[index, cbk.I_STATE] != cbk.FREE:
                yield (
                    index,
                    int(slots[index, cbk.I_RECORDS_IN]),
                    int(slots[index, cbk.I_RECORDS_OUT]),
                    int(slots[index, cbk.I_BUSY_NS]),
                )

    def _checkpoints(self, job: str):
        """Checkpoints (count and durations, latest size) and recoveries, if the job takes them."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

        c = self.coordinator
        if c.checkpointer is None:
            return
        ck = c.checkpointer
        history = list(ck.history)
        taken = SummaryMetricFamily("stretch_checkpoint_seconds", "Completed checkpoints", labels=["job"])
        taken.add_metric([job], ck.completed, ck.completed_ms / 1000)
        size = GaugeMetricFamily("stretch_checkpoint_bytes", "Size of the latest checkpoint", labels=["job"])
        size.add_metric([job], history[-1]["bytes"] if history else 0)
        failed = CounterMetricFamily("stretch_checkpoint_failures", "Checkpoints that failed", labels=["job"])
        failed.add_metric([job], c.checkpoint_failures)
        recoveries = SummaryMetricFamily(
            "stretch_recovery_seconds", "Recoveries from failed workers", labels=["job"]
        )
        recoveries.add_metric([job], len(c.recoveries), sum(r["elapsed_ms"] for r in c.recoveries) / 1000)
        yield from (taken, size, failed, recoveries)


def registry_of(coordinator):
    prometheus_client = require_prometheus()
    registry = prometheus_client.CollectorRegistry()
    registry.register(JobCollector(coordinator))
    return registry


def render(coordinator) -> str:
    """The job's metrics in Prometheus' text format."""
    return require_prometheus().generate_latest(registry_of(coordinator)).decode()


def serve(coordinator, host: str, port: int):
    """Start the HTTP endpoint; returns (server, thread, the port it listens on)."""
    server, thread = require_prometheus().start_http_server(
        port, addr=host, registry=registry_of(coordinator)
    )
    return server, thread, server.server_port
