// The stretch UI: polls the JSON API once a second and draws the selected job or the cluster.
// Text from jobs (names, errors) is only ever set as textContent.
"use strict";

const POLL_MS = 1000;
const COLORS = ["#2563eb", "#16a34a", "#d97706", "#7c3aed", "#dc2626", "#0891b2", "#db2777", "#65a30d"];
let canChange = false;
let selected = decodeURIComponent(location.hash.slice(1));
let view = null; // what is drawn now: {kind, key, ...its elements}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c != null) e.append(c);
  return e;
}

const fmt = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
const num = (x) => (x == null ? "–" : fmt.format(x));
const compact = new Intl.NumberFormat("en-US", { notation: "compact", maximumFractionDigits: 1 });
const MAX_EVENTS_SHOWN = 30;
const mb = (b) => (b / 1e6).toLocaleString("en-US", { maximumFractionDigits: 1 }) + " MB";
const when = (t) => (t == null ? "earlier" : new Date(t * 1000).toLocaleTimeString());

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error((await r.json().catch(() => ({}))).error || r.statusText);
  return r.json();
}

// ---- the job list ------------------------------------------------------------------------------
async function pollOverview() {
  const data = await getJSON("/api/overview");
  canChange = data.can_change;
  document.getElementById("access").textContent = canChange
    ? "you may rescale from this page"
    : "read-only: open the URL the UI printed (with its secret) to rescale";
  const list = document.getElementById("jobs");
  list.replaceChildren(
    ...(data.jobs.length
      ? data.jobs.map((j) =>
          el("li", {},
            el("a", { href: "#" + encodeURIComponent(j.key), class: j.key === selected ? "selected" : "", "data-job": j.name },
              el("span", { text: j.name }),
              el("span", { class: "sub", text: `${j.status} · ${j.where}` })))
        )
      : [el("li", { class: "muted", text: "no running jobs" })])
  );
  const link = document.getElementById("cluster-link");
  link.replaceChildren(
    data.cluster ? el("a", { href: "#cluster", class: selected === "cluster" ? "selected" : "", text: "Cluster" }) : ""
  );
  if (!selected && data.jobs.length) selectKey(data.jobs[0].key);
}

function selectKey(key) {
  selected = key;
  history.replaceState(null, "", "#" + encodeURIComponent(key));
  view = null;
  document.getElementById("view").replaceChildren(el("p", { class: "muted", text: "loading…" }));
}
window.addEventListener("hashchange", () => selectKey(decodeURIComponent(location.hash.slice(1))));

// ---- one job ---------------------------------------------------------------------------------------
function layout(graph) {
  // columns by longest path from a source; rows in order of appearance
  const depth = {};
  const preds = {};
  for (const [a, b] of graph.edges) (preds[b] = preds[b] || []).push(a);
  const d = (id, seen = new Set()) => {
    if (depth[id] != null) return depth[id];
    if (seen.has(id)) return 0;
    seen.add(id);
    return (depth[id] = Math.max(-1, ...(preds[id] || []).map((p) => d(p, seen))) + 1);
  };
  const rows = {};
  const pos = {};
  for (const n of graph.nodes) {
    const c = d(n.id);
    rows[c] = (rows[c] || 0) + 1;
    pos[n.id] = { x: 20 + c * 270, y: 20 + (rows[c] - 1) * 170 };
  }
  const width = 20 + (Math.max(...Object.values(depth)) + 1) * 270;
  const height = 20 + Math.max(...Object.values(rows)) * 170;
  return { pos, width, height };
}

