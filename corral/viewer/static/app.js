// corral view: the page. Plain JavaScript, no build step.
//
// Every string that came from a run (model output, tool results, task ids, reasons) is put
// into the page as a text node (el() below, textContent): never as HTML. The server's
// Content-Security-Policy allows this file's script only, so an escaping slip still runs
// nothing injected.
"use strict";

const ROW_H = 24; // episode list row height (px), fixed: the list renders only what is seen
const TOKEN_ROW_H = 20; // token view row height (px)
const TOKENS_PER_ROW = 32; // a token row ends after a newline or this many tokens
const OVERSCAN = 10; // rows rendered above and below the visible ones

const state = { info: null, columns: null, episodeCache: new Map() };

// -- helpers --------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = String(value);
    // Through the CSSOM: the CSP forbids style attributes, not style properties.
    else if (key === "style") node.style.cssText = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

async function getJSON(url) {
  const answer = await fetch(url, { headers: { Accept: "application/json" } });
  const body = await answer.json();
  if (!answer.ok) throw new Error(body.error || answer.statusText);
  return body;
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toFixed(digits);
  return String(value);
}

function show(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes);
}

function setName(id) {
  const s = state.info.sets[id];
  const source = state.info.sources[s.source];
  const own = s.step !== null ? `eval @ step ${s.step}` : s.name === "." ? s.kind : s.name;
  return state.info.sources.length > 1 ? `${source.name}: ${own}` : own;
}

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, query] = raw.split("?");
  return { parts: path ? path.split("/").map(decodeURIComponent) : [], params: new URLSearchParams(query || "") };
}

// -- start ----------------------------------------------------------------------------------

async function start() {
  try {
    state.info = await getJSON("/api/sources");
  } catch (error) {
    show(el("p", { class: "error", text: `the viewer's API did not answer: ${error.message}` }));
    return;
  }
  const count = state.info.sets.reduce((n, s) => n + s.episodes, 0);
  document.getElementById("status").textContent =
    `${state.info.sources.length} source(s), ${state.info.sets.length} episode set(s), ${count} episodes`;
  window.addEventListener("hashchange", route);
  route();
}

async function route() {
  hideTip();
  const { parts, params } = parseHash();
  try {
    if (parts[0] === "episodes") await viewEpisodes(params);
    else if (parts[0] === "episode") await viewEpisode(Number(parts[1]), Number(parts[2]));
    else if (parts[0] === "sample") await viewSample(Number(parts[1]), Number(parts[2]), Number(parts[3]));
    else if (parts[0] === "session" && parts[2] === "sample") await viewSessionSample(parts[1], Number(parts[3]));
    else if (parts[0] === "session") await viewSession(parts[1]);
    else if (parts[0] === "compare") await viewCompare(params);
    else await viewRuns();
  } catch (error) {
    show(el("p", { class: "error", text: error.message }));
  }
}

// -- runs and steps -------------------------------------------------------------------------

async function viewRuns() {
  const nodes = [];
  if (state.info.gateway) nodes.push(await gatewayBox());
  for (const source of state.info.sources) {
    const card = el("section", { class: "card" },
      el("h2", { text: `${source.kind} ${source.name}` }),
      el("div", { class: "muted", text: source.path }));
    if (source.has_metrics) {
      const run = await getJSON(`/api/runs/${source.id}`);
      card.append(runCharts(run), droppedTable(run.dropped));
    }
    card.append(setsTable(source));
    nodes.push(card);
  }
  show(...nodes);
}

async function gatewayBox() {
  const input = el("input", { id: "session-id", placeholder: "session id", size: 40 });
  const go = () => { if (input.value.trim()) location.hash = `#/session/${encodeURIComponent(input.value.trim())}`; };
  input.addEventListener("keydown", (e) => { if (e.key === "Enter") go(); });
  const card = el("section", { class: "card" },
    el("h2", { text: `gateway ${state.info.gateway}` }),
    input, " ", el("button", { onclick: go, text: "open" }));
  let listed;
  try {
    listed = await getJSON("/api/gateway/sessions");
  } catch (error) {
    card.append(el("p", { class: "error", text: `the gateway did not list its sessions: ${error.message}` }));
    return card;
  }
  const shown = listed.sessions.length;
  card.append(el("p", { id: "session-count", class: "muted",
    text: `${listed.total} open session(s)${shown < listed.total ? `, the newest ${shown} listed` : ""}` }));
  const table = el("table", { id: "sessions" },
    el("tr", {}, ...["session", "task", "turns", "trajectories", "reward", "age"].map((h) => el("th", { text: h }))));
  for (const s of listed.sessions) {
    const reward = s.failure !== null
      ? el("span", { class: "failed", title: s.failure, text: "failed" })
      : el("span", { text: s.reward === null ? "-" : Number(s.reward).toFixed(3) });
    table.append(el("tr", { class: "session-row" },
      el("td", {}, el("a", { href: `#/session/${encodeURIComponent(s.id)}`, text: s.id })),
      el("td", { text: s.task_id === null || s.task_id === undefined ? "" : String(s.task_id) }),
      el("td", { text: String(s.turns) }), el("td", { text: String(s.trajectories) }),
      el("td", {}, reward), el("td", { text: `${Math.round(s.age_s)} s` })));
  }
  card.append(table);
  return card;
}

