"""The Grafana dashboard (docs/grafana/stretch.json) is a dashboard Grafana imports, and it asks
Prometheus only for what stretch exports.

A small job with metrics served (checkpoints, event time, user metrics of each kind) is scraped
over HTTP; every metric name in every PromQL expression of the dashboard (panels, variables,
annotations) must be a sample name of that exposition, and every label it selects on, groups by
or shows in a legend must be on it. Conversely every metric stretch exports is on the dashboard,
so that a new metric is a reminder to show it. The expressions are read by a small parser of the
PromQL the dashboard uses; its own tests show it catches a made-up name, label or function.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stretch import channels
from stretch.common import Duration, Types, WatermarkStrategy
from stretch.datastream import KeyedProcessFunction, RuntimeContext, StreamExecutionEnvironment
from stretch.datastream.connectors.channel import ChannelSink, ChannelSource
from stretch.runtime.control_socket import running_jobs

DASHBOARD = Path(__file__).resolve().parent.parent / "docs/grafana/stretch.json"
DATASOURCE = "${DS_PROMETHEUS}"
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range", "__range_s", "__interval_ms"}
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "text", "heatmap"}

# ---- a parser of the PromQL the dashboard uses ---------------------------------------------------

AGGREGATIONS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "quantile", "count_values"}
FUNCTION_NAMES = """
topk bottomk rate irate increase delta idelta deriv changes resets predict_linear histogram_quantile abs ceil floor round
clamp clamp_min clamp_max sort sort_desc time timestamp vector scalar absent absent_over_time label_replace
label_join avg_over_time min_over_time max_over_time sum_over_time count_over_time last_over_time
quantile_over_time stddev_over_time
"""
FUNCTIONS = AGGREGATIONS | set(FUNCTION_NAMES.split())
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
KEYWORDS |= {"offset", "inf", "nan"}
KEEP_NAME = {"label_replace", "label_join", "sort", "sort_desc", "last_over_time"}
SELECTOR = re.compile(r"(?P<name>(?<![\w:])[a-zA-Z_:][\w:]*)?\s*\{(?P<matchers>[^{}]*)\}")
MATCHER = re.compile(r'\s*([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
LEGEND_LABEL = re.compile(r"\{\{\s*([\w]+)\s*\}\}")
LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.*),\s*(?P<label>\w+)\s*\)\s*$", re.S)


@dataclass
class Selector:
    name: str | None  # None: the name is given by __name__ matchers
    matchers: list[tuple[str, str, str]] = field(default_factory=list)  # (label, op, value)


@dataclass
class Parsed:
    selectors: list[Selector]
    groupings: list[tuple[str, tuple[str, ...]]]  # ("by", labels), ("on", labels), ...
    calls: list[str]  # the functions and aggregations called, in order
    added: set[str]  # labels label_replace makes


def parse(expr: str) -> Parsed:
    """The selectors, grouping labels and functions of a PromQL expression."""
    selectors: list[Selector] = []

    def selector(m: re.Match) -> str:
        text = m["matchers"]
        matchers = [(g[0], g[1], g[2]) for g in MATCHER.findall(text)]
        if MATCHER.sub("", text).strip():
            raise ValueError(f"cannot read the label matchers {text!r} in {expr!r}")
        selectors.append(Selector(m["name"], matchers))
        return " 0 "

    rest = SELECTOR.sub(selector, expr)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # ranges and subqueries: [5m], [$__rate_interval]
    groupings: list[tuple[str, ...]] = []

    def grouping(m: re.Match) -> str:
        groupings.append((m[1], tuple(label.strip() for label in m[2].split(",") if label.strip())))
        return " "

    rest = GROUPING.sub(grouping, rest)
    added = set(re.findall(r'label_replace\(\s*[^,"]*,\s*"(\w+)"', rest))
    rest = re.sub(r'"(?:[^"\\]|\\.)*"', " ", rest)  # strings (label_replace's arguments)
    rest = re.sub(r"\$\w+", " ", rest)  # Grafana's variables
    calls = []
    for m in re.finditer(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(\s*\()?", rest):
        word, call = m[1], m[2]
        if call:
            calls.append(word)
        elif word not in KEYWORDS:
            selectors.append(Selector(word))
    return Parsed(selectors, groupings, calls, added)


def _names(sel: Selector, exported: dict[str, set[str]]) -> set[str]:
    """The exported metric names a selector selects."""
    if sel.name is not None:
        return {sel.name}
    found = set(exported)
    for label, op, value in sel.matchers:
        if label != "__name__":
            continue
        test = {
            "=": lambda n, v=value: n == v,
            "!=": lambda n, v=value: n != v,
            "=~": lambda n, v=value: re.fullmatch(v, n) is not None,
            "!~": lambda n, v=value: re.fullmatch(v, n) is None,
        }[op]
        found = {n for n in found if test(n)}
    return found


def problems(exported: dict[str, set[str]], expr: str, legend: str = "", where: str = "") -> list[str]:
    """What in ``expr`` stretch does not export: ``exported`` maps sample names (as PromQL sees
    them: ``_total``, ``_sum``, ``_count``) to their label names."""
    where = f"{where}: " if where else ""
    try:
        parsed = parse(expr)
    except ValueError as e:
        return [f"{where}{e}"]
    found = []
    if unknown := set(parsed.calls) - FUNCTIONS:
        found.append(f"{where}unknown PromQL functions {sorted(unknown)} in {expr!r}")
    metrics: set[str] = set()
    for sel in parsed.selectors:
        names = _names(sel, exported)
        if not names:
            found.append(f"{where}no exported metric matches {sel.matchers} in {expr!r}")
        for name in sorted(names):
            if name not in exported:
                found.append(f"{where}stretch exports no metric {name!r} ({expr!r})")
                continue
            metrics.add(name)
            for label, _, _ in sel.matchers:
                if label != "__name__" and label not in exported[name]:
                    found.append(f"{where}{name} has no label {label!r} ({expr!r})")
    for kind, labels in parsed.groupings:
        for label in labels:
            having = [name for name in sorted(metrics) if label in exported[name]]
            # group_left/right copy a label from one side: that side has it; others: every metric
            if not having or (kind not in {"group_left", "group_right"} and len(having) < len(metrics)):
                lacking = sorted(n for n in metrics if n not in having)
                found.append(f"{where}{', '.join(lacking)} has no label {label!r} to group by ({expr!r})")
    if legend:  # the labels the result keeps (by an estimate that errs on the side of fewer)
        by = [set(labels) for kind, labels in parsed.groupings if kind == "by"]
        without = [set(labels) for kind, labels in parsed.groupings if kind == "without"]
        if sum(call in AGGREGATIONS for call in parsed.calls) > len(by) + len(without):
            shown = set()  # an aggregation without by or without keeps no label
        elif by:
            shown = set.intersection(*by)
        else:
            shown = set.intersection(*(exported[n] for n in metrics)) if metrics else set()
            shown -= set().union(*without)
            if set(parsed.calls) <= KEEP_NAME:  # every other function drops the metric's name
                shown.add("__name__")
        shown |= parsed.added
        for label in LEGEND_LABEL.findall(legend):
            if label not in shown:
                found.append(f"{where}legend {legend!r} shows {label!r}, which {expr!r} does not keep")
    return found


def variable_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(variable name, query) of the dashboard's query variables."""
    out = []
    for var in dashboard["templating"]["list"]:
        if var.get("type") == "query":
            query = var["query"]
            out.append((var["name"], query["query"] if isinstance(query, dict) else query))
    return out


