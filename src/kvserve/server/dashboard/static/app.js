// kvserve dashboard: reads /v1/cache/stream (server-sent events over fetch, so an API key can travel in
// the Authorization header) and draws the block map, the prefix tree, the time series and the requests.
// No build step, no dependencies. The drawn state is exposed as window.kvDashboard for scripts and tests.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const MAP_COLOURS = { ".": "#e6e8ea", "c": "#4a90d9", "x": "#555a60" };
const $ = (id) => document.getElementById(id);
const state = { paused: false, latest: null, drawn: null, frames: 0, colour: "age", abort: null };
window.kvDashboard = state;

// ---- connection --------------------------------------------------------------------------------

function apiKey() {
  const match = location.hash.match(/key=([^&]+)/);
  if (match) {  // a key passed in the fragment (never sent to the server) moves to session storage
    sessionStorage.setItem("kvserve-key", decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname);
  }
  return sessionStorage.getItem("kvserve-key");
}

async function connect() {
  const key = apiKey();
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  state.abort = new AbortController();
  setStatus("connecting…", "");
  try {
    const response = await fetch("/v1/cache/stream", { headers, signal: state.abort.signal });
    if (response.status === 401 || response.status === 403) {
      $("key-form").hidden = false;
      setStatus(key ? "key refused" : "API key needed", "error");
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    $("key-form").hidden = true;
    await readEvents(response.body.pipeThrough(new TextDecoderStream()).getReader());
  } catch (err) {
    if (err.name === "AbortError") return;
    setStatus(`disconnected (${err.message})`, "error");
  }
  setTimeout(connect, 2000);
}

async function readEvents(reader) {
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      onEvent(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
    }
  }
}

function onEvent(block) {
  let kind = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) kind = line.slice(6).trim();
    else if (line.startsWith("data:")) data += line.slice(5).trim();
  }
  if (kind === "error") { setStatus(JSON.parse(data).error, "error"); return; }
  if (kind !== "snapshot") return;
  state.latest = JSON.parse(data);
  if (!state.paused) draw(state.latest);
}

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.className = `tag ${kind}`;
}

// ---- drawing ------------------------------------------------------------------------------------

function draw(snapshot) {
  state.drawn = snapshot;
  state.frames += 1;
  $("model").textContent = `${snapshot.model} · ${snapshot.cache} cache · ${snapshot.block_size} tokens/block`;
  const viewer = snapshot.viewer;
  $("viewer").textContent = viewer.admin ? "admin: whole cache" : `tenant ${viewer.tenant}: own namespace`;
  setStatus(`live · ${new Date(snapshot.time * 1000).toLocaleTimeString()}`, "live");
  drawPool(snapshot.pool);
  drawTree(snapshot.tree);
  drawSeries(snapshot.series);
  drawRequests(snapshot.requests);
  document.body.dataset.frames = String(state.frames);
}

function refColour(refs) {
  return refs <= 1 ? "#f0a030" : refs <= 3 ? "#d0452f" : "#8e2a5c";
}

function drawPool(pool) {
  const canvas = $("block-map");
  const n = pool.num_blocks;
  $("pool-size").textContent = `${n} blocks`;
  const width = canvas.clientWidth || 960;
  const cell = Math.max(1, Math.min(16, Math.floor(Math.sqrt((width * 240) / Math.max(n, 1)))));
  const perRow = Math.max(1, Math.floor(width / cell));
  canvas.width = width;
  canvas.height = Math.max(cell, Math.ceil(n / perRow) * cell);
  const ctx = canvas.getContext("2d");
  const counts = { free: 0, cached: 0, used: 0, shared: 0, hidden: 0 };
  const map = pool.map || "";
  const gap = cell >= 4 ? 1 : 0;
  ctx.font = `${Math.max(7, cell - 5)}px sans-serif`;
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  for (let i = 0; i < map.length; i++) {
    const ch = map[i];
    let colour = MAP_COLOURS[ch];
    if (ch === ".") counts.free++;
    else if (ch === "c") counts.cached++;
    else if (ch === "x") counts.hidden++;
    else {
      const refs = ch === "+" ? 10 : Number(ch);
      counts.used++;
      if (refs > 1) counts.shared++;
      colour = refColour(refs);
    }
    const x = (i % perRow) * cell, y = Math.floor(i / perRow) * cell;
    ctx.fillStyle = colour;
    ctx.fillRect(x, y, cell - gap, cell - gap);
    if (cell >= 12 && ch !== "." && ch !== "c" && ch !== "x" && ch !== "1") {
      ctx.fillStyle = "white";
      ctx.fillText(ch, x + cell / 2, y + cell / 2);
    }
  }
  if (!pool.map) {  // map left out (?block_map=false): the server's counts only
    Object.assign(counts, { free: pool.free, cached: pool.cached, used: pool.used, shared: pool.shared,
      hidden: pool.hidden });
  }
  state.counts = counts;
  for (const [name, value] of Object.entries(counts)) $(`count-${name}`).textContent = value ?? "–";
  $("hidden-legend").hidden = counts.hidden === 0;
}

