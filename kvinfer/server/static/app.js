// kvinfer's page: chat through /v1/chat/completions (streamed) and the KV cache drawn from /kv/state.
// Everything the server or the model sends is put into the page as text (textContent, attributes), never as HTML.
"use strict";

const POLL_MS = 400;  // the issue asks for at least two updates a second
const KEY_STORE = "kvinfer-api-key";
const STATE = ["free", "free, prefix still cached", "owned", "shared"];

const $ = (id) => document.getElementById(id);
let apiKey = sessionStorage.getItem(KEY_STORE) || "";
let modelName = null;
let history = [];       // [{role, content}] of the current conversation, system prompt excluded
let inflight = null;    // AbortController of the answer being streamed
let polling = false;
let needKey = false;
let last = null;        // the latest state from /kv/state
let focus = null;       // request id under the pointer (a row or one of its blocks)
let cells = [];         // map cells, one per block
let cellKey = [];       // what each cell shows now, so an update only touches cells that changed

// ---- talking to the server -------------------------------------------------------------------------
class AuthError extends Error {}

async function api(path, opts = {}) {
  const headers = Object.assign({}, opts.headers || {});
  if (apiKey) headers["Authorization"] = "Bearer " + apiKey;
  const resp = await fetch(path, Object.assign({}, opts, { headers }));
  if (resp.status === 401) {
    let msg = "the server needs an API key";
    try { msg = (await resp.json()).error.message; } catch (e) { /* not JSON: keep the generic line */ }
    throw new AuthError(msg);
  }
  return resp;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* fall through */ }
  return "HTTP " + resp.status;
}

function askForKey(message) {
  needKey = true;
  last = null;
  $("app").hidden = true;
  $("auth").hidden = false;
  $("auth-error").textContent = apiKey ? message : "";
  $("conn").textContent = "locked";
  $("conn").className = "conn off";
  $("auth-key").focus();
}

async function start() {
  try {
    const resp = await api("/v1/models");
    if (!resp.ok) throw new Error(await errorText(resp));
    modelName = (await resp.json()).data[0].id;
  } catch (e) {
    if (e instanceof AuthError) return askForKey(e.message);
    $("conn").textContent = "server unreachable: " + e.message;
    $("conn").className = "conn off";
    setTimeout(start, 2000);
    return;
  }
  needKey = false;
  $("auth").hidden = true;
  $("app").hidden = false;
  $("model").textContent = modelName;
  if (!polling) { polling = true; poll(); }
}

// ---- chat ------------------------------------------------------------------------------------------
function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "you" : role === "assistant" ? (modelName || "model") : role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  box.append(who, body, meta);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return { box, body, meta };
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  const conv = history;  // "New chat" swaps in a fresh array: a late answer must not land in the new one
  const asked = { role: "user", content: text };
  conv.push(asked);
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.box.classList.add("streaming");
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(conv);
  const body = { model: modelName, messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat($("temperature").value);
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;

  const ctl = new AbortController();
  inflight = ctl;
  setBusy(true);
  let answer = "", finish = null, usage = null, failed = null;
  const t0 = performance.now();
  try {
    const resp = await api("/v1/chat/completions", {
      method: "POST", signal: ctl.signal, body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", "X-Kvinfer-Page": "1" },
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          for (const c of chunk.choices || []) {
            if (c.delta && c.delta.content) {
              answer += c.delta.content;
              out.body.textContent = answer;
            }
            if (c.finish_reason) finish = c.finish_reason;
          }
        }
      }
      out.box.scrollIntoView({ block: "end" });
    }
  } catch (e) {
    if (e instanceof AuthError) { failed = e.message; askForKey(e.message); }
    else if (e.name === "AbortError") finish = "stopped";
    else failed = e.message;
  } finally {
    if (inflight === ctl) { inflight = null; setBusy(false); }
    out.box.classList.remove("streaming");
  }
  const secs = (performance.now() - t0) / 1000;
  if (failed) {
    out.box.classList.add("failed");
    out.meta.textContent = "error: " + failed;
  } else {
    const parts = [];
    if (usage) parts.push(usage.completion_tokens + " tokens", (usage.completion_tokens / secs).toFixed(1) + " tok/s");
    if (finish && finish !== "stop") parts.push(finish === "length" ? "cut at max tokens" : finish);
    out.meta.textContent = parts.join(" · ");
  }
  if (answer) conv.push({ role: "assistant", content: answer });
  else if (failed) conv.splice(conv.indexOf(asked), 1);  // unanswered: leave it out of the next request
  else out.body.textContent = "(no text)";
}

