// kv-gateway's dashboard: polls /admin/status (docs/status.schema.json) with the admin key
// and draws what it reads as SVG. No library, no CDN: the gateway may run offline.
// Rates are differences of the snapshot's cumulative counters, kept in this tab only.
"use strict";

const POLL_MS = 2000;
const HISTORY_S = 300; // the sparklines' span
const KEY = "kv-gateway-admin-key";
const SVG = "http://www.w3.org/2000/svg";
// A header carries bytes: a key with a character outside printable ASCII cannot go as typed
// (fetch throws on most, sends Latin-1 where other clients send UTF-8). The page refuses it
// itself, in the words the gateway uses for a wrong admin key, and sends nothing.
const SENDABLE_KEY = /^[\x20-\x7e]*$/;
const WRONG_KEY = "401: Incorrect admin key provided.";
const LINE_OUTCOMES = ["admitted", "refused", "abandoned", "failed"]; // traffic.queued's keys

const history = []; // {t, doc}, oldest first, at most HISTORY_S old
let timer = null;
let generation = 0; // a poll of an older generation (before a new key, or "forget") is dropped

function $(id) { return document.getElementById(id); }

function el(tag, attrs, text) {
  const node = tag === "svg" || ["rect", "line", "polyline", "title"].includes(tag)
    ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text); // text only, never parsed as HTML: names come from config and engines
  return node;
}

function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits === undefined ? 1 : digits });
}