// The icicle: one row per tree level, width proportional to the tokens under a node.
function drawTree(tree) {
  const svg = $("icicle");
  svg.replaceChildren();
  const nodes = tree.nodes;
  const children = new Map();
  const roots = [];
  for (const node of nodes) {
    if (node.parent === null) roots.push(node);
    else (children.get(node.parent) || children.set(node.parent, []).get(node.parent)).push(node);
  }
  const width = svg.clientWidth || 960, rowHeight = 26;
  const total = roots.reduce((sum, node) => sum + node.subtree_tokens, 0);
  let depth = 0;
  const place = (node, x0, x1, level) => {
    depth = Math.max(depth, level + 1);
    drawNode(svg, node, x0, x1, level * rowHeight, rowHeight);
    let x = x0;
    const kids = (children.get(node.id) || []).sort((a, b) => b.subtree_tokens - a.subtree_tokens);
    for (const child of kids) {
      const w = node.subtree_tokens ? ((x1 - x0) * child.subtree_tokens) / node.subtree_tokens : 0;
      place(child, x, x + w, level + 1);
      x += w;
    }
  };
  let x = 0;
  for (const root of roots.sort((a, b) => b.subtree_tokens - a.subtree_tokens)) {
    const w = total ? (width * root.subtree_tokens) / total : 0;
    place(root, x, x + w, 0);
    x += w;
  }
  svg.setAttribute("height", Math.max(40, depth * rowHeight));
  const runs = nodes.filter((node) => node.kind === "run").length;
  const cut = tree.truncated ? " · large cache: walk cut short, rest counted only" : "";
  $("tree-note").textContent = `${runs} nodes shown (largest ${tree.top})${cut}`;
  if (!nodes.length) {
    const text = document.createElementNS(SVG, "text");
    text.setAttribute("x", 10); text.setAttribute("y", 24); text.textContent = "nothing cached yet";
    svg.append(text);
  }
}

function nodeColour(node) {
  if (node.kind === "namespace") return "#c9ced3";
  if (state.colour === "refs") return node.refs > 1 ? refColour(node.refs) : node.refs === 1 ? "#f0a030" : "#4a90d9";
  if (state.colour === "hits") {
    if (node.hits === null || node.hits === undefined) return "#b9c3cc";
    return `hsl(210, 70%, ${Math.max(30, 85 - 8 * Math.log2(1 + node.hits))}%)`;
  }
  const age = node.age_s ?? 600;  // recent: warm; a minute or more: cool
  return `hsl(${Math.min(220, 20 + age * 3.3)}, 70%, 58%)`;
}

function drawNode(svg, node, x0, x1, y, h) {
  if (x1 - x0 < 0.5) return;
  const rect = document.createElementNS(SVG, "rect");
  rect.setAttribute("class", `node ${node.kind}`);
  for (const [k, v] of Object.entries({ x: x0, y, width: x1 - x0, height: h })) rect.setAttribute(k, v);
  rect.setAttribute("fill", nodeColour(node));
  rect.dataset.id = node.id;
  rect.dataset.kind = node.kind;
  rect.dataset.tokens = node.tokens;
  rect.dataset.start = node.start_tokens;
  rect.dataset.refs = node.refs ?? "";
  rect.dataset.namespace = JSON.stringify(node.namespace);
  rect.addEventListener("mousemove", (event) => showTooltip(event, node));
  rect.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  svg.append(rect);
  const label = nodeLabel(node);
  if (x1 - x0 > 40 && label) {
    const text = document.createElementNS(SVG, "text");
    text.setAttribute("x", x0 + 4); text.setAttribute("y", y + h / 2 + 4);
    text.textContent = label.slice(0, Math.floor((x1 - x0 - 8) / 6.2));
    svg.append(text);
  }
}

function nodeLabel(node) {
  if (node.kind === "namespace") {
    const fields = node.namespace.filter((field) => field !== "");
    return fields.length ? fields.join(" / ") : "(default namespace)";
  }
  if (node.kind === "other") return `${node.count} more`;
  return `${node.tokens} tok · ${node.refs} ref${node.refs === 1 ? "" : "s"}`;
}

function showTooltip(event, node) {
  const tip = $("tooltip");
  const lines = [node.kind === "namespace" ? `namespace ${JSON.stringify(node.namespace)}` : node.kind === "other"
    ? `${node.count} smaller nodes` : `node ${node.id} (from token ${node.start_tokens})`];
  lines.push(`tokens ${node.kind === "run" ? node.tokens : node.subtree_tokens} · blocks ${node.kind === "run"
    ? node.blocks : node.subtree_blocks} · under it ${node.subtree_tokens} tokens`);
  if (node.kind === "run") {
    lines.push(`references ${node.refs}${node.refs_min !== node.refs ? ` (min ${node.refs_min})` : ""} · hits ${
      node.hits ?? "not counted"} · last access ${node.age_s === null ? "–" : `${node.age_s.toFixed(1)} s ago`}`);
    if (node.orphan) lines.push("unreachable: the block before it was evicted");
    if (node.text !== undefined) lines.push(`“${node.text}”`);
  }
  tip.textContent = lines.join("\n");
  tip.hidden = false;
  tip.style.left = `${Math.min(event.clientX + 12, innerWidth - 430)}px`;
  tip.style.top = `${event.clientY + 12}px`;
}