function setsTable(source) {
  const table = el("table", {},
    el("tr", {}, ...["episodes of", "step", "weights", "episodes", "mean ± se", "failed", ""].map((h) => el("th", { text: h }))));
  for (const id of source.sets) {
    const s = state.info.sets[id];
    const overall = (s.summary && (s.summary.overall || s.summary)) || {};
    const mean = overall.mean === undefined || overall.mean === null ? "–" : `${fmt(overall.mean)} ± ${fmt(overall.se)}`;
    table.append(el("tr", {},
      el("td", {}, el("a", { href: `#/episodes?set=${id}`, text: s.name })),
      el("td", { class: "num", text: fmt(s.step) }),
      el("td", { text: fmt(s.weight_version) }),
      el("td", { class: "num", text: s.episodes }),
      el("td", { class: "num", text: mean }),
      el("td", { class: "num", text: fmt(overall.failed) }),
      el("td", {}, id > 0 ? el("a", { href: `#/compare?a=${id - 1}&b=${id}`, text: "compare with previous" }) : "")));
  }
  return el("div", {}, el("h3", { text: "episode sets" }), table);
}

function droppedTable(dropped) {
  if (!dropped.length) return el("p", { class: "muted", text: "no group was dropped" });
  const table = el("table", {}, el("tr", {}, ...["step", "group", "tasks", "reason", "detail"].map((h) => el("th", { text: h }))));
  for (const d of dropped) {
    table.append(el("tr", {},
      el("td", { class: "num", text: fmt(d.step) }), el("td", { class: "num", text: fmt(d.group_index) }),
      el("td", { text: (d.tasks || []).join(", ") }), el("td", { class: "failed", text: fmt(d.reason) }),
      el("td", {}, el("pre", { class: "text", text: fmt(d.detail) }))));
  }
  return el("div", {}, el("h3", { text: `dropped groups (${dropped.length})` }), table);
}

const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];

function points(lines, key) {
  return lines.filter((l) => typeof l[key] === "number" && Number.isFinite(l[key])).map((l) => [l.step, l[key]]);
}

function runCharts(run) {
  const { steps, evals } = run;
  const charts = el("div", { class: "charts" });
  const rewardSeries = [{ name: "train reward (mean)", points: points(steps, "reward/mean") }];
  const se = new Map(points(evals, "eval/reward/se"));
  const evalMean = points(evals, "eval/reward/mean");
  if (evalMean.length) rewardSeries.push({ name: "eval reward (mean ± se)", points: evalMean, band: evalMean.map(([s, v]) => [s, v - (se.get(s) || 0), v + (se.get(s) || 0)]), color: "#000" });
  const groups = [...new Set(evals.flatMap((l) => Object.keys(l).filter((k) => k.startsWith("eval/group/"))))].sort();
  for (const key of groups) rewardSeries.push({ name: `eval, group ${key.slice(11)}`, points: points(evals, key), thin: true });
  charts.append(lineChart("reward", rewardSeries));
  charts.append(lineChart("the update", ["kl", "entropy", "clip_fraction"].map((k) => ({ name: k, points: points(steps, k) }))));
  charts.append(stackedChart("time per step (s)", steps, ["time/generation", "time/training", "time/weight_sync"]));
  const dropKeys = [...new Set(steps.flatMap((l) => Object.keys(l).filter((k) => k.startsWith("dropped/"))))].sort();
  charts.append(lineChart("groups dropped by the filter", dropKeys.map((k) => ({ name: k.slice(8), points: points(steps, k) }))));
  return charts;
}

