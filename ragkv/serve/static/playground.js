// The ragkv playground: one question over the same documents in several fusion modes, each a streamed
// POST /v1/chat/completions, with the figures the server returns in the last chunk (`ragkv.stats`).
"use strict";

const $ = (selector) => document.querySelector(selector);

// The parts of a request's time, from RequestStats (ragkv/engine/options.py); "other" is the rest of the TTFT.
const TIME_PARTS = [
  {key: "fetch_ms", label: "load cached KV", color: "#4e79a7"},
  {key: "rerotate_ms", label: "re-rotate", color: "#76b7b2"},
  {key: "encode_ms", label: "encode missed blocks", color: "#f28e2b"},
  {key: "recompute_ms", label: "recompute", color: "#e15759"},
  {key: "query_prefill_ms", label: "prefill the rest of the prompt", color: "#edc948"},
  {key: "other_ms", label: "other (before the first token)", color: "#bab0ac"},
  {key: "decode_ms", label: "decode", color: "#59a14f"},
];

const state = {runs: new Map()};  // mode -> {column, answer, stats, usage, clientTtftMs, error}

// ---- the request ----------------------------------------------------------------------------------------

function apiHeaders() {
  const headers = {"Content-Type": "application/json"};
  const key = $("#api-key").value.trim();
  if (key) headers["Authorization"] = `Bearer ${key}`;
  return headers;
}

