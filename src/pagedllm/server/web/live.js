// The server view: the KV block map (one cell a block, coloured by state, shared blocks
// marked, hover for details), requests and fair share, configuration and the cost of more
// parallel slots, charts over the last minutes; fed by /v1/server/state?stream=true. With
// replicas, a picker lists every replica (host, pool use, running, waiting) and the map and
// tables show the one picked (?replica=ID); in a model store the picker lists the loaded
// models the same way, and a table shows every model of the store (loaded or not).

import { call, events } from "./api.js";
import { Chart } from "./charts.js";

const $ = (id) => document.getElementById(id);
const COLORS = { 0: "#e5e7eb", 1: "#93c5fd", 2: "#f59e0b", 3: "#dc2626" };
const STATE_NAMES = { 0: "free", 1: "cached prefix (free, reusable)", 2: "in use", 3: "shared" };
const mib = (bytes) => `${(bytes / 2 ** 20).toLocaleString(undefined, { maximumFractionDigits: 1 })} MiB`;

let latest = null;
let previous = null;
let cell = 8;
let charts = null;
let chosenReplica = null;
let streaming = null; // the open stream's AbortController: picking a replica restarts it

export const liveState = { snapshots: 0, get latest() { return latest; } };

function drawBlocks(snapshot) {
  const canvas = $("block-map");
  const blocks = snapshot.blocks;
  const columns = Math.max(1, Math.floor(canvas.clientWidth / 8) || 100);
  cell = Math.max(3, Math.floor((canvas.clientWidth || 900) / columns));
  const rows = Math.ceil(blocks.length / columns);
  canvas.width = columns * cell;
  canvas.height = Math.max(cell, rows * cell);
  const ctx = canvas.getContext("2d");
  for (let i = 0; i < blocks.length; i++) {
    const x = (i % columns) * cell, y = Math.floor(i / columns) * cell;
    ctx.fillStyle = COLORS[blocks[i]];
    ctx.fillRect(x, y, cell - 1, cell - 1);
    if (blocks[i] === "3") { // shared: a white dot marks it beyond its colour
      ctx.fillStyle = "#fff";
      ctx.fillRect(x + cell / 2 - 1, y + cell / 2 - 1, 2, 2);
    }
  }
  canvas.dataset.columns = columns;
  const counts = { 0: 0, 1: 0, 2: 0, 3: 0 };
  for (const state of blocks) counts[state]++;
  canvas.dataset.shared = counts[3];
  canvas.dataset.used = counts[2] + counts[3];
  canvas.dataset.cached = counts[1];
  $("pool-summary").textContent = `${blocks.length} blocks of ${snapshot.block_size} tokens: ` +
    `${counts[2] + counts[3]} in use (${counts[3]} shared), ${counts[1]} cached, ${counts[0]} free`;
}

function blockTip(event) {
  if (!latest) return;
  const canvas = $("block-map");
  const rect = canvas.getBoundingClientRect();
  const columns = Number(canvas.dataset.columns);
  const column = Math.floor((event.clientX - rect.left) / cell);
  const row = Math.floor((event.clientY - rect.top) / cell);
  const id = row * columns + column;
  const tip = $("block-tip");
  if (column >= columns || id >= latest.blocks.length) { tip.hidden = true; return; }
  const owners = latest.block_refs[id] || [];
  tip.textContent = `block ${id}: ${STATE_NAMES[latest.blocks[id]]}; ` +
    `${latest.block_size} token slots; hash ${latest.block_hashed[id] === "1" ? "present" : "none"}` +
    (owners.length ? `; owners: ${owners.join(", ")}` : "");
  tip.hidden = false;
  tip.style.left = `${event.clientX - rect.left + 12}px`;
  tip.style.top = `${event.clientY - rect.top + 12}px`;
}

function fillTable(id, rows) {
  const body = $(id).querySelector("tbody");
  body.replaceChildren();
  for (const values of rows) {
    const tr = document.createElement("tr");
    for (const value of values) {
      const td = document.createElement("td");
      td.textContent = value ?? "-";
      tr.append(td);
    }
    body.append(tr);
  }
}