function frame(allPoints, yZero) {
  const xs = allPoints.map((p) => p[0]);
  const ys = allPoints.map((p) => p[1]);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys, yZero ? 0 : Infinity), Math.max(...ys)];
  if (!Number.isFinite(x0)) [x0, x1] = [0, 1];
  if (!Number.isFinite(y0)) [y0, y1] = [0, 1];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y1 = y0 + 1; }
  const W = 460, H = 220, L = 44, B = 24, T = 8, R = 8;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - B - T);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  root.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }), svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  for (const y of [y0, (y0 + y1) / 2, y1]) root.append(svg("text", { x: 2, y: sy(y) + 4 }, fmt(y, 2)));
  for (const x of [...new Set(xs)].slice(0, 20)) root.append(svg("text", { x: sx(x) - 3, y: H - 6 }, String(x)));
  return { root, sx, sy };
}

function legend(series) {
  return el("div", { class: "legend" }, ...series.map((s, i) => el("span", {}, el("i", { style: `background:${s.color || PALETTE[i % PALETTE.length]}` }), s.name)));
}

function lineChart(title, series) {
  series = series.filter((s) => s.points.length);
  const box = el("div", { class: "card chart" }, el("h3", { text: title }));
  if (!series.length) { box.append(el("p", { class: "muted", text: "nothing measured" })); return box; }
  const all = series.flatMap((s) => [...s.points, ...(s.band || []).flatMap(([x, lo, hi]) => [[x, lo], [x, hi]])]);
  const { root, sx, sy } = frame(all, false);
  series.forEach((s, i) => {
    const color = s.color || PALETTE[i % PALETTE.length];
    if (s.band) {
      const up = s.band.map(([x, , hi]) => `${sx(x)},${sy(hi)}`);
      const down = s.band.slice().reverse().map(([x, lo]) => `${sx(x)},${sy(lo)}`);
      root.append(svg("polygon", { points: [...up, ...down].join(" "), fill: color, "fill-opacity": 0.12 }));
    }
    root.append(svg("polyline", { points: s.points.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" "), fill: "none", stroke: color, "stroke-width": s.thin ? 1 : 2, "stroke-opacity": s.thin ? 0.6 : 1 }));
    for (const [x, y] of s.points) {
      root.append(svg("circle", { cx: sx(x), cy: sy(y), r: s.thin ? 2 : 3.5, fill: color }, svg("title", {}, `${s.name}, step ${x}: ${fmt(y, 4)}`)));
    }
  });
  box.append(root, legend(series));
  return box;
}

function stackedChart(title, steps, keys) {
  const box = el("div", { class: "card chart" }, el("h3", { text: title }));
  const rows = steps.map((l) => [l.step, keys.map((k) => (typeof l[k] === "number" ? l[k] : 0))]);
  if (!rows.length) { box.append(el("p", { class: "muted", text: "no step yet" })); return box; }
  const all = rows.flatMap(([s, vs]) => [[s - 0.5, 0], [s + 0.5, vs.reduce((a, b) => a + b, 0)]]);
  const { root, sx, sy } = frame(all, true);
  for (const [step, values] of rows) {
    let bottom = 0;
    values.forEach((v, i) => {
      const w = Math.max(2, (sx(step + 0.4) - sx(step - 0.4)));
      root.append(svg("rect", { x: sx(step) - w / 2, y: sy(bottom + v), width: w, height: Math.max(0, sy(bottom) - sy(bottom + v)), fill: PALETTE[i] },
        svg("title", {}, `step ${step}, ${keys[i].slice(5)}: ${fmt(v, 3)} s`)));
      bottom += v;
    });
  }
  box.append(root, legend(keys.map((k) => ({ name: k.slice(5) }))));
  return box;
}

// -- the episode list -----------------------------------------------------------------------

async function loadColumns() {
  if (!state.columns) state.columns = await getJSON("/api/episodes");
  return state.columns;
}

const LIST_FIELDS = [
  ["set", "set"], ["task_id", "task"], ["attempt", "try"], ["group", "group"], ["family", "family"],
  ["reward", "reward"], ["turns", "turns"], ["tool_calls", "calls"], ["seconds", "seconds"],
  ["weight_version", "weights"], ["reason", "status / reason"],
];