def variable_problems(exported: dict[str, set[str]], name: str, query: str) -> list[str]:
    m = LABEL_VALUES.match(query)
    if m is None:
        return [f"variable {name}: not a label_values(selector, label) query: {query!r}"]
    found = problems(exported, m["selector"], where=f"variable {name}")
    for sel in parse(m["selector"]).selectors:
        for metric in _names(sel, exported) & set(exported):
            if m["label"] not in exported[metric]:
                found.append(f"variable {name}: {metric} has no label {m['label']!r}")
    return found


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def expressions(dashboard: dict) -> list[tuple[str, str, str]]:
    """(where, expr, legend) of every panel target and annotation."""
    out = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r}", target["expr"], target.get("legendFormat", "")))
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            out.append(
                (f"annotation {annotation['name']!r}", annotation["expr"], annotation.get("textFormat", ""))
            )
    return out


def dashboard_problems(dashboard: dict, exported: dict[str, set[str]]) -> list[str]:
    found = []
    for where, expr, legend in expressions(dashboard):
        found += problems(exported, expr, "" if legend == "__auto" else legend, where)
    for name, query in variable_queries(dashboard):
        found += variable_problems(exported, name, query)
    return found


# ---- the parser finds what it must ----------------------------------------------------------------

EXPORTED = {
    "stretch_records_in_total": {"job", "operator", "instance"},
    "stretch_parallelism": {"job", "operator"},
    "stretch_rescale_seconds_count": {"job", "operator"},
    "stretch_rescale_seconds_sum": {"job", "operator"},
    "stretch_user_io_seen_total": {"job", "operator", "instance"},
    "stretch_user_parity_n": {"job", "operator", "instance", "parity"},
}