function newChat() {
  if (inflight) inflight.abort();
  history = [];
  $("messages").replaceChildren();
  $("input").focus();
}

// ---- the KV cache ----------------------------------------------------------------------------------
// Hues handed out in arrival order by the golden angle: requests alive together look apart, and a request
// keeps its colour for as long as the page is open.
const hues = new Map();
let hueCount = 0;
function hueOf(id) {
  let h = hues.get(id);
  if (h === undefined) {
    h = (210 + hueCount++ * 137.508) % 360;
    hues.set(id, h);
  }
  return h;
}
function forgetHues(seqs) {
  if (hues.size < 4096) return;
  const alive = new Set(seqs.map((q) => q.id));
  for (const id of hues.keys()) if (!alive.has(id)) hues.delete(id);
}
const colourOf = (id) => `hsl(${hueOf(id).toFixed(0)} 70% 52%)`;
const shortId = (id) => {
  const m = /^([a-z]+)-([0-9a-f]{6})[0-9a-f]*(.*)$/.exec(id);
  return m ? `${m[1]}-${m[2]}${m[3]}` : id;
};

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(n < 10 ? 2 : n < 100 ? 1 : 0) : n.toFixed(0)) + " " + units[i];
}
const fmtInt = (n) => n.toLocaleString("en-US");
const pct = (x) => (100 * x).toFixed(1) + "%";

async function poll() {
  if (needKey) { polling = false; return; }
  try {
    const resp = await api("/kv/state");
    if (!resp.ok) throw new Error(await errorText(resp));
    last = await resp.json();
    render(last);
    $("conn").textContent = "live";
    $("conn").className = "conn on";
  } catch (e) {
    if (e instanceof AuthError) { polling = false; askForKey(e.message); return; }
    $("conn").textContent = "no state: " + e.message;
    $("conn").className = "conn off";
  }
  setTimeout(poll, POLL_MS);
}

function render(s) {
  const paged = s.backend === "paged", contiguous = s.backend === "contiguous";
  $("backend").textContent = paged ? `paged · ${fmtInt(s.num_blocks)} blocks of ${s.block_size} tokens`
    : contiguous ? `contiguous · ${s.num_blocks} slots of ${fmtInt(s.max_model_len)} tokens` : "no KV cache";
  const unit = paged ? "blocks" : "slots";
  $("st-blocks-label").textContent = unit + " used";
  $("st-blocks").textContent = `${fmtInt(s.blocks_used)} / ${fmtInt(s.num_blocks)}`;
  $("st-blocks").dataset.used = s.blocks_used;
  $("st-blocks-bar").style.width = s.num_blocks ? pct(s.blocks_used / s.num_blocks) : "0";
  $("st-bpt").textContent = fmtBytes(s.bytes_per_token);
  $("st-bytes").textContent = fmtBytes(s.kv_bytes) + " reserved";
  $("st-cap").textContent = fmtInt(s.capacity_tokens);
  const alloc = s.tokens_allocated;
  $("st-util").textContent = alloc ? pct(Math.min(s.tokens_stored / alloc, 1)) : "–";
  const unused = Math.max(alloc - s.tokens_stored, 0);
  const saved = Math.max(s.tokens_logical - s.tokens_stored, 0);
  $("st-waste").textContent = (alloc ? `${fmtInt(unused)} tokens (${fmtBytes(unused * s.bytes_per_token)}) unused`
    : `0 ${unit} in use`) + (saved ? ` · sharing saves ${fmtInt(saved)}` : "");
  const pc = s.prefix_cache;
  $("st-hit").textContent = pc.enabled ? pct(pc.hit_rate) : "off";
  $("st-hit-sub").textContent = pc.enabled ? `${fmtInt(pc.hits)} of ${fmtInt(pc.queries)} blocks` +
    (paged ? ` · ${s.blocks_shared} shared, ${s.blocks_cached_free} cached free` : "") : "";
  const r = s.requests;
  $("st-reqs").textContent = `${r.running} / ${r.waiting} / ${r.preempted}`;
  $("st-preempt").textContent = `${fmtInt(r.preemptions_total)} preemptions so far`;
  $("st-tps").textContent = s.tokens_per_s == null ? "–" : s.tokens_per_s.toFixed(1);
  $("st-gen").textContent = `${fmtInt(s.generation_tokens)} generated in all`;

  renderTiers(s.tiers || []);

  forgetHues(s.seqs);
  $("map-box").hidden = !paged;
  $("slots-box").hidden = !contiguous;
  $("no-cache").hidden = paged || contiguous;
  if (paged) renderMap(s);
  if (contiguous) renderSlots(s);
  renderSeqs(s);
  if (focus && !s.seqs.some((q) => q.id === focus)) focus = null;
  applyFocus();
}