async function viewEpisodes(params) {
  const c = await loadColumns();
  const n = c.task_id.length;
  const distinct = (key) => [...new Set(c[key].filter((v) => v !== null))].sort((a, b) => String(a).localeCompare(String(b), undefined, { numeric: true }));
  const select = (name, label, values, labels) => el("label", {}, label,
    el("select", { name }, el("option", { value: "", text: "all" }), ...values.map((v, i) => el("option", { value: String(v), text: labels ? labels[i] : String(v) }))));
  const groupBy = [...new Set(state.info.sets.map((s) => s.group_by).filter(Boolean))].join(", ");
  const setIds = distinct("set");
  const form = el("div", { class: "filters card" },
    select("set", "episode set", setIds, setIds.map(setName)),
    el("label", {}, "reward ≥", el("input", { type: "number", step: "any", name: "rmin" })),
    el("label", {}, "reward ≤", el("input", { type: "number", step: "any", name: "rmax" })),
    select("status", "status", ["failed", "flagged", "ok"]),
    select("group", groupBy ? `group (${groupBy})` : "group", distinct("group")),
    select("family", "task family", distinct("family")),
    select("weight_version", "weights", distinct("weight_version")),
    el("label", {}, "task id contains", el("input", { type: "search", name: "q" })),
    el("span", { id: "ep-count" }));
  for (const [key, value] of params) {
    const input = form.querySelector(`[name="${CSS.escape(key)}"]`);
    if (input) input.value = value;
  }
  const head = el("div", { class: "ep-head" });
  const list = el("div", { class: "vlist", id: "ep-list" });
  const spacer = el("div", { class: "spacer" });
  list.append(spacer);
  let sortKey = params.get("sort") || null;
  let sortDir = 1;
  let order = [];
  for (const [key, label] of LIST_FIELDS) {
    head.append(el("span", { "data-key": key, text: label, onclick: () => {
      sortDir = sortKey === key ? -sortDir : 1;
      sortKey = key;
      apply();
    } }));
  }
  const value = (name) => form.querySelector(`[name="${name}"]`).value;
  function apply() {
    const set = value("set"), status = value("status"), group = value("group"), family = value("family");
    const version = value("weight_version"), q = value("q").toLowerCase();
    const rmin = value("rmin") === "" ? null : Number(value("rmin"));
    const rmax = value("rmax") === "" ? null : Number(value("rmax"));
    order = [];
    for (let i = 0; i < n; i++) {
      if (set !== "" && String(c.set[i]) !== set) continue;
      if (status === "failed" && !c.failed[i]) continue;
      if (status === "flagged" && !c.flagged[i]) continue;
      if (status === "ok" && c.flagged[i]) continue;
      if (group !== "" && String(c.group[i]) !== group) continue;
      if (family !== "" && c.family[i] !== family) continue;
      if (version !== "" && c.weight_version[i] !== version) continue;
      if (rmin !== null && !(c.reward[i] !== null && c.reward[i] >= rmin)) continue;
      if (rmax !== null && !(c.reward[i] !== null && c.reward[i] <= rmax)) continue;
      if (q && !c.task_id[i].toLowerCase().includes(q)) continue;
      order.push(i);
    }
    if (sortKey) {
      const col = c[sortKey];
      order.sort((a, b) => {
        const x = col[a], y = col[b];
        if (x === y) return a - b;
        if (x === null) return 1;
        if (y === null) return -1;
        return (x < y ? -1 : 1) * sortDir;
      });
    }
    for (const span of head.children) span.textContent = LIST_FIELDS.find(([k]) => k === span.dataset.key)[1] + (span.dataset.key === sortKey ? (sortDir > 0 ? " ▲" : " ▼") : "");
    document.getElementById("ep-count").textContent = `${order.length} of ${n} episodes`;
    spacer.style.height = `${order.length * ROW_H}px`;
    list.scrollTop = 0;
    paint();
  }
  function cell(i, key) {
    const v = c[key][i];
    if (key === "set") return el("span", { text: setName(v) });
    if (key === "reason") {
      if (c.failed[i]) return el("span", { class: "failed", title: v || "", text: `failed: ${v || ""}` });
      if (c.flagged[i]) return el("span", { class: "flagged", text: v || "flagged" });
      return el("span", { class: "muted", text: "ok" });
    }
    return el("span", { class: typeof v === "number" ? "num" : "", text: key === "reward" || key === "seconds" ? fmt(v) : fmt(v) });
  }
  function paint() {
    const first = Math.max(0, Math.floor(list.scrollTop / ROW_H) - OVERSCAN);
    const last = Math.min(order.length, Math.ceil((list.scrollTop + list.clientHeight) / ROW_H) + OVERSCAN);
    const rows = [];
    for (let r = first; r < last; r++) {
      const i = order[r];
      const row = el("div", { class: "ep-row", "data-set": c.set[i], "data-line": c.line[i], style: `top:${r * ROW_H}px` },
        ...LIST_FIELDS.map(([key]) => cell(i, key)));
      row.addEventListener("click", () => { location.hash = `#/episode/${c.set[i]}/${c.line[i]}`; });
      rows.push(row);
    }
    spacer.replaceChildren(...rows);
  }
  list.addEventListener("scroll", () => requestAnimationFrame(paint));
  form.addEventListener("input", apply);
  form.addEventListener("change", apply);
  show(el("h2", { text: "episodes" }), form, head, list);
  apply();
}