def test_the_parser_reads_names_labels_and_groupings():
    p = parse(
        'sum by (job, operator) (rate(stretch_records_in_total{job=~"$job", operator!="x"}[$__rate_interval]))'
        " / on (job) group_left max without (instance) (stretch_parallelism offset 5m) * 1e3"
    )
    assert [(s.name, s.matchers) for s in p.selectors] == [
        ("stretch_records_in_total", [("job", "=~", "$job"), ("operator", "!=", "x")]),
        ("stretch_parallelism", []),
    ]
    assert p.groupings == [("by", ("job", "operator")), ("on", ("job",)), ("without", ("instance",))]
    assert p.calls == ["sum", "rate", "max"]
    p = parse('{__name__=~"stretch_user_.+", __name__!~".+_total"}')
    assert p.selectors[0].name is None
    assert _names(p.selectors[0], EXPORTED) == {"stretch_user_parity_n"}


def test_the_parser_accepts_what_is_exported():
    assert (
        problems(
            EXPORTED,
            "sum by (job, operator) (rate(stretch_rescale_seconds_sum[5m]))"
            ' / sum by (job, operator) (rate(stretch_rescale_seconds_count{operator=~"$operator"}[5m]))',
            "{{job}} / {{operator}}",
        )
        == []
    )
    meters = 'label_replace({__name__=~"stretch_user_.+_total"}, "metric", "$1", "__name__", "(.+)")'
    assert problems(EXPORTED, f"rate({meters}[1m:])", "{{metric}} #{{instance}}") == []
    assert problems(EXPORTED, 'stretch_user_parity_n{parity="even"}', "{{__name__}} {{parity}}") == []
    assert problems(EXPORTED, "sum without (instance) (stretch_records_in_total)", "{{operator}}") == []


@pytest.mark.parametrize(
    ("expr", "legend", "caught"),
    [
        ("rate(stretch_records_inn_total[1m])", "", "no metric 'stretch_records_inn_total'"),
        ("stretch_parallelism_total", "", "no metric 'stretch_parallelism_total'"),  # a suffix it lacks
        ('stretch_parallelism{instance="0"}', "", "has no label 'instance'"),
        ("sum by (opertor) (stretch_parallelism)", "", "no label 'opertor' to group by"),
        ("sum by (job) (stretch_records_in_total)", "{{operator}}", "does not keep"),
        ("stretch_parallelism", "{{instance}}", "does not keep"),
        ("sum(stretch_records_in_total)", "{{operator}}", "does not keep"),
        ("sum without (instance) (stretch_records_in_total)", "{{instance}}", "does not keep"),
        ("rate(stretch_records_in_total[1m])", "{{__name__}}", "does not keep"),  # rate() drops it
        ("rat(stretch_records_in_total[1m])", "", "unknown PromQL functions ['rat']"),
        ('{__name__=~"stretch_nothing_.+"}', "", "no exported metric matches"),
        ("stretch_parallelism{job=~$job}", "", "cannot read the label matchers"),
    ],
)
def test_the_parser_catches_what_is_not_exported(expr, legend, caught):
    found = problems(EXPORTED, expr, legend)
    assert any(caught in p for p in found), found


def test_a_variable_on_a_label_that_does_not_exist_is_caught():
    assert variable_problems(EXPORTED, "job", "label_values(stretch_parallelism, job)") == []
    assert (
        "no label 'instance'"
        in variable_problems(EXPORTED, "i", "label_values(stretch_parallelism, instance)")[0]
    )


