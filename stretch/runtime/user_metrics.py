"""User-defined metrics leave their instance: the worker reports its running task's metric group to
the coordinator every ``REPORT_PERIOD``, and the job's metrics endpoint exports the latest report of
every running instance (``runtime.metrics``). As in Flink, they are an instance's own: an instance
that a rescale or a recovery starts counts from zero, and an ended one's series goes away.

A report is plain JSON data, one row per metric: ``[path, labels, name, kind, value]``, where
``path`` joins the groups' names and ``labels`` holds the key/value groups' values, as Flink's
Prometheus reporter names them (the key is part of the name, the value a label). A counter can go
down (``dec``), so it is exported as a gauge, as Flink's reporter does; a meter as a counter of its
events (``rate()`` makes the rate); a distribution as a summary (count and sum).
"""

from __future__ import annotations

import math
import re

from stretch.contracts.metrics import Counter, Distribution, Meter, MetricGroup

REPORT_PERIOD = 1.0  # seconds between reports of a running task
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def snapshot(group: MetricGroup) -> list[list]:
    """The group's metrics as report rows; a gauge that raises or is not a number is left out."""
    rows: list[list] = []
    _walk(group, (), {}, rows)
    return rows


def _walk(group: MetricGroup, path: tuple, labels: dict, rows: list) -> None:
    for name, metric in list(group._metrics.items()):  # a function may add one meanwhile
        row = _row(metric)
        if row is not None:
            rows.append(["_".join(path), labels, name, *row])
    for sub in list(group._groups.values()):
        kv = {} if sub.value is None else {sub.name: sub.value}
        _walk(sub, (*path, sub.name), {**labels, **kv}, rows)


def _row(metric):
    if isinstance(metric, Counter):
        return "gauge", metric.get_count()
    if isinstance(metric, Meter):
        return "counter", metric.get_count()
    if isinstance(metric, Distribution):
        return "summary", [metric.count, metric.sum]
    try:  # a gauge: the function's own callable, called from the worker's reporting thread
        value = metric()
    except Exception:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return "gauge", value


def metric_name(path: str, name: str) -> str:
    """The exported name of a user metric: ``stretch_user_`` and the groups' path, Prometheus-safe."""
    return _UNSAFE.sub("_", "_".join(p for p in ("stretch_user", path, name) if p))


def families(job: str, reports: dict):
    """Prometheus metric families of the latest reports, ``{(operator, instance): rows}``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

    made: dict = {}
    kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "summary": SummaryMetricFamily}
    for (operator, instance), rows in sorted(reports.items()):
        for path, labels, name, kind, value in rows:
            label_names = ["job", "operator", "instance", *(_UNSAFE.sub("_", k) for k in sorted(labels))]
            full = metric_name(path, name)
            family = made.get(full)
            if family is None:
                family = made[full] = kinds[kind](full, f"User metric {name!r}", labels=label_names)
            elif not isinstance(family, kinds[kind]) or family._labelnames != tuple(label_names):
                continue  # one name used for two kinds or label sets: the first one exported wins
            values = [job, operator, str(instance), *(str(labels[k]) for k in sorted(labels))]
            if kind == "summary":
                family.add_metric(values, value[0], value[1])
            else:
                family.add_metric(values, value)
    return list(made.values())