// -- one episode ----------------------------------------------------------------------------

async function episodeDetail(set, line) {
  const key = `${set}/${line}`;
  if (!state.episodeCache.has(key)) state.episodeCache.set(key, await getJSON(`/api/episodes/${set}/${line}`));
  return state.episodeCache.get(key);
}

async function viewEpisode(set, line) {
  const detail = await episodeDetail(set, line);
  renderEpisode(detail, (n) => `#/sample/${set}/${line}/${n}`, setName(set));
}

async function viewSession(id) {
  const detail = await getJSON(`/api/gateway/sessions/${encodeURIComponent(id)}`);
  renderEpisode(detail, (n) => `#/session/${encodeURIComponent(id)}/sample/${n}`, "gateway session");
}

function renderEpisode(detail, sampleHref, where) {
  const r = detail.record;
  const title = el("h2", {}, `${r.task_id} `, el("span", { class: "muted", text: `${where}${detail.weight_version ? ", weights " + detail.weight_version : ""}` }));
  show(title, gradeBox(detail), timelineBox(detail.spans), samplesBox(detail.samples, sampleHref), conversationBox(r.messages || []));
}

function gradeBox(detail) {
  const r = detail.record;
  const box = el("section", { class: "card", id: "grade" }, el("h3", { text: "grade" }));
  box.append(el("p", {}, "reward ", el("b", { id: "reward", text: fmt(r.reward) }),
    r.failed ? el("span", { class: "failed", text: "  failed" }) : "",
    r.status ? el("span", { class: "pill", text: r.status }) : "",
    detail.summary && detail.summary.group !== undefined && detail.summary.group !== null ? el("span", { class: "muted", text: `  group ${detail.group_by ? detail.group_by + " = " : ""}${detail.summary.group}` }) : ""));
  if (r.reason) box.append(el("pre", { class: "text reason", id: "reason", text: r.reason }));
  if (r.scores && Object.keys(r.scores).length) {
    const table = el("table", {}, el("tr", {}, el("th", { text: "score" }), el("th", { text: "value" })));
    for (const [k, v] of Object.entries(r.scores)) table.append(el("tr", {}, el("td", { text: k }), el("td", { class: "num", text: fmt(v, 4) })));
    box.append(table);
  }
  const agent = r.agent || (r.agent_exit_code !== undefined ? { exit_code: r.agent_exit_code, stderr_tail: r.agent_stderr } : null);
  if (agent) {
    box.append(el("p", { text: `agent: exit ${fmt(agent.exit_code)}${agent.timed_out ? ", timed out" : ""}${agent.killed_reason ? ", killed: " + agent.killed_reason : ""}` }));
    if (agent.stderr_tail) box.append(el("pre", { class: "text", text: agent.stderr_tail }));
  }
  return box;
}

function timelineBox(spans) {
  const box = el("section", { class: "card spans" }, el("h3", { text: spans.kind === "trace" ? "spans" : "time (sums: traces.jsonl would give each call)" }));
  if (!spans.spans.length) { box.append(el("p", { class: "muted", text: "no timing recorded" })); return box; }
  const t0 = Math.min(...spans.spans.map((s) => s.start_s));
  const t1 = Math.max(...spans.spans.map((s) => s.end_s));
  const width = t1 - t0 || 1;
  for (const s of spans.spans) {
    const bar = el("div", { class: "bar", style: `left:${((s.start_s - t0) / width) * 100}%;width:${Math.max(0.3, ((s.end_s - s.start_s) / width) * 100)}%` });
    box.append(el("div", { class: "span", title: JSON.stringify(s.attrs || {}) }, bar, el("span", { class: "label", text: `${s.name}: ${fmt(s.end_s - s.start_s)} s` })));
  }
  return box;
}