# ---- the dashboard's shape ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_is_an_importable_dashboard(dashboard):
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    assert dashboard["id"] is None  # import makes one
    (ds,) = dashboard["__inputs"]
    assert (ds["name"], ds["type"], ds["pluginId"]) == ("DS_PROMETHEUS", "datasource", "prometheus")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"job", "operator"} <= set(variables)

    def datasources(node):  # every datasource reference, anywhere
        if isinstance(node, dict):
            if "datasource" in node:
                yield node["datasource"]
            for value in node.values():
                yield from datasources(value)
        elif isinstance(node, list):
            for value in node:
                yield from datasources(value)

    for ref in datasources(dashboard):  # none hard-wired to one Grafana's data source
        assert isinstance(ref, dict), ref
        assert ref["uid"] == DATASOURCE or ref["type"] == "grafana", ref

    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), ids
    cells: dict[tuple[int, int], int] = {}
    for panel in panels:
        assert panel["type"] in PANEL_TYPES and panel["title"], panel
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):  # no two panels overlap
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, (panel["id"], cells[(x, y)])
                cells[(x, y)] = panel["id"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == DATASOURCE, panel["title"]
        targets = panel["targets"]
        assert targets, panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:
            assert isinstance(target["expr"], str) and target["expr"].strip(), panel["title"]
    variable = re.compile(r"\$([a-zA-Z_]\w*)")  # not $1, label_replace's group
    used = {v for _, expr, _ in expressions(dashboard) for v in variable.findall(expr)}
    used |= {v for _, query in variable_queries(dashboard) for v in variable.findall(query)}
    assert used <= set(variables) | GRAFANA_VARIABLES, used - set(variables) - GRAFANA_VARIABLES


def test_every_panel_filters_by_the_job_variable(dashboard):
    """A panel that ignored $job would mix the jobs a Prometheus scrapes."""
    for where, expr, _ in expressions(dashboard):
        for sel in parse(expr).selectors:
            assert ("job", "=~", "$job") in sel.matchers, (where, expr)


# ---- against a running job's endpoint ------------------------------------------------------------

RECORD = Types.TUPLE([Types.LONG(), Types.LONG()])  # key, event time (ms)


class Measured(KeyedProcessFunction):
    """Uses a metric of each kind, so that the user metrics' panels have something to select."""

    def open(self, runtime_context: RuntimeContext):
        group = runtime_context.get_metrics_group()
        self.seen = group.add_group("io").meter("seen")  # stretch_user_io_seen_total
        self.parity = group.add_group("parity", "even").counter("n")  # stretch_user_parity_n{parity}
        self.sizes = group.distribution("size")  # stretch_user_size_count, _sum
        group.gauge("constant", lambda: 7)  # stretch_user_constant

    def process_element(self, value, ctx):
        self.seen.mark_event()
        self.parity.inc()
        self.sizes.update(value[1] % 10)
        yield value


def _exported(text: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Sample names and their labels, scraped over HTTP from a checkpointed event-time job with user
    metrics (the job ends before the tests use them)."""
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(2)
    env.enable_metrics()
    env.enable_checkpointing()
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(10)).with_timestamp_assigner(
        "f1"
    )
    env.from_source(ChannelSource("in", RECORD), strategy, "in").key_by(lambda r: r[0]).process(
        Measured(), output_type=RECORD
    ).name("measured").sink_to(ChannelSink("out"))
    client = env.execute_async("dashboard job")
    try:
        with channels.open_writer(client, "in") as writer:
            stamp = int(time.time() * 1000) - 60_000
            writer.write([(i % 7, stamp + i) for i in range(200)])
            url = next(j for j in running_jobs() if j["job_id"] == client.get_job_id())["metrics"]
            wanted = {"stretch_watermark_lag_seconds", "stretch_user_io_seen_total", "stretch_user_constant"}
            deadline = time.monotonic() + 15  # user metrics come with the workers' reports, each second
            while True:
                found = _exported(urllib.request.urlopen(url, timeout=10).read().decode())
                if wanted <= set(found) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
    finally:
        client.wait(60)
    assert wanted <= set(found), sorted(found)
    return found


def test_every_metric_and_label_on_the_dashboard_is_exported(dashboard, exported):
    assert dashboard_problems(dashboard, exported) == []


def test_a_metric_missing_from_the_endpoint_fails_the_dashboard(dashboard, exported):
    """The check has teeth on the real dashboard too: without one exported metric, it fails."""
    fewer = {n: labels for n, labels in exported.items() if n != "stretch_gate_depth"}
    assert any("'stretch_gate_depth'" in p for p in dashboard_problems(dashboard, fewer))


def test_every_metric_stretch_exports_is_on_the_dashboard(dashboard, exported):
    """The user metrics' panels select by name pattern; every other metric is named on the dashboard."""
    named = {sel.name for _, expr, _ in expressions(dashboard) for sel in parse(expr).selectors if sel.name}
    ours = {n for n in exported if not n.startswith("stretch_user_")}
    assert ours - named == set()
    by_pattern = set()
    for _, expr, _ in expressions(dashboard):
        for sel in parse(expr).selectors:
            if sel.name is None:
                by_pattern |= _names(sel, exported)
    # the meter and the counter and gauge are drawn; distributions (summaries) are left to Explore
    assert by_pattern == {"stretch_user_io_seen_total", "stretch_user_parity_n", "stretch_user_constant"}