function showReplicas(snapshot) {
  const store = Boolean(snapshot.models); // a model store: its loaded models take the replicas' place
  if (store) showModels(snapshot.models);
  if (snapshot.adapters) showAdapters(snapshot.adapters);
  if (!snapshot.replicas) return;
  $("replica-picker").hidden = false;
  $("replica-label").textContent = store ? "Model" : "Replica";
  const select = $("replica-select");
  select.replaceChildren(...snapshot.replicas.map((r) => {
    const option = document.createElement("option");
    option.value = r.replica;
    const where = store ? "" : ` on ${r.host || "?"}`;
    option.textContent = `${store ? r.replica : r.replica.slice(0, 8)}${where}: ${(100 * r.kv_usage).toFixed(0)}% ` +
      `of ${r.kv_blocks_total} blocks, ${r.num_running} running, ${r.num_waiting} waiting`;
    option.selected = r.replica === snapshot.replica;
    return option;
  }));
}

function showAdapters(adapters) {
  $("adapters-card").hidden = false;
  fillTable("adapters", adapters.map((a) => [a.name, a.format, a.rank, a.running, a.requests, a.path]));
}

function showModels(models) {
  $("models-card").hidden = false;
  fillTable("models", models.map((m) => [m.model, m.loaded ? (m.busy ? "loaded, busy" : "loaded") : "not loaded",
    m.size_bytes ? mib(m.size_bytes) : null, m.loaded ? (m.expires_in_s === null ? "never" : `${m.expires_in_s} s`) : null,
    m.loads, m.load_seconds === null || m.load_seconds === undefined ? null : `${m.load_seconds.toFixed(1)} s`]));
}

async function pickReplica() {
  chosenReplica = $("replica-select").value;
  if (streaming) streaming.abort();
  // A store's models differ in configuration: show the picked one's.
  const response = await call(`/v1/server/state?config=true&replica=${encodeURIComponent(chosenReplica)}`);
  if (response.ok) showConfig(await response.json());
}

function showSnapshot(snapshot) {
  previous = latest;
  latest = snapshot;
  liveState.snapshots++;
  showReplicas(snapshot);
  drawBlocks(snapshot);
  const s = snapshot.stats;
  const hitRate = s.prefix_cache_queries ? (100 * s.prefix_cache_hits / s.prefix_cache_queries).toFixed(1) : "0";
  $("cache-stats").textContent = `pool ${(100 * s.kv_usage).toFixed(1)}% used · prefix-cache hit rate ` +
    `${hitRate}% (${s.prefix_cache_hits} of ${s.prefix_cache_queries} blocks) · preemptions ${s.num_preemptions}` +
    (s.spec_num_draft_tokens ? ` · speculative: ${(100 * s.spec_num_accepted_tokens / s.spec_num_draft_tokens).toFixed(1)}% ` +
      `of ${s.spec_num_draft_tokens} proposed tokens accepted, ` +
      `${(1 + s.spec_num_accepted_tokens / s.spec_num_drafts).toFixed(2)} tokens a verification` : "") +
    (s.memory_pressure ? " · memory pressure: new requests wait" : "");
  fillTable("requests", snapshot.requests.map((r) => [r.request_id, r.user, r.status, r.num_prompt_tokens,
    r.num_output_tokens, r.num_cached_tokens < 0 ? "-" : r.num_cached_tokens, r.waiting_s.toFixed(1),
    r.ttft_ms, r.tokens_per_s]));
  fillTable("fair-share", Object.entries(snapshot.fair_share).map(([user, f]) =>
    [user || "(anonymous)", f.weight, f.running, f.waiting, f.max_running, f.virtual_time]));
  if (previous && charts) {
    const seconds = Math.max(1e-3, snapshot.time - previous.time);
    const t = snapshot.time;
    charts.tokens.add(t, [(s.num_prompt_tokens - previous.stats.num_prompt_tokens) / seconds,
                          (s.num_generation_tokens - previous.stats.num_generation_tokens) / seconds]);
    charts.requests.add(t, [s.num_running, s.num_waiting]);
    charts.kv.add(t, [100 * s.kv_usage]);
    charts.ttft.add(t, [snapshot.latency.ttft_ms.p50, snapshot.latency.ttft_ms.p95]);
    charts.tpot.add(t, [snapshot.latency.tpot_ms.p50, snapshot.latency.tpot_ms.p95]);
    charts.memory.add(t, [snapshot.memory.rss_bytes / 2 ** 20]);
  }
}