function buildJob(key, data) {
  const status = data.status;
  const root = document.getElementById("view");
  const title = el("h1", { text: status.name });
  const facts = el("div", { class: "muted" });
  const graphBox = el("div", { class: "graph" });
  const { pos, width, height } = layout(status.graph);
  graphBox.style.height = height + "px";
  graphBox.style.minWidth = width + "px";
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  for (const [a, b] of status.graph.edges) {
    const p = document.createElementNS("http://www.w3.org/2000/svg", "path");
    const x1 = pos[a].x + 220, y1 = pos[a].y + 30, x2 = pos[b].x, y2 = pos[b].y + 30;
    p.setAttribute("d", `M${x1},${y1} C${x1 + 30},${y1} ${x2 - 30},${y2} ${x2},${y2}`);
    p.setAttribute("stroke", "#94a3b8");
    p.setAttribute("fill", "none");
    p.setAttribute("stroke-width", "2");
    p.setAttribute("marker-end", "url(#arrow)");
    svg.append(p);
  }
  svg.insertAdjacentHTML("afterbegin",
    '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#94a3b8"/></marker></defs>');
  graphBox.append(svg);
  const operators = {};
  for (const n of status.graph.nodes) {
    const keyed = !["source", "sink"].includes(n.kind);
    const box = el("div", { class: "node " + (keyed ? "keyed" : n.kind), "data-node": n.name },
      el("div", { class: "name", text: n.name, title: n.name }),
      el("div", { class: "kind", text: keyed ? `keyed · ${n.kind}` : n.kind }),
      n.chained.length ? el("div", { class: "chained", text: "chained: " + n.chained.join(" → ") }) : null);
    box.style.left = pos[n.id].x + "px";
    box.style.top = pos[n.id].y + "px";
    if (keyed) {
      const op = { facts: el("div", { class: "facts" }), bars: el("div", { class: "bars" }), message: el("div", { class: "message" }) };
      op.input = el("input", { type: "number", min: "1", "data-rescale-input": n.name, "aria-label": `new parallelism of ${n.name}` });
      op.button = el("button", { "data-rescale": n.name, text: "Rescale" });
      op.button.addEventListener("click", () => rescale(key, n.name, op));
      op.input.addEventListener("input", () => { op.touched = true; });
      box.append(op.facts, op.bars, el("div", { class: "rescale" }, op.input, op.button), op.message);
      box.setAttribute("data-operator", n.name);
      operators[n.name] = op;
    }
    graphBox.append(box);
  }
  const charts = el("div", { class: "charts" });
  const opsTable = el("table", {});
  const events = el("table", {});
  root.replaceChildren(title, facts, el("h3", { text: "Job graph" }), graphBox,
    el("h3", { text: "The last minutes" }), charts, el("h3", { text: "Operators" }), opsTable,
    el("h3", { text: "Rescales, updates and checkpoints" }), events);
  return { kind: "job", key, facts, operators, charts, chartObjs: null, opsTable, events, shape: graphShape(status) };
}

const graphShape = (status) => JSON.stringify(status.graph);