// The tiers below the pool (RAM, disk, Redis), one row each: what it holds ("–" where the tier cannot tell, a
// shared Redis) and its counters, the numbers /metrics has.
function renderTiers(tiers) {
  $("tiers-box").hidden = !tiers.length;
  const rows = tiers.map((t) => {
    const tr = document.createElement("tr");
    tr.dataset.tier = t.name;
    tr.title = t.label;
    const cells = [["name", t.name], ["blocks", t.blocks == null ? "–" : fmtInt(t.blocks)],
      ["bytes", t.bytes == null ? "–" : fmtBytes(t.bytes)], ["hits", fmtInt(t.hits)], ["misses", fmtInt(t.misses)],
      ["errors", fmtInt(t.errors)], ["io", `${fmtBytes(t.bytes_in)} / ${fmtBytes(t.bytes_out)}`],
      ["evictions", fmtInt(t.evictions)]];
    for (const [cls, text] of cells) {
      const td = document.createElement("td");
      td.className = cls;
      td.textContent = text;
      if (cls === "errors" && t.errors > 0) td.classList.add("bad");
      tr.append(td);
    }
    return tr;
  });
  $("tiers").tBodies[0].replaceChildren(...rows);
}

function buildMap(n) {
  const map = $("map");
  const size = n <= 400 ? 16 : n <= 1600 ? 11 : n <= 6400 ? 7 : 4;
  map.style.setProperty("--cell", size + "px");
  const frag = document.createDocumentFragment();
  cells = [];
  cellKey = [];
  for (let i = 0; i < n; i++) {
    const c = document.createElement("i");
    c.className = "cell s0";
    c.dataset.block = i;
    frag.append(c);
    cells.push(c);
    cellKey.push("");
  }
  map.replaceChildren(frag);
}

function renderMap(s) {
  const b = s.blocks;
  if (cells.length !== s.num_blocks) buildMap(s.num_blocks);
  $("map-title").textContent = `KV blocks (${fmtInt(s.num_blocks)} × ${s.block_size} tokens)`;
  for (let i = 0; i < cells.length; i++) {
    const st = b.state[i], own = b.owner[i];
    const id = own >= 0 ? s.seqs[own].id : "";
    const fill = b.fill[i];
    const key = st + "|" + id + "|" + b.refs[i] + "|" + fill;
    if (cellKey[i] === key) continue;
    cellKey[i] = key;
    const c = cells[i];
    c.className = "cell s" + st;
    c.dataset.owner = id;
    c.style.backgroundColor = st >= 2 ? colourOf(id) : "";
    // A partly filled block (a request's last one) is coloured up to its fill; the pale rest is the waste.
    const part = st >= 2 && fill < s.block_size;
    c.style.setProperty("--fill", part ? pct(fill / s.block_size) : "");
    c.classList.toggle("part", part);
    c.title = `block ${i} · ${STATE[st]}` + (id ? ` · ${shortId(id)}` : "") +
      (st >= 2 ? ` · ${fill}/${s.block_size} tokens` : "") + (b.refs[i] > 1 ? ` · ${b.refs[i]} references` : "");
  }
}

function renderSlots(s) {
  $("slot-len").textContent = fmtInt(s.max_model_len);
  const box = $("slots");
  box.replaceChildren();
  for (const sl of s.slots) {
    const row = document.createElement("div");
    row.className = "slot";
    const label = document.createElement("span");
    label.className = "slot-label";
    label.textContent = "slot " + sl.slot;
    const bar = document.createElement("span");
    bar.className = "slot-bar";
    const fill = document.createElement("span");
    fill.className = "slot-fill";
    const text = document.createElement("span");
    text.className = "slot-text";
    if (sl.owner >= 0) {
      const id = s.seqs[sl.owner].id;
      row.dataset.owner = id;
      bar.style.backgroundColor = `hsl(${hueOf(id).toFixed(0)} 70% 90%)`;
      fill.style.backgroundColor = colourOf(id);
      fill.style.width = pct(sl.used_tokens / sl.reserved_tokens);
      const wasted = sl.reserved_tokens - sl.used_tokens;
      text.textContent = `${shortId(id)}: ${fmtInt(sl.used_tokens)} of ${fmtInt(sl.reserved_tokens)} tokens used, ` +
        `${fmtInt(wasted)} reserved unused (${fmtBytes(wasted * s.bytes_per_token)})`;
    } else {
      text.textContent = "free";
    }
    bar.append(fill);
    row.append(label, bar, text);
    box.append(row);
  }
}