function showConfig(data) {
  const c = data.config;
  const list = $("config");
  list.replaceChildren();
  if (!c) { // a model store with nothing loaded yet
    list.textContent = "No model is loaded yet: each loads on its first request.";
    return;
  }
  const items = [["model", `${c.model} (${c.architecture}, ${c.quantization})`], ["dtype", c.dtype],
    ["KV cache", `${mib(c.kv_cache_bytes)}, ${c.kv_cache_dtype}, ${c.num_blocks} blocks of ${c.block_size} tokens`],
    ["prefix caching", c.prefix_caching ? "on" : "off"], ["parallel requests", c.max_num_seqs],
    ["context", `${c.max_model_len} tokens`], ["CPU", `${c.cpu_isa} kernels (best here: ${c.cpu_best_isa}), ${c.threads} threads`],
    ["API keys", c.keys ? "on" : "off"]];
  for (const [term, value] of items) {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = term;
    dd.textContent = value;
    list.append(dt, dd);
  }
  $("model-name").textContent = c.model;
  const over = " — more than this pool";
  fillTable("plan", data.plan.map((row) => [row.parallel,
    `${mib(row.full_context_bytes)}${row.full_context_fits ? "" : over}`,
    `${mib(row.typical_bytes)} (${row.typical_tokens} tokens)${row.fits ? "" : over}`]));
  // Rows that do not fit are marked for the eye too, not only in words.
  [...$("plan").tBodies[0].rows].forEach((tr, i) => {
    tr.cells[1].classList.toggle("over", !data.plan[i].full_context_fits);
    tr.cells[2].classList.toggle("over", !data.plan[i].fits);
  });
  const bench = data.bench;
  if (bench) {
    $("bench-card").hidden = false;
    const r = bench.recommendation || {};
    $("bench-summary").textContent = `${bench.path}: ${r.concurrency ? `recommended N = ${r.concurrency} (${r.reason})` : r.reason || ""}`;
    fillTable("bench", bench.levels.map((lv) => [lv.concurrency, lv.output_tokens_per_s.toFixed(1),
      lv.ttft_ms.p95?.toFixed(0), lv.tpot_ms.p95?.toFixed(1), lv.meets_slo ? "yes" : "no"]));
  }
}

async function follow() {
  for (;;) {
    try {
      streaming = new AbortController();
      const which = chosenReplica ? `&replica=${encodeURIComponent(chosenReplica)}` : "";
      const response = await call(`/v1/server/state?stream=true${which}`, { signal: streaming.signal });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      for await (const snapshot of events(response)) if (snapshot !== "[DONE]") showSnapshot(snapshot);
    } catch (error) {
      if (streaming.signal.aborted) continue; // a replica was picked: follow it at once
      $("cache-stats").textContent = `lost the server (${error.message}); retrying…`;
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

export async function startLive() {
  charts = { tokens: new Chart($("chart-tokens")), requests: new Chart($("chart-requests")),
             kv: new Chart($("chart-kv")), ttft: new Chart($("chart-ttft")),
             tpot: new Chart($("chart-tpot")), memory: new Chart($("chart-memory")) };
  $("block-map").addEventListener("mousemove", blockTip);
  $("block-map").addEventListener("mouseleave", () => ($("block-tip").hidden = true));
  $("replica-select").addEventListener("change", pickReplica);
  const response = await call("/v1/server/state?config=true");
  if (response.ok) {
    const data = await response.json();
    showConfig(data);
    showSnapshot(data);
  }
  follow();
}