function updateJob(data) {
  const s = data.status;
  const ck = s.checkpoints;
  const ckText = ck
    ? ck.latest
      ? ` · checkpoint ${ck.latest.id} (${ck.latest.duration_ms.toFixed(0)} ms, ${mb(ck.latest.bytes)}), ${ck.completed} completed, ${ck.failed} failed`
      : " · no checkpoint yet"
    : "";
  view.facts.replaceChildren(el("span", { class: "badge " + s.status, text: s.status }),
    document.createTextNode(` job ${s.job_id.slice(0, 12)} · ${s.where}${ckText}`));
  for (const op of s.operators) {
    const o = view.operators[op.name];
    if (!o) continue;
    o.facts.replaceChildren(
      document.createTextNode("parallelism "), el("span", { class: "parallelism", "data-parallelism": op.name, text: String(op.parallelism) }),
      document.createTextNode(` · gate ${num(op.gate_depth)} · state ${mb(op.state_bytes)}`));
    const busy = data.busy[op.name] || [];
    o.bars.replaceChildren(...op.instances.map((inst, i) => {
      const b = busy[i] ?? 0;
      const bar = el("div", { class: "bar" + (b > 0.9 ? " hot" : b > 0.6 ? " warm" : ""), title: `#${inst.index}: busy ${(b * 100).toFixed(0)}%` }, el("i"));
      bar.firstChild.style.height = (b * 100).toFixed(0) + "%";
      return bar;
    }));
    o.button.disabled = !canChange || o.busy;
    if (!o.touched && document.activeElement !== o.input) o.input.value = op.parallelism;
  }
  drawCharts(data.series);
  view.opsTable.replaceChildren(
    el("tr", {}, ...["operator", "kind", "parallelism", "epoch", "code", "gate depth", "state", "records in", "records out", "busy per instance"]
      .map((h, i) => el("th", { class: i >= 2 && i < 9 ? "num" : "", text: h }))),
    ...s.operators.map((op) => el("tr", {},
      el("td", { text: op.name }), el("td", { text: op.kind }),
      el("td", { class: "num", text: String(op.parallelism) }), el("td", { class: "num", text: String(op.epoch) }),
      el("td", { class: "num", text: String(op.code_version) }), el("td", { class: "num", text: num(op.gate_depth) }),
      el("td", { class: "num", text: mb(op.state_bytes) }), el("td", { class: "num", text: num(op.records_in) }),
      el("td", { class: "num", text: num(op.records_out) }),
      el("td", { text: (data.busy[op.name] || []).map((b) => (b * 100).toFixed(0) + "%").join(" ") }))));
  const evs = [...data.events].reverse().slice(0, MAX_EVENTS_SHOWN);
  view.events.replaceChildren(el("tr", {}, el("th", { text: "when" }), el("th", { text: "what" }), el("th", { text: "" })),
    ...(evs.length ? evs.map((e) => el("tr", { "data-event": e.kind },
      el("td", { text: when(e.t) }), el("td", { text: e.kind }), el("td", {}, report(e))))
      : [el("tr", {}, el("td", { class: "muted", text: "none yet", colspan: "3" }))]));
}

// an event's text, opening onto its whole report; what is open stays open across refreshes
const opened = new Set();
function report(e) {
  const id = `${e.kind}|${e.t}|${e.text}`;
  const details = el("details", { class: "report" }, el("summary", { text: e.text }),
    el("pre", { text: JSON.stringify(e.report, null, 1) }));
  details.open = opened.has(id);
  details.addEventListener("toggle", () => (details.open ? opened.add(id) : opened.delete(id)));
  return details;
}

async function rescale(key, operator, op) {
  const parallelism = parseInt(op.input.value, 10);
  op.busy = true;
  op.button.disabled = true;
  op.message.className = "message";
  op.message.textContent = `rescaling to ${parallelism}…`;
  try {
    const r = await fetch("/api/rescale", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ job: key, operator, parallelism }),
    });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error || r.statusText);
    const rep = body.report;
    op.message.textContent = `rescaled ${rep.old_parallelism} → ${rep.new_parallelism} in ${rep.elapsed_ms.toFixed(1)} ms`;
  } catch (e) {
    op.message.className = "message error";
    op.message.textContent = e.message;
  } finally {
    op.busy = false;
    op.touched = false;
  }
}

function drawCharts(series) {
  const names = Object.keys(series.operators);
  const sig = names.join("\u0000");
  const specs = [
    ["Records read per second", "rate_in", (v) => (v == null ? "–" : compact.format(v))],
    ["Backlog wait (gate depth ÷ read rate), s", "wait_s", (v) => (v == null ? "–" : v.toFixed(2))],
    ["Parallelism", "parallelism", (v) => (v == null ? "–" : String(v))],
  ];
  if (!view.chartObjs || view.chartSig !== sig) {
    view.charts.replaceChildren();
    const width = Math.max(300, Math.floor((view.charts.clientWidth - 2 * 12) / 3) - 18);
    view.chartObjs = specs.map(([title, field, value]) => {
      const box = el("div", { class: "chart", "data-chart": field }, el("div", { class: "title", text: title }));
      view.charts.append(box);
      return new uPlot({
        width, height: 190,
        series: [{}, ...names.map((n, i) => ({ label: n, stroke: COLORS[i % COLORS.length], width: 2, value: (u, v) => value(v), paths: field === "parallelism" ? uPlot.paths.stepped({ align: 1 }) : undefined }))],
        axes: [{}, { size: 60, values: (u, vals) => vals.map(value) }],
        scales: { y: { range: (u, lo, hi) => [0, Math.max(hi * 1.1, field === "parallelism" ? 2 : 1)] } },
        legend: { live: false },
      }, [[], ...names.map(() => [])], box);
    });
    view.chartSig = sig;
  }
  specs.forEach(([, field], i) => view.chartObjs[i].setData([series.t, ...names.map((n) => series.operators[n][field])]));
}