// ---- time series --------------------------------------------------------------------------------

const CHARTS = [
  { title: "hit ratio (device)", lines: [["hit_ratio", "#4a90d9"]], max: 1, fmt: (v) => `${(100 * v).toFixed(0)}%` },
  { title: "TTFT p50 / p90 (s)", lines: [["ttft_p50", "#4a90d9"], ["ttft_p90", "#d0452f"]], fmt: (v) => v.toFixed(3) },
  { title: "tok/s: computed (running) / output (finished)", lines: [["computed_tps", "#4a90d9"], ["output_tps", "#f0a030"]],
    fmt: (v) => v.toFixed(0) },
  { title: "running / waiting", lines: [["running", "#2f9e55"], ["waiting", "#d0452f"]], fmt: (v) => v.toFixed(0) },
  { title: "evictions (blocks per tick)", lines: [["evictions", "#8e2a5c"]], fmt: (v) => v.toFixed(0) },
];

function drawSeries(series) {
  const box = $("charts");
  if (!series) {
    box.replaceChildren();
    $("series-note").textContent = "server-wide series are shown to admins only";
    return;
  }
  $("series-note").textContent = `${series.time.length} points, one per second while a page is open`;
  if (box.children.length !== CHARTS.length) {
    box.replaceChildren(...CHARTS.map((chart) => {
      const div = document.createElement("div");
      div.className = "chart";
      div.innerHTML = `<h3>${chart.title}<span class="now"></span></h3><svg viewBox="0 0 300 90"
        preserveAspectRatio="none"></svg>`;
      return div;
    }));
  }
  CHARTS.forEach((chart, i) => drawChart(box.children[i], chart, series));
}

function drawChart(div, chart, series) {
  const svg = div.querySelector("svg");
  svg.replaceChildren();
  const values = chart.lines.flatMap(([key]) => series[key].filter((v) => v !== null));
  const max = chart.max ?? Math.max(1e-9, ...values);
  const n = series.time.length;
  for (const [key, colour] of chart.lines) {
    const points = series[key].map((v, i) => (v === null ? null
      : `${(300 * i) / Math.max(1, n - 1)},${88 - (86 * v) / max}`)).filter(Boolean);
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", points.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", colour);
    line.setAttribute("stroke-width", "1.5");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(line);
    if (points.length) {  // the newest point as a dot: visible even when it is the only one
      const [x, y] = points.at(-1).split(",");
      const dot = document.createElementNS(SVG, "ellipse");
      for (const [k, v] of Object.entries({ cx: x, cy: y, rx: 2.5, ry: 2.5, fill: colour })) dot.setAttribute(k, v);
      svg.append(dot);
    }
  }
  const last = chart.lines.map(([key]) => series[key].filter((v) => v !== null).at(-1));
  div.querySelector(".now").textContent = last.map((v) => (v === undefined ? "–" : chart.fmt(v))).join(" / ");
}

// ---- requests -----------------------------------------------------------------------------------

function drawRequests(requests) {
  const rows = [...requests.running, ...requests.waiting].map((r) => {
    const total = Math.max(1, r.prompt_tokens + r.output_tokens);
    const computed = Math.max(0, r.computed_tokens - r.cached_tokens);
    return `<tr data-id="${escapeHtml(r.id)}"><td>${escapeHtml(r.id)}</td><td>${escapeHtml(JSON.stringify(
      r.namespace))}</td><td>${r.status}</td><td>${r.prompt_tokens}</td><td>${r.cached_tokens}</td><td>${
      r.computed_tokens}</td><td>${r.output_tokens}</td><td>${r.blocks}</td><td><div class="bar"><span class="c"
      style="width:${(100 * r.cached_tokens) / total}%"></span><span class="p" style="width:${
      (100 * computed) / total}%"></span></div></td></tr>`;
  });
  $("requests").tBodies[0].innerHTML = rows.join("") || '<tr><td colspan="9">no requests</td></tr>';
  $("requests-note").textContent = `${requests.num_running} running · ${requests.num_waiting} waiting`;
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

// ---- controls -----------------------------------------------------------------------------------

$("pause").addEventListener("click", () => {
  state.paused = !state.paused;
  $("pause").textContent = state.paused ? "Resume" : "Pause";
  $("pause").setAttribute("aria-pressed", String(state.paused));
  if (state.paused) setStatus("paused", "paused");
  else if (state.latest) draw(state.latest);
});

for (const input of document.querySelectorAll('input[name="colour"]')) {
  input.addEventListener("change", () => {
    state.colour = input.value;
    if (state.drawn) drawTree(state.drawn.tree);
  });
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("kvserve-key", $("key").value.trim());
  if (state.abort) state.abort.abort();
  connect();
});

connect();