function renderSeqs(s) {
  const box = $("seqs");
  box.replaceChildren();
  if (!s.seqs.length) {
    const p = document.createElement("p");
    p.className = "note";
    p.textContent = "none";
    box.append(p);
    return;
  }
  for (const q of s.seqs) {
    const row = document.createElement("div");
    row.className = "seq " + q.status;
    row.dataset.id = q.id;
    const dot = document.createElement("i");
    dot.className = "dot";
    dot.style.backgroundColor = colourOf(q.id);
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = shortId(q.id) + (q.source === "page" ? " (this page)" : "");
    const info = document.createElement("span");
    info.className = "info";
    const nb = q.block_table ? q.block_table.length : 0;
    const blocks = q.block_table ? ` · ${nb} block${nb === 1 ? "" : "s"}` : q.slot != null ? ` · slot ${q.slot}` : "";
    info.textContent = `${q.status} · ${q.prompt_tokens}+${q.output_tokens} tokens${blocks}`;
    row.append(dot, name, info);
    box.append(row);
  }
}

function detailFor(s, q) {
  const box = $("detail");
  box.replaceChildren();
  const h = document.createElement("h3");
  h.textContent = shortId(q.id);
  h.style.color = colourOf(q.id);
  const dl = document.createElement("dl");
  const add = (k, v) => {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    dl.append(dt, dd);
  };
  add("status", q.status + (q.preemptions ? ` (preempted ${q.preemptions}×)` : ""));
  add("tokens", `${q.prompt_tokens} prompt + ${q.output_tokens} generated (max ${q.max_tokens})`);
  add("in the cache", `${q.computed_tokens} computed, ${q.cached_tokens} from the prefix cache`);
  if (q.block_table) {
    const bs = s.block_size, n = q.block_table.length;
    const lastFill = Math.min(Math.max(q.computed_tokens - (n - 1) * bs, 0), bs);
    add("blocks", n ? `${n} (${n * bs} token places, last block ${lastFill} of ${bs} full)` : "0");
    const shared = q.block_table.filter((b) => s.blocks.refs[b] > 1).length;
    if (shared) add("shared", `${shared} of its blocks are shared with other requests`);
    add("block table", n ? "[" + q.block_table.join(", ") + "]" : "[]");
  } else if (q.slot != null) {
    add("slot", `${q.slot}: ${q.computed_tokens} of ${s.max_model_len} tokens used`);
  }
  if (q.prompt != null) add("prompt", q.prompt);
  box.append(h, dl);
}

function applyFocus() {
  const s = last;
  const q = s && focus ? s.seqs.find((x) => x.id === focus) : null;
  $("kv").classList.toggle("focused", !!q);
  for (const row of $("seqs").children) row.classList.toggle("hl", !!q && row.dataset.id === focus);
  if (s && s.backend === "paged") {
    const mine = new Set(q && q.block_table ? q.block_table : []);
    cells.forEach((c, i) => c.classList.toggle("hl", mine.has(i)));
  }
  for (const row of $("slots").children) row.classList.toggle("hl", !!q && row.dataset.owner === focus);
  if (q) detailFor(s, q);
  else {
    const p = document.createElement("p");
    p.className = "note";
    p.textContent = "Hover a request or a block to see its block table.";
    $("detail").replaceChildren(p);
  }
}

function hover(target) {
  const el = target.closest("[data-id], [data-owner]");
  const id = el ? (el.dataset.id || el.dataset.owner || null) : null;
  if (id !== focus) { focus = id; applyFocus(); }
}

// ---- wiring -----------------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || inflight) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => { if (inflight) inflight.abort(); });
  $("new-chat").addEventListener("click", newChat);
  for (const id of ["seqs", "map", "slots"]) {
    $(id).addEventListener("mouseover", (e) => hover(e.target));
    $(id).addEventListener("mouseleave", () => { focus = null; applyFocus(); });
  }
  $("auth-form").addEventListener("submit", (e) => {
    e.preventDefault();
    apiKey = $("auth-key").value.trim();
    sessionStorage.setItem(KEY_STORE, apiKey);
    $("auth-error").textContent = "checking…";
    start();
  });
  start();
});