// ---- the cluster --------------------------------------------------------------------------------------
function drawCluster(c) {
  const root = document.getElementById("view");
  const colorOf = Object.fromEntries(c.nodes.map((n, i) => [n.node, COLORS[i % COLORS.length]]));
  const moving = new Set(c.handoff ? c.handoff.key_groups : []);
  const map = el("div", { class: "kgmap", "data-kgmap": "" },
    ...c.owners.map((node, kg) => {
      const cell = el("div", { class: "kg" + (moving.has(kg) ? " moving" : ""), title: `key group ${kg}: ${node}`, "data-owner": node });
      cell.style.background = colorOf[node] || "#9ca3af";
      return cell;
    }));
  const legend = el("div", { class: "legend" },
    ...c.nodes.map((n) => { const i = el("i"); i.style.background = colorOf[n.node]; return el("span", {}, i, document.createTextNode(n.node)); }));
  const nodes = el("table", {},
    el("tr", {}, ...["node", "where", "key groups", "jobs"].map((h) => el("th", { text: h }))),
    ...c.nodes.map((n) => el("tr", { "data-cluster-node": n.node },
      el("td", { text: n.node }), el("td", { text: n.location }),
      el("td", { class: "num", text: String(n.key_groups) }),
      el("td", { text: Object.entries(n.jobs).map(([name, st]) => `${name} (${st})`).join(", ") || "none" }))));
  const handoff = c.progress
    ? el("p", { "data-handoff": "", text: `node change under way: ${c.progress.moved} of ${c.progress.key_groups} key groups moved` +
        (c.handoff ? `; now ${c.handoff.key_groups.length} from ${c.handoff.src} to ${c.handoff.dst}` : "") })
    : el("p", { class: "muted", text: "no node change under way" });
  const changes = el("table", {},
    el("tr", {}, ...["finished", "routing version", "key groups moved", "state moved", "took", "longest stall"].map((h) => el("th", { text: h }))),
    ...(c.changes.length ? [...c.changes].reverse().map((r) => el("tr", { "data-change": String(r.version) },
      el("td", { text: when(r.finished_at) }), el("td", { text: `${r.version} (${r.steps} steps)` }),
      el("td", { class: "num", text: String(r.key_groups_moved) }),
      el("td", { class: "num", text: mb(r.bytes_moved) }), el("td", { class: "num", text: r.elapsed_ms.toFixed(0) + " ms" }),
      el("td", { class: "num", text: r.max_stall_ms.toFixed(1) + " ms" })))
      : [el("tr", {}, el("td", { class: "muted", colspan: "6", text: "none yet" }))]));
  root.replaceChildren(el("h1", { text: "Cluster" }),
    el("div", { class: "muted", text: `${c.nodes.length} nodes · routing version ${c.version} · ${c.owners.length} key groups · ${c.address}` }),
    el("h3", { text: "Nodes" }), nodes,
    el("h3", { text: "Key groups → nodes" }), legend, map, handoff,
    el("h3", { text: "Node changes" }), changes);
  view = { kind: "cluster" };
}

// ---- the loop ------------------------------------------------------------------------------------------
async function tick() {
  try {
    await pollOverview();
    if (selected === "cluster") {
      drawCluster(await getJSON("/api/cluster"));
    } else if (selected) {
      const data = await getJSON("/api/job?key=" + encodeURIComponent(selected));
      if (!view || view.key !== selected || view.shape !== graphShape(data.status)) view = buildJob(selected, data);
      updateJob(data);
    }
  } catch (e) {
    if (selected && selected !== "cluster") {
      view = null;
      document.getElementById("view").replaceChildren(el("p", { class: "muted", text: e.message }));
    }
  } finally {
    setTimeout(tick, POLL_MS);
  }
}
tick();