// A horizontal bar of `total` units: filled parts, an outline, a marker.
function bar(total, parts, width = 420, height = 18) {
  const svg = el("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
  const x = (v) => Math.max(0, Math.min(width, (v / Math.max(total, 1)) * width));
  svg.append(el("rect", { class: "track", x: 0, y: 0, width, height }));
  let at = 0;
  for (const p of parts.filter((p) => p.kind === "fill")) {
    const r = el("rect", { class: p.cls, x: x(at), y: 2, width: x(p.value), height: height - 4 });
    r.append(el("title", {}, `${p.label}: ${fmt(p.value, 0)}`));
    svg.append(r);
    at += p.value;
  }
  for (const p of parts.filter((p) => p.kind !== "fill")) {
    if (p.value === null || p.value === undefined) continue;
    if (p.kind === "outline") {
      const r = el("rect", { class: p.cls, x: 1.5, y: 1.5, width: Math.max(0, x(p.value) - 3), height: height - 3 });
      r.append(el("title", {}, `${p.label}: ${fmt(p.value, 0)}`));
      svg.append(r);
    } else {
      const l = el("line", { class: p.cls, x1: x(p.value), x2: x(p.value), y1: 0, y2: height });
      l.append(el("title", {}, `${p.label}: ${fmt(p.value, 0)}`));
      svg.append(l);
    }
  }
  return svg;
}

function sparkline(points, width = 220, height = 36) {
  const svg = el("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "spark" });
  if (points.length < 2) return svg;
  const t0 = points[0][0], t1 = points[points.length - 1][0];
  const top = Math.max(...points.map((p) => p[1]), 1e-9);
  const xy = points.map(([t, v]) => `${((t - t0) / Math.max(t1 - t0, 1e-9)) * width},${height - 2 - (v / top) * (height - 4)}`);
  svg.append(el("polyline", { class: "line", points: xy.join(" ") }));
  svg.append(el("title", {}, `max ${fmt(top, 2)}`));
  return svg;
}

// Per-second rates of a cumulative figure between consecutive snapshots.
function rates(read) {
  const out = [];
  for (let i = 1; i < history.length; i++) {
    const a = history[i - 1], b = history[i];
    const dt = b.doc.generated_at - a.doc.generated_at;
    if (dt > 0) out.push([b.doc.generated_at, Math.max(0, read(b.doc) - read(a.doc)) / dt]);
  }
  return out;
}

// How much a cumulative figure grew over the last `span_s` seconds (first and last snapshot
// within it), and the seconds that covers: {count, span}; null before two snapshots.
function growthOver(read, span_s) {
  if (history.length < 2) return null;
  const last = history[history.length - 1].doc;
  const first = history.find((h) => last.generated_at - h.doc.generated_at <= span_s).doc;
  return { count: Math.max(0, read(last) - read(first)), span: last.generated_at - first.generated_at };
}

// A rate over the last `span_s` seconds.
function rateOver(read, span_s) {
  const g = growthOver(read, span_s);
  return g !== null && g.span > 0 ? g.count / g.span : null;
}

function queuedOf(doc) {
  return Object.values(doc.traffic.queued || {}).reduce((a, b) => a + b, 0);
}

function tenantOf(doc, name) { return doc.tenants.find((t) => t.name === name) || {}; }

function drawEngines(doc) {
  const box = $("engines");
  box.replaceChildren();
  for (const e of doc.engines) {
    const card = el("div", { class: "engine", "data-engine": e.name });
    const h = el("h3", {}, `${e.name} `);
    h.append(el("span", { class: `badge ${e.healthy ? "healthy" : "unhealthy"}` }, e.healthy ? "healthy" : "unhealthy"));
    h.append(document.createTextNode(` ${e.url} · ${e.models.join(", ")}`));
    card.append(h);
    const total = e.num_gpu_blocks || e.capacity_blocks || 1;
    card.append(bar(total, [
      { kind: "fill", cls: "held", value: e.reserved_blocks, label: "held by the gateway" },
      { kind: "fill", cls: "foreign", value: e.foreign.blocks, label: "not the gateway's" },
      { kind: "outline", cls: "reported", value: e.reported.used_blocks, label: "reported by the engine" },
      { kind: "mark", cls: "cap", value: e.capacity_blocks, label: "capacity" },
    ]));
    card.append(el("p", { class: "figures" },
      `KV blocks: held ${fmt(e.reserved_blocks, 0)} · reported ${fmt(e.reported.used_blocks, 0)} · ` +
      `not the gateway's ${fmt(e.foreign.blocks, 0)} · capacity ${fmt(e.capacity_blocks, 0)} of ${fmt(e.num_gpu_blocks, 0)}`));
    const seqs = e.max_num_seqs + (e.staged_seqs || 0);
    card.append(bar(seqs, [
      { kind: "fill", cls: "held", value: e.reserved_seqs, label: "sequences held" },
      { kind: "outline", cls: "reported", value: e.reported.running, label: "running (engine)" },
      { kind: "mark", cls: "cap", value: e.max_num_seqs, label: "max_num_seqs" },
    ], 420, 12));
    card.append(el("p", { class: "figures" },
      `sequences: held ${fmt(e.reserved_seqs, 0)} · running ${fmt(e.reported.running, 0)} · ` +
      `waiting ${fmt(e.reported.waiting, 0)} · max_num_seqs ${e.max_num_seqs}` +
      (e.staged_seqs ? ` (+${e.staged_seqs} staged)` : "") +
      ` · preemptions ${fmt(e.reported.num_preemptions, 0)} · scraped ${fmt(e.reported.age_s, 1)} s ago`));
    if (e.last_error) card.append(el("p", { class: "error" }, `last error: ${e.last_error}`));
    box.append(card);
  }
}

function drawTraffic(doc) {
  $("queue-length").textContent = fmt(doc.queue.length, 0);
  $("queue-oldest").textContent = doc.queue.oldest_wait_s === null ? "none waiting here" : `${fmt(doc.queue.oldest_wait_s, 1)} s`;
  $("spark-queue").replaceChildren(sparkline(history.map((h) => [h.doc.generated_at, h.doc.queue.length])));
  const admitted = rates((d) => d.traffic.admitted);
  $("admitted-rate").textContent = admitted.length ? fmt(admitted[admitted.length - 1][1], 1) : "–";
  $("spark-admitted").replaceChildren(sparkline(admitted));
  // Requests that waited in the line, as they left it: the total, then by outcome.
  const queued = rates(queuedOf);
  $("queued-rate").textContent = queued.length ? fmt(queued[queued.length - 1][1], 1) : "–";
  $("queued-total").textContent = fmt(queuedOf(doc), 0);
  $("spark-queued").replaceChildren(sparkline(queued));
  $("queued-outcomes").textContent = LINE_OUTCOMES
    .filter((o) => o !== "failed" || (doc.traffic.queued || {}).failed)
    .map((o) => {
      const series = rates((d) => (d.traffic.queued || {})[o] || 0);
      return `${o} ${fmt(series.length ? series[series.length - 1][1] : null, 1)}/s`;
    })
    .join(" · ");
  const reasons = new Set();
  for (const h of history) Object.keys(h.doc.traffic.refused).forEach((r) => reasons.add(r));
  const box = $("refused");
  box.replaceChildren();
  if (!reasons.size) box.append(el("p", { class: "figures" }, "none refused"));
  for (const reason of [...reasons].sort()) {
    const series = rates((d) => d.traffic.refused[reason] || 0);
    const row = el("div", { class: "reason", "data-reason": reason });
    const now = series.length ? series[series.length - 1][1] : 0;
    row.append(el("span", {}, `${reason}: ${fmt(now, 1)}/s (${fmt(doc.traffic.refused[reason] || 0, 0)} in all)`));
    row.append(sparkline(series, 160, 24));
    box.append(row);
  }
}

function drawTenants(doc) {
  const body = $("tenants").tBodies[0];
  body.replaceChildren();
  for (const t of doc.tenants) {
    const tokens = (d) => { const x = tenantOf(d, t.name); return (x.prompt_tokens || 0) + (x.completion_tokens || 0); };
    // What `rpm` bounds: admissions, counted (not extrapolated) over the page's last
    // minute; refusals are in their own column.
    const admitted = growthOver((d) => tenantOf(d, t.name).admitted || 0, 60);
    const tpm = rateOver(tokens, 60);
    const row = el("tr", { "data-tenant": t.name });
    const limit = (v) => (v === null ? "" : ` / ${fmt(v, 0)}`);
    row.append(el("td", {}, t.name));
    row.append(el("td", { "data-field": "in_flight" }, `${fmt(t.in_flight, 0)}${limit(t.limits.max_concurrency)}`));
    row.append(el("td", {}, `${fmt(tpm === null ? null : tpm * 60, 0)}${limit(t.limits.tpm)}` +
      (t.rate_limits && t.rate_limits.remaining_tokens !== null ? ` (${fmt(t.rate_limits.remaining_tokens, 0)} left)` : "")));
    const within = admitted === null || admitted.span >= 55 ? "" : ` in ${fmt(admitted.span, 0)} s`;
    row.append(el("td", { "data-field": "admitted" }, `${admitted === null ? "–" : fmt(admitted.count, 0)}${within}${limit(t.limits.rpm)}` +
      (t.rate_limits && t.rate_limits.remaining_requests !== null ? ` (${fmt(t.rate_limits.remaining_requests, 0)} left)` : "")));
    row.append(el("td", { "data-field": "tokens" }, `${fmt(t.prompt_tokens, 0)} + ${fmt(t.completion_tokens, 0)}`));
    const refusals = Object.entries(t.refusals).map(([r, n]) => `${r} ${n}`).join(", ");
    row.append(el("td", { "data-field": "refusals" }, refusals || "none"));
    const cell = el("td", {});
    cell.append(sparkline(rates(tokens).map(([x, v]) => [x, v * 60]), 160, 24));
    row.append(cell);
    body.append(row);
  }
}

function drawModels(doc) {
  const body = $("models").tBodies[0];
  body.replaceChildren();
  for (const m of doc.models) {
    const row = el("tr", { "data-model": m.name });
    row.append(el("td", {}, m.name));
    row.append(el("td", {}, m.predicted_output_tokens === null ? "not learnt yet" : fmt(m.predicted_output_tokens, 0)));
    row.append(el("td", {}, m.reserved_quantile === null ? "–" : fmt(m.reserved_quantile, 3)));
    row.append(el("td", {}, m.reserved_margin === null ? "–" : fmt(m.reserved_margin, 2)));
    body.append(row);
  }
}

function draw(doc) {
  $("snapshot-id").textContent = doc.id;
  document.body.dataset.snapshotId = doc.id;
  const p = doc.process;
  $("answered-by").textContent = p.worker === null ? `pid ${p.pid}` : `worker ${p.worker} of ${p.workers} (pid ${p.pid})`;
  $("generated-at").textContent = new Date(doc.generated_at * 1000).toLocaleTimeString();
  $("workers-note").textContent = p.workers > 1
    ? "Several workers: reservations, the queue length and tenants' rate limits are shared (Redis); " +
      "counters and in-flight figures are every worker's summed; the oldest wait and the models' " +
      "estimates are the answering worker's own."
    : "";
  drawEngines(doc);
  drawTraffic(doc);
  drawTenants(doc);
  drawModels(doc);
}

function setState(state, text) {
  const s = $("state");
  s.dataset.state = state;
  s.textContent = text;
}

async function poll(gen) {
  const key = sessionStorage.getItem(KEY) || "";
  if (!SENDABLE_KEY.test(key)) { setState("error", WRONG_KEY); stop(); return; }
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    const answer = await fetch("/admin/status", { headers, cache: "no-store", credentials: "omit" });
    if (gen !== generation) return;
    if (!answer.ok) {
      let message = `${answer.status}`;
      try { message += `: ${(await answer.json()).error.message}`; } catch (e) { /* not JSON */ }
      setState("error", message);
      if (answer.status === 401 || answer.status === 403) { stop(); return; }
    } else {
      const doc = await answer.json();
      if (gen !== generation) return;
      history.push({ t: doc.generated_at, doc });
      while (history.length > 2 && doc.generated_at - history[0].t > HISTORY_S) history.shift();
      draw(doc);
      setState("ok", `live, every ${POLL_MS / 1000} s`);
    }
  } catch (e) {
    if (gen !== generation) return;
    setState("error", `cannot reach the gateway: ${e}`);
  }
  timer = setTimeout(() => poll(gen), POLL_MS);
}

function stop() {
  generation += 1;
  if (timer !== null) { clearTimeout(timer); timer = null; }
}

function start() { stop(); history.length = 0; poll(generation); }

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("key").value);
    $("key").value = "";
    start();
  });
  $("forget").addEventListener("click", () => { sessionStorage.removeItem(KEY); stop(); setState("idle", "not connected"); });
  start(); // an open admin surface needs no key; a stored one is reused
});