function samplesBox(samples, sampleHref) {
  const box = el("section", { class: "card" }, el("h3", { text: `samples (${samples.length})` }));
  if (!samples.length) { box.append(el("p", { class: "muted", text: "this folder keeps no samples for the episode (an eval folder keeps its messages; a play folder's samples.jsonl has the tokens)" })); return box; }
  const table = el("table", {}, el("tr", {}, ...["sample", "tokens", "trained", "status", "weights per turn", "fork"].map((h) => el("th", { text: h }))));
  for (const s of samples) {
    table.append(el("tr", { class: "sample-row" },
      el("td", {}, el("a", { href: sampleHref(s.number), text: `#${s.number} (trajectory ${fmt(s.trajectory)})` })),
      el("td", { class: "num", text: s.tokens }), el("td", { class: "num", text: s.trained_tokens }),
      el("td", { text: fmt(s.status) }), el("td", { text: s.weight_versions.join(", ") }),
      el("td", { class: s.drift ? "flagged fork-cell" : "muted", text: s.drift ? `${s.drift.reason} at token ${fmt(s.drift.position)} (vs trajectory ${fmt(s.drift.compared_trajectory)})` : "–" })));
  }
  box.append(table);
  return box;
}

function textOf(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map((part) => (typeof part === "string" ? part : part.text !== undefined ? part.text : JSON.stringify(part))).join("\n");
  return JSON.stringify(content, null, 2);
}

function prettyArguments(raw) {
  try { return JSON.stringify(JSON.parse(raw), null, 1); } catch { return String(raw); }
}

function conversationBox(messages) {
  const box = el("section", { class: "card", id: "conversation" }, el("h3", { text: `conversation (${messages.length} messages)` }));
  for (const m of messages) {
    const role = String(m.role || "?");
    const node = el("div", { class: `msg ${role.replace(/[^a-z_]/g, "")}` },
      el("div", { class: "role", text: role + (m.tool_call_id ? ` → ${m.tool_call_id}` : "") + (m.name ? ` (${m.name})` : "") }));
    const text = textOf(m.content);
    if (text) node.append(el("pre", { class: "content", text }));
    if (m.reasoning_content) node.append(el("pre", { class: "content muted", text: m.reasoning_content }));
    for (const call of m.tool_calls || []) {
      const fn = call.function || {};
      node.append(el("div", { class: "call" }, el("b", { text: `${fn.name || "?"}` }), el("span", { class: "muted", text: ` ${call.id || ""}` }),
        el("pre", { class: "text", text: prettyArguments(fn.arguments) })));
    }
    box.append(node);
  }
  return box;
}

// -- one sample -----------------------------------------------------------------------------

async function viewSample(set, line, number) {
  const [sample, detail] = await Promise.all([getJSON(`/api/episodes/${set}/${line}/samples/${number}`), episodeDetail(set, line)]);
  renderSample(sample, detail, (n) => `#/sample/${set}/${line}/${n}`, el("a", { href: `#/episode/${set}/${line}`, text: `← ${detail.record.task_id}` }));
}

async function viewSessionSample(id, number) {
  const sample = await getJSON(`/api/gateway/sessions/${encodeURIComponent(id)}/samples/${number}`);
  const detail = await getJSON(`/api/gateway/sessions/${encodeURIComponent(id)}`);
  renderSample(sample, detail, (n) => `#/session/${encodeURIComponent(id)}/sample/${n}`, el("a", { href: `#/session/${encodeURIComponent(id)}`, text: `← session ${id}` }));
}

function tokenText(sample, i) {
  if (!sample.pieces) return `${sample.tokens[i]} `;
  return sample.pieces[i].replace(/\n/g, "↵");
}

function tokenRows(sample) {
  // Row starts: a row ends after a newline piece or TOKENS_PER_ROW tokens.
  const starts = [0];
  let count = 0;
  for (let i = 0; i < sample.tokens.length; i++) {
    count++;
    const breaks = sample.pieces ? sample.pieces[i].includes("\n") : false;
    if ((breaks || count >= TOKENS_PER_ROW) && i + 1 < sample.tokens.length) { starts.push(i + 1); count = 0; }
  }
  return starts;
}