async function errorMessage(response) {
  // OpenAI-style bodies carry {"error": {"message", "param", "code"}}; anything else is shown as it came
  const text = await response.text();
  try {
    const err = JSON.parse(text).error;
    if (err && err.message) {
      const where = err.param ? ` (${err.param})` : "";
      return `${response.status}: ${err.message}${where}`;
    }
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}: ${text.slice(0, 300)}`;
}

function documentsFromForm() {
  return [...document.querySelectorAll("#documents .document")]
    .map((el) => ({title: el.querySelector(".doc-title").value.trim(), text: el.querySelector(".doc-text").value}))
    .filter((d) => d.text.trim());
}

function requestBody(mode) {
  const ragkv = {mode, documents: documentsFromForm()};
  if ($("#use-retrieval").checked) ragkv.retrieval = {top_k: Number($("#top-k").value) || 1};
  return {
    messages: [{role: "user", content: $("#question").value}],
    max_tokens: Number($("#max-tokens").value) || 16,
    stream: true,
    stream_options: {include_usage: true},
    ragkv,
  };
}

// Read a server-sent event stream, calling onData with each `data:` payload parsed as JSON.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          onData(JSON.parse(data));
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});  // an error mid-stream: let the server free the model
  }
}

async function runMode(mode) {
  const run = {answer: "", stats: null, usage: null, clientTtftMs: null, error: null};
  state.runs.set(mode, run);
  const column = makeColumn(mode);
  run.column = column;
  const started = performance.now();
  try {
    const response = await fetch("/v1/chat/completions",
      {method: "POST", headers: apiHeaders(), body: JSON.stringify(requestBody(mode))});
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(`the server stopped this answer: ${chunk.error.message}`);
      const choice = (chunk.choices || [])[0];
      const text = choice && choice.delta ? choice.delta.content : null;
      if (text) {
        if (run.clientTtftMs === null) run.clientTtftMs = performance.now() - started;
        run.answer += text;
        column.querySelector(".answer").textContent = run.answer;
      }
      if (chunk.ragkv && chunk.ragkv.stats) run.stats = chunk.ragkv.stats;
      if (chunk.usage) run.usage = chunk.usage;
      showFigures(run);
    });
    if (run.clientTtftMs === null) run.clientTtftMs = performance.now() - started;  // an empty answer
    column.dataset.state = "done";
  } catch (e) {
    run.error = e.message || String(e);
    column.dataset.state = "error";
    const p = column.querySelector(".error");
    p.textContent = run.error;
    p.hidden = false;
  }
  showFigures(run);
  drawChart();
}

async function runAll() {
  const modes = [...document.querySelectorAll("#modes input:checked")].map((el) => el.value);
  const status = $("#status");
  if (!modes.length) return setStatus("Pick at least one mode.", true);
  if (!$("#question").value.trim()) return setStatus("Ask a question first.", true);
  if (!documentsFromForm().length && !$("#use-retrieval").checked) {
    return setStatus("Add a document (or retrieve from the library): the modes differ only in how they " +
                     "treat documents.", true);
  }
  $("#run").disabled = true;
  $("#columns").textContent = "";
  state.runs.clear();
  drawChart();
  const started = performance.now();
  setStatus(`Running ${modes.join(", ")}…`);
  try {
    if ($("#concurrent").checked) {
      await Promise.all(modes.map(runMode));
    } else {
      for (const mode of modes) await runMode(mode);
    }
  } finally {
    $("#run").disabled = false;
  }
  markSameAnswers();
  const failed = [...state.runs.values()].filter((r) => r.error).length;
  setStatus(`Done in ${((performance.now() - started) / 1000).toFixed(1)} s` +
            (failed ? `; ${failed} mode(s) failed` : "") +
            ". Run again to see the documents' cached KV reused.", failed > 0);
  status.dataset.state = "done";
}

function setStatus(text, isError = false) {
  const status = $("#status");
  status.textContent = text;
  status.classList.toggle("error", isError);
  delete status.dataset.state;
}

// ---- the answers --------------------------------------------------------------------------------------------

const FIGURES = [
  ["ttft-client", "TTFT, measured here"],
  ["ttft-server", "TTFT, server"],
  ["reused", "reused tokens"],
  ["recomputed", "recomputed tokens"],
  ["work", "prefill work vs full"],
  ["blocks", "block cache hits / misses"],
  ["tokens", "prompt / completion tokens"],
  ["speed", "decode speed"],
  ["same", "same answer as full"],
];

function makeColumn(mode) {
  const column = document.createElement("article");
  column.className = "column";
  column.dataset.mode = mode;
  column.dataset.state = "running";
  const title = document.createElement("h3");
  title.textContent = mode;
  const answer = document.createElement("div");
  answer.className = "answer";
  const figures = document.createElement("dl");
  figures.className = "figures";
  for (const [key, label] of FIGURES) {
    const dt = document.createElement("dt");
    dt.textContent = label;
    const dd = document.createElement("dd");
    dd.dataset.figure = key;
    dd.textContent = "…";
    figures.append(dt, dd);
  }
  const error = document.createElement("p");
  error.className = "error";
  error.hidden = true;
  column.append(title, answer, error, figures);
  $("#columns").append(column);
  return column;
}

const ms = (x) => (x === null || x === undefined ? "–" : `${Math.round(x)} ms`);

function setFigure(run, key, text) {
  run.column.querySelector(`[data-figure="${key}"]`).textContent = text;
}

function showFigures(run) {
  if (run.clientTtftMs !== null) setFigure(run, "ttft-client", ms(run.clientTtftMs));
  const s = run.stats;
  if (!s) return;
  setFigure(run, "ttft-server", ms(s.ttft_ms));
  setFigure(run, "reused", String(s.reused_tokens));
  setFigure(run, "recomputed", String(s.recomputed_tokens));
  setFigure(run, "work", s.recompute_vs_full === null ? "–" : `${(100 * s.recompute_vs_full).toFixed(0)} %`);
  setFigure(run, "blocks", `${s.cache_hits} / ${s.cache_misses}`);
  setFigure(run, "tokens", `${s.prompt_tokens} / ${s.completion_tokens}`);
  setFigure(run, "speed", s.tokens_per_s ? `${s.tokens_per_s.toFixed(1)} tokens/s` : "–");
}

function markSameAnswers() {
  const full = state.runs.get("full");
  for (const run of state.runs.values()) {
    const text = !full || full.error || run.error ? "–" : run.answer === full.answer ? "yes" : "no";
    setFigure(run, "same", text);
  }
}

// ---- the chart: one stacked bar per mode, all on one time scale --------------------------------------------

function timeParts(stats) {
  const parts = Object.fromEntries(TIME_PARTS.map((p) => [p.key, Number(stats[p.key]) || 0]));
  const named = ["fetch_ms", "rerotate_ms", "encode_ms", "recompute_ms", "query_prefill_ms"]
    .reduce((sum, k) => sum + parts[k], 0);
  parts.other_ms = Math.max(0, (Number(stats.ttft_ms) || 0) - named);
  return parts;
}

function svg(tag, attrs, text) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function drawChart() {
  const chart = $("#chart");
  chart.textContent = "";
  const rows = [...state.runs.entries()].filter(([, run]) => run.stats);
  $("#chart-title").hidden = rows.length === 0;
  if (!rows.length) return;
  const width = 720, labelWidth = 70, barHeight = 22, gap = 10, valueWidth = 80;
  const totals = rows.map(([, run]) => Object.values(timeParts(run.stats)).reduce((a, b) => a + b, 0));
  const scale = (width - labelWidth - valueWidth) / Math.max(...totals, 1);
  const height = rows.length * (barHeight + gap);
  const root = svg("svg", {viewBox: `0 0 ${width} ${height}`, width: "100%", role: "img",
                           "aria-label": "time split per mode"});
  rows.forEach(([mode, run], i) => {
    const y = i * (barHeight + gap);
    root.append(svg("text", {x: 0, y: y + barHeight * 0.7, class: "bar-label"}, mode));
    let x = labelWidth;
    const parts = timeParts(run.stats);
    for (const part of TIME_PARTS) {
      const w = parts[part.key] * scale;
      if (w <= 0) continue;
      const rect = svg("rect", {x, y, width: Math.max(w, 0.5), height: barHeight, fill: part.color});
      rect.append(svg("title", {}, `${mode}: ${part.label} ${parts[part.key].toFixed(1)} ms`));
      root.append(rect);
      x += w;
    }
    root.append(svg("text", {x: x + 6, y: y + barHeight * 0.7, class: "bar-value"}, ms(totals[i])));
  });
  const legend = document.createElement("ul");
  legend.className = "legend";
  for (const part of TIME_PARTS) {
    const item = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = part.color;
    item.append(swatch, part.label);
    legend.append(item);
  }
  chart.append(root, legend);
}

// ---- documents --------------------------------------------------------------------------------------------

function addDocument(title = "", text = "") {
  const el = document.createElement("div");
  el.className = "document";
  const titleInput = document.createElement("input");
  titleInput.className = "doc-title";
  titleInput.placeholder = "title (optional)";
  titleInput.value = title;
  const remove = document.createElement("button");
  remove.type = "button";
  remove.className = "remove";
  remove.textContent = "✕";
  remove.title = "remove this document";
  remove.addEventListener("click", () => el.remove());
  const textArea = document.createElement("textarea");
  textArea.className = "doc-text";
  textArea.rows = 4;
  textArea.placeholder = "paste a document here";
  textArea.value = text;
  const head = document.createElement("div");
  head.className = "doc-head";
  head.append(titleInput, remove);
  el.append(head, textArea);
  $("#documents").append(el);
  return el;
}

async function loadExamples() {
  try {
    const response = await fetch("/static/examples.json");
    if (!response.ok) throw new Error(await errorMessage(response));
    const examples = await response.json();
    $("#documents").textContent = "";
    for (const d of examples.documents) addDocument(d.title, d.text);
    if (!$("#question").value.trim()) $("#question").value = examples.question;
  } catch (e) {
    setStatus(`Could not load the examples: ${e.message}`, true);
  }
}

async function pickFiles(event) {
  for (const file of event.target.files) addDocument(file.name.replace(/\.[^.]+$/, ""), await file.text());
  event.target.value = "";
}

async function listLibrary() {
  const list = $("#library-list");
  list.textContent = "";
  try {
    const response = await fetch("/v1/documents", {headers: apiHeaders()});
    if (!response.ok) {
      const hint = response.status === 401 ? " (enter the server's API key above)" : "";
      throw new Error((await errorMessage(response)) + hint);
    }
    const docs = (await response.json()).data;
    if (!docs.length) list.append(Object.assign(document.createElement("li"), {textContent: "no documents yet"}));
    for (const d of docs) {
      const li = document.createElement("li");
      li.textContent = `${d.title || d.doc_id} (${d.chunks} chunk${d.chunks === 1 ? "" : "s"})`;
      list.append(li);
    }
  } catch (e) {
    list.append(Object.assign(document.createElement("li"), {className: "error", textContent: e.message}));
  }
}

async function showServer() {
  try {
    const health = await (await fetch("/health")).json();
    $("#server-info").textContent = `${health.model} · ${health.dtype}`;
  } catch (e) {
    $("#server-info").textContent = `the server does not answer: ${e.message}`;
  }
}

// ---- the chat: the whole conversation every turn, each reply with how its history was computed -------------

const chat = {messages: []};  // {role, content, figures}: the transcript, as the user may have edited it

function renderTranscript() {
  const list = $("#transcript");
  list.textContent = "";
  chat.messages.forEach((m, i) => {
    const item = document.createElement("li");
    item.className = "message";
    item.dataset.role = m.role;
    const role = document.createElement("span");
    role.className = "role";
    role.textContent = m.role;
    const text = document.createElement("textarea");
    text.className = "message-text";
    text.rows = 2;
    text.value = m.content;
    text.addEventListener("input", () => { m.content = text.value; });
    const drop = document.createElement("button");
    drop.type = "button";
    drop.className = "remove";
    drop.textContent = "✕";
    drop.title = "drop this message from the history";
    drop.addEventListener("click", () => { chat.messages.splice(i, 1); renderTranscript(); });
    item.append(role, drop, text);
    if (m.figures) {
      const fig = document.createElement("p");
      fig.className = "turn-figures muted";
      fig.textContent = m.figures.text;
      item.dataset.exact = String(m.figures.exact);
      item.dataset.fused = String(m.figures.fused);
      item.append(fig);
    }
    list.append(item);
  });
}

function describeTurn(usage, ttftMs) {
  const h = usage.history, fid = usage.fidelity || {};
  const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
  const parts = [`TTFT ${ms(ttftMs)}`, `${cached} of ${usage.prompt_tokens} prompt tokens from the cache`];
  if (h) {
    parts.push(`${h.exact_turns} of ${h.turns} earlier turns exact` +
               (h.fused_turns ? `, ${h.fused_turns} fused by ${fid.mode}` : ""));
  } else {
    parts.push(`mode ${fid.mode}`);
  }
  let verdict = fid.exact ? "exact" : "approximate";
  if (!fid.exact && fid.signal !== null && fid.signal !== undefined) {
    verdict += ` (risk ${fid.signal_name} ${Number(fid.signal).toFixed(3)})`;
  }
  if (fid.escalations) verdict += `, escalated ${fid.escalations}x`;
  parts.push(verdict);
  return {text: parts.join(" · "), exact: Boolean(fid.exact), fused: h ? h.fused_turns : 0};
}

async function sendChat() {
  const input = $("#chat-input");
  const text = input.value.trim();
  if (!text) return;
  const status = $("#chat-status");
  chat.messages.push({role: "user", content: text});
  input.value = "";
  const reply = {role: "assistant", content: "", figures: null};
  chat.messages.push(reply);
  renderTranscript();
  $("#chat-send").disabled = true;
  status.textContent = "…";
  delete status.dataset.state;
  const system = $("#chat-system").value.trim();
  const messages = (system ? [{role: "system", content: system}] : [])
    .concat(chat.messages.slice(0, -1).map((m) => ({role: m.role, content: m.content})));
  const body = {messages, max_tokens: Number($("#max-tokens").value) || 48, stream: true,
                stream_options: {include_usage: true}};
  if ($("#chat-mode").value) body.ragkv = {mode: $("#chat-mode").value};
  const started = performance.now();
  let ttft = null, usage = null;
  try {
    const response = await fetch("/v1/chat/completions",
      {method: "POST", headers: apiHeaders(), body: JSON.stringify(body)});
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(`the server stopped this answer: ${chunk.error.message}`);
      const choice = (chunk.choices || [])[0];
      const delta = choice && choice.delta ? choice.delta.content : null;
      if (delta) {
        if (ttft === null) ttft = performance.now() - started;
        reply.content += delta;
        const last = $("#transcript").lastElementChild;
        if (last) last.querySelector("textarea").value = reply.content;
      }
      if (chunk.usage) usage = chunk.usage;
    });
    if (usage) reply.figures = describeTurn(usage, ttft === null ? performance.now() - started : ttft);
    status.textContent = "";
  } catch (e) {
    chat.messages.pop();  // no reply: the user's message stays, to send again
    status.textContent = e.message || String(e);
    status.classList.add("error");
  } finally {
    $("#chat-send").disabled = false;
    status.dataset.state = "done";
    renderTranscript();
  }
}

// ---- wiring ------------------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  const key = $("#api-key");
  key.value = sessionStorage.getItem("ragkv-api-key") || "";
  key.addEventListener("change", () => sessionStorage.setItem("ragkv-api-key", key.value.trim()));
  $("#load-examples").addEventListener("click", loadExamples);
  $("#add-document").addEventListener("click", () => addDocument().querySelector("textarea").focus());
  $("#clear-documents").addEventListener("click", () => { $("#documents").textContent = ""; });
  $("#pick-files").addEventListener("change", pickFiles);
  $("#list-library").addEventListener("click", listLibrary);
  $("#run").addEventListener("click", runAll);
  $("#chat-send").addEventListener("click", sendChat);
  $("#chat-clear").addEventListener("click", () => { chat.messages = []; renderTranscript(); });
  showServer();
  loadExamples();
});