function renderSample(sample, detail, sampleHref, back) {
  const n = sample.tokens.length;
  const trained = sample.mask.filter((m) => m === 1).length;
  const observed = sample.mask.filter((m) => m === 0).length;
  const head = el("div", {}, back, el("h2", { text: `sample #${sample.number} of ${sample.samples}: ${n} tokens, ${trained} trained` }),
    el("div", { class: "legend" },
      el("span", { class: "swatch tok mp", text: `prompt (${n - trained - observed})` }),
      el("span", { class: "swatch tok m0", text: `observation, loss mask 0 (${observed})` }),
      el("span", { class: "swatch tok m1", text: `model output, trained (${trained})` }),
      el("span", { text: `reward ${fmt(sample.reward)}, status ${fmt(sample.status)}, weights per model turn: ${sample.weight_versions.join(", ") || "–"}` })),
    sample.pieces ? "" : el("p", { class: "muted", text: "no tokenizer: ids shown (corral view --tokenizer MODEL_DIR shows text)" }));
  const heatToggle = el("label", {}, el("input", { type: "checkbox", id: "heat" }), " colour trained tokens by logprob");
  const rows = tokenRows(sample);
  const view = el("div", { class: "tokens", id: "tokens" });
  const spacer = el("div", { class: "spacer", style: `height:${rows.length * TOKEN_ROW_H}px;position:relative` });
  view.append(spacer);
  let heat = false;
  let highlight = sample.fork && sample.fork.position !== null ? sample.fork.position : -1;
  const rowOf = (i) => { let lo = 0, hi = rows.length - 1; while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (rows[mid] <= i) lo = mid; else hi = mid - 1; } return lo; };
  function paint() {
    const first = Math.max(0, Math.floor(view.scrollTop / TOKEN_ROW_H) - OVERSCAN);
    const last = Math.min(rows.length, Math.ceil((view.scrollTop + view.clientHeight) / TOKEN_ROW_H) + OVERSCAN);
    const out = [];
    for (let r = first; r < last; r++) {
      const end = r + 1 < rows.length ? rows[r + 1] : n;
      const row = el("div", { class: "trow", style: `top:${r * TOKEN_ROW_H}px` }, el("span", { class: "pos", text: rows[r] }));
      for (let i = rows[r]; i < end; i++) {
        const m = sample.mask[i];
        const span = el("span", { class: `tok ${m === -1 ? "mp" : "m" + m}${i === highlight ? " fork" : ""}`, "data-i": i, text: tokenText(sample, i) });
        if (heat && m === 1 && sample.logprobs[i] !== null) span.style.background = heatColour(sample.logprobs[i]);
        row.append(span);
      }
      out.push(row);
    }
    spacer.replaceChildren(...out);
  }
  view.addEventListener("scroll", () => requestAnimationFrame(paint));
  view.addEventListener("mouseover", (event) => {
    const t = event.target.closest(".tok");
    if (t) showTip(event, tokenTip(sample, Number(t.dataset.i)));
  });
  view.addEventListener("mouseleave", hideTip);
  heatToggle.querySelector("input").addEventListener("change", (e) => { heat = e.target.checked; paint(); });
  const scrollTo = (i) => { highlight = i; view.scrollTop = Math.max(0, rowOf(i) * TOKEN_ROW_H - view.clientHeight / 3); paint(); };
  const nodes = [head];
  const forks = forkBox(sample, detail, sampleHref, scrollTo);
  if (forks) nodes.push(forks);
  nodes.push(el("div", { class: "card" }, heatToggle), view);
  show(...nodes);
  if (highlight >= 0) scrollTo(highlight); else paint();
}

function heatColour(logprob) {
  // p = exp(logprob): red (unlikely) through orange to green (certain).
  const p = Math.exp(logprob);
  return `hsl(${Math.round(p * 120)}, 70%, 78%)`;
}

function tokenTip(sample, i) {
  const m = sample.mask[i];
  const lp = sample.logprobs[i];
  const turn = sample.turn[i];
  const lines = [
    `token ${i}: id ${sample.tokens[i]}${sample.pieces ? " " + JSON.stringify(sample.pieces[i]) : ""}`,
    m === -1 ? "prompt" : m === 0 ? "observation (loss mask 0)" : "model output (trained, loss mask 1)",
  ];
  if (lp !== null && m === 1) lines.push(`logprob ${lp.toFixed(4)}  (p ${Math.exp(lp).toFixed(3)})`);
  if (turn >= 0) lines.push(`model turn ${turn}, weights ${sample.weight_versions[turn] || "?"}`);
  const node = el("div", {}, lines.join("\n"));
  if (lp !== null && m === 1) {
    const bar = el("span", { class: "heat" }, el("b", { style: `left:${Math.round(Math.exp(lp) * 118)}px` }));
    node.append(el("div", {}, "p", bar));
  }
  return node;
}

function forkBox(sample, detail, sampleHref, scrollTo) {
  const forks = (detail.samples || []).filter((s) => s.drift);
  if (!sample.fork && !forks.length) return null;
  const box = el("section", { class: "card", id: "forks" }, el("h3", { text: "forks" }));
  if (sample.fork) {
    const f = sample.fork;
    const compared = (detail.samples || []).find((s) => s.trajectory === f.compared_trajectory);
    box.append(el("p", { class: "fork-summary" },
      `This trajectory started at turn ${fmt(f.turn)}: ${f.reason}`,
      f.position !== null ? `, first divergent token at position ${f.position} (held ${fmt(f.held_token)}, new ${fmt(f.new_token)})` : "",
      f.message_index !== null ? `, in message ${f.message_index} (${fmt(f.message_role)})` : "",
      f.in_model_output ? ", inside model output" : "", ". ",
      compared ? el("a", { href: sampleHref(compared.number), text: `compared trajectory: sample #${compared.number}` }) : ""));
    if (f.explanation) box.append(el("p", { text: f.explanation }));
    if (f.position !== null) box.append(el("button", { text: "go to the divergent token", onclick: () => scrollTo(f.position) }));
    box.append(el("div", {}, el("div", { class: "muted", text: "shared context before the fork" }), el("pre", { class: "text", text: f.context || "" })));
    box.append(el("div", { class: "sides" },
      el("div", {}, el("div", { class: "muted", text: `held (trajectory ${fmt(f.compared_trajectory)}), ${f.held_length} tokens` }), el("pre", { class: "text", id: "held-text", text: f.held_text || "" })),
      el("div", {}, el("div", { class: "muted", text: `new (this sample), ${f.new_length} tokens` }), el("pre", { class: "text", id: "new-text", text: f.new_text || "" }))));
  }
  if (forks.length) {
    const list = el("ul", {});
    for (const s of forks) list.append(el("li", {}, el("a", { href: sampleHref(s.number), text: `sample #${s.number}` }), `: ${s.drift.reason} at token ${fmt(s.drift.position)} of trajectory ${fmt(s.drift.compared_trajectory)}`));
    box.append(el("div", { class: "muted", text: "every fork of this episode" }), list);
  }
  return box;
}

// -- tooltips -------------------------------------------------------------------------------

function showTip(event, node) {
  const tip = document.getElementById("tip");
  tip.replaceChildren(node);
  tip.hidden = false;
  tip.style.left = `${Math.min(event.clientX + 12, window.innerWidth - 430)}px`;
  tip.style.top = `${event.clientY + 16}px`;
}

function hideTip() {
  const tip = document.getElementById("tip");
  if (tip) tip.hidden = true;
}

// -- comparing two sets ---------------------------------------------------------------------

async function viewCompare(params) {
  const ids = state.info.sets.map((s) => s.id);
  const pick = (name, chosen) => el("select", { name }, ...ids.map((id) => el("option", { value: id, text: setName(id), selected: String(id) === chosen })));
  const a = pick("a", params.get("a") || String(ids[0] ?? ""));
  const b = pick("b", params.get("b") || String(ids[ids.length - 1] ?? ""));
  const go = () => { location.hash = `#/compare?a=${a.value}&b=${b.value}`; };
  a.addEventListener("change", go);
  b.addEventListener("change", go);
  const nodes = [el("h2", { text: "two episode sets on the same tasks" }), el("div", { class: "card" }, "A ", a, "  B ", b)];
  if (ids.length && params.get("a") !== null) {
    const c = await getJSON(`/api/compare?a=${a.value}&b=${b.value}`);
    nodes.push(el("p", { class: "card", id: "compare-summary" },
      `${c.paired} paired episodes (${c.unpaired} unpaired): mean B − A = ${fmt(c.mean_diff, 4)} ± ${fmt(c.se, 4)} (se); `,
      `${c.better} better, ${c.worse} worse, ${c.same} the same`));
    const table = el("table", {}, el("tr", {}, ...["task", "try", "group", "A", "B", "B − A"].map((h) => el("th", { text: h }))));
    for (const p of c.pairs.slice().sort((x, y) => x.diff - y.diff)) {
      table.append(el("tr", {},
        el("td", { text: p.task_id }), el("td", { class: "num", text: p.attempt }), el("td", { text: fmt(p.group) }),
        el("td", { class: "num" }, el("a", { href: `#/episode/${c.a}/${p.a_line}`, text: fmt(p.a) })),
        el("td", { class: "num" }, el("a", { href: `#/episode/${c.b}/${p.b_line}`, text: fmt(p.b) })),
        el("td", { class: `num ${p.diff < 0 ? "failed" : ""}`, text: fmt(p.diff) })));
    }
    nodes.push(table);
  }
  show(...nodes);
}

document.addEventListener("DOMContentLoaded", start);
