// The live KV-cache page: reads /kv/events (server-sent events) and draws the pool, the sequences and plots.
// Plain DOM and canvas, no library: the page must work with no network but the server's.
"use strict";

const HISTORY_S = 600;          // the plots' span
const HISTORY_STEP_S = 0.5;     // one plotted point per half second at most
const NUMBERED_CELLS = 4096;    // up to this many blocks, shared cells show their ref count
const TABLE_IDS_SHOWN = 48;     // a long block table is cut in the list (hover shows all its blocks)

const $ = (id) => document.getElementById(id);
const key = new URLSearchParams(location.search).get("api_key");
const base = location.pathname.replace(/\/+$/, "");

const state = {
  frame: null,          // the newest snapshot, decoded
  cells: [],            // the grid's elements, one per block
  classes: [],          // each cell's current class name, to touch only what changed
  history: [],          // [time, η, running, waiting, swapped, preemptions]
  highlighted: [],      // cells outlined for the hovered or pinned sequence
  pinned: null,         // seq_id clicked
};

function decodeBytes(b64) {
  const raw = atob(b64);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes;
}

function decodeIds(b64) {
  return Array.from(new Int32Array(decodeBytes(b64).buffer));
}

function decodeFrame(message) {
  const frame = JSON.parse(message);
  frame.blocks = decodeBytes(frame.blocks);
  for (const seq of frame.sequences) {
    seq.block_table = decodeIds(seq.block_table);
    seq.swapped_blocks = decodeIds(seq.swapped_blocks);
  }
  return frame;
}

function cellClass(byte) {
  const refs = byte & 0x7f, cached = byte & 0x80;
  if (refs === 0) return cached ? "cell evictable" : "cell free";
  return (refs === 1 ? "cell held" : "cell shared") + (cached ? " in-cache" : "");
}

// ---- the grid -------------------------------------------------------------------------------------

function buildGrid(numBlocks) {
  const grid = $("kv-grid");
  const size = numBlocks <= 256 ? 22 : numBlocks <= 1024 ? 14 : numBlocks <= 8192 ? 8 : numBlocks <= 32768 ? 4 : 2;
  grid.style.setProperty("--cell", `${size}px`);
  const fragment = document.createDocumentFragment();
  state.cells = [];
  state.classes = [];
  for (let block = 0; block < numBlocks; block++) {
    const cell = document.createElement("div");
    cell.className = "cell free";
    cell.dataset.block = block;
    fragment.appendChild(cell);
    state.cells.push(cell);
    state.classes.push("cell free");
  }
  grid.replaceChildren(fragment);
}

function drawGrid(frame) {
  if (state.cells.length !== frame.num_blocks) buildGrid(frame.num_blocks);
  const numbered = frame.num_blocks <= NUMBERED_CELLS;
  for (let block = 0; block < frame.num_blocks; block++) {
    const byte = frame.blocks[block];
    const name = cellClass(byte);
    const cell = state.cells[block];
    if (state.classes[block] !== name) {
      cell.className = name;
      state.classes[block] = name;
    }
    const label = numbered && (byte & 0x7f) > 1 ? String(byte & 0x7f) : "";
    if (cell.textContent !== label) cell.textContent = label;
  }
  state.highlighted = [];
  highlight(state.pinned);
}

function drawSwapGrid(frame) {
  const cells = [];
  for (const seq of frame.sequences) {
    for (const block of seq.swapped_blocks) {
      const cell = document.createElement("div");
      cell.className = "cell swapped";
      cell.dataset.cpuBlock = block;
      cells.push(cell);
    }
  }
  $("kv-swap-grid").replaceChildren(...cells);
}

// ---- totals and sequences --------------------------------------------------------------------------

function drawTotals(frame) {
  let used = 0, shared = 0, cached = 0, evictable = 0;
  for (const byte of frame.blocks) {
    const refs = byte & 0x7f;
    used += refs > 0;
    shared += refs > 1;
    cached += (byte & 0x80) !== 0;
    evictable += refs === 0 && (byte & 0x80) !== 0;
  }
  $("kv-total").textContent = frame.num_blocks;
  $("kv-used").textContent = used;
  $("kv-shared").textContent = shared;
  $("kv-cached").textContent = cached;
  $("kv-evictable").textContent = evictable;
  $("kv-swapped").textContent = frame.swapped_out_blocks;
  $("kv-eta").textContent = frame.kv_utilization.toFixed(3);
  $("kv-step").textContent = frame.step;
  // Speculative decoding: the share of guessed tokens accepted, and the tokens a checked proposal yields.
  $("kv-spec").textContent = frame.spec_num_draft_tokens
    ? `${(frame.spec_num_accepted_tokens / frame.spec_num_draft_tokens * 100).toFixed(0)}% ` +
      `(${(1 + frame.spec_num_accepted_tokens / frame.spec_num_drafts).toFixed(2)})`
    : "–";
  const poolBytes = frame.num_blocks * frame.bytes_per_block;
  $("kv-block-size").textContent =
    `(${frame.num_blocks} blocks of ${frame.block_size} tokens, ` +
    `${formatBytes(frame.bytes_per_block)} each: ${formatBytes(poolBytes)})`;
}

// Bytes in binary units, as the pool's size is given (kv_cache_memory).
function formatBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit++;
  }
  return `${unit ? value.toFixed(1) : value} ${units[unit]}`;
}

function drawSequences(frame) {
  const rows = frame.sequences.map((seq) => {
    const row = document.createElement("tr");
    row.dataset.seq = seq.seq_id;
    if (seq.seq_id === state.pinned) row.classList.add("pinned");
    const table = seq.status === "swapped" ? seq.swapped_blocks.map((b) => `cpu${b}`) : seq.block_table;
    const shown = table.slice(0, TABLE_IDS_SHOWN).join(" ") + (table.length > TABLE_IDS_SHOWN ? " …" : "");
    for (const text of [seq.request_id, seq.seq_id, seq.status, seq.num_cached_tokens, shown]) {
      const cell = document.createElement("td");
      cell.textContent = text;
      row.appendChild(cell);
    }
    row.lastChild.className = "table";
    return row;
  });
  $("kv-requests").tBodies[0].replaceChildren(...rows);
}

function sequenceById(seqId) {
  return state.frame ? state.frame.sequences.find((seq) => seq.seq_id === seqId) : undefined;
}

function highlight(seqId) {
  for (const cell of state.highlighted) cell.classList.remove("hl");
  state.highlighted = [];
  const seq = seqId === null ? undefined : sequenceById(seqId);
  if (!seq) return;
  for (const block of seq.block_table) {
    if (block >= 0 && state.cells[block]) {
      state.cells[block].classList.add("hl");
      state.highlighted.push(state.cells[block]);
    }
  }
}

function owners(block) {
  const found = [];
  for (const seq of state.frame.sequences) {
    const position = seq.block_table.indexOf(block);
    if (position >= 0) found.push(`${seq.request_id} / seq ${seq.seq_id} (entry ${position})`);
  }
  return found;
}

function showTip(event, lines) {
  const tip = $("kv-tip");
  tip.replaceChildren(...lines.map((line) => Object.assign(document.createElement("div"), { textContent: line })));
  tip.style.left = `${event.clientX + 14}px`;
  tip.style.top = `${event.clientY + 14}px`;
  tip.hidden = false;
}

function wireInteractions() {
  $("kv-grid").addEventListener("mouseover", (event) => {
    const block = event.target.dataset.block;
    if (block === undefined || !state.frame) return;
    const byte = state.frame.blocks[block];
    const refs = byte & 0x7f;
    const lines = [`block ${block}: ${cellClass(byte).replace("cell ", "").replace("in-cache", "(cached)")}`,
      `ref count ${refs}${refs === 127 ? "+" : ""}`, ...owners(Number(block))];
    showTip(event, lines);
  });
  $("kv-grid").addEventListener("mouseleave", () => { $("kv-tip").hidden = true; });
  const body = $("kv-requests").tBodies[0];
  body.addEventListener("mouseover", (event) => {
    const row = event.target.closest("tr");
    if (row) highlight(Number(row.dataset.seq));
  });
  body.addEventListener("mouseleave", () => highlight(state.pinned));
  body.addEventListener("click", (event) => {
    const row = event.target.closest("tr");
    if (!row) return;
    const seqId = Number(row.dataset.seq);
    state.pinned = state.pinned === seqId ? null : seqId;
    for (const other of body.rows) other.classList.toggle("pinned", Number(other.dataset.seq) === state.pinned);
    highlight(state.pinned);
  });
}

// ---- plots ---------------------------------------------------------------------------------------

function record(point) {
  const last = state.history[state.history.length - 1];
  if (last && point[0] - last[0] < HISTORY_STEP_S) return;
  state.history.push(point);
  const horizon = point[0] - HISTORY_S;
  while (state.history.length && state.history[0][0] < horizon) state.history.shift();
}

function plot(canvasId, series, fixedMax) {
  const canvas = $(canvasId);
  const context = canvas.getContext("2d");
  const { width, height } = canvas;
  context.clearRect(0, 0, width, height);
  const points = state.history;
  if (points.length < 2) return;
  const now = points[points.length - 1][0];
  const max = fixedMax ?? Math.max(1, ...series.flatMap((s) => points.map(s.value)));
  const x = (t) => width - ((now - t) / HISTORY_S) * width;
  const y = (v) => height - 14 - (v / max) * (height - 24);
  context.font = "10px sans-serif";
  context.fillStyle = "#8b96a1";
  context.fillText(String(Math.round(max * 100) / 100), 4, 12);
  context.fillText("−10 min", 4, height - 3);
  context.fillText("now", width - 24, height - 3);
  for (const s of series) {
    context.strokeStyle = s.color;
    context.lineWidth = 1.5;
    context.beginPath();
    points.forEach((p, i) => (i ? context.lineTo(x(p[0]), y(s.value(p, i))) : context.moveTo(x(p[0]), y(s.value(p, i)))));
    context.stroke();
  }
}

function preemptionRate(point, index) {
  const previous = state.history[index - 1];
  if (!previous) return 0;
  return Math.max(point[5] - previous[5], 0) / Math.max(point[0] - previous[0], 1e-3);
}

function drawPlots() {
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue(name).trim();
  plot("plot-eta", [{ value: (p) => p[1], color: color("--held") }], null);
  plot("plot-queue", [
    { value: (p) => p[2], color: color("--held") },
    { value: (p) => p[3], color: color("--shared") },
    { value: (p) => p[4], color: color("--swapped") },
  ], null);
  plot("plot-preempt", [{ value: preemptionRate, color: color("--hl") }], null);
}

// ---- the stream ----------------------------------------------------------------------------------

function onSnapshot(message) {
  const frame = decodeFrame(message.data);
  state.frame = frame;
  drawGrid(frame);
  drawSwapGrid(frame);
  drawTotals(frame);
  drawSequences(frame);
  record([frame.time, frame.kv_utilization, frame.num_running, frame.num_waiting, frame.num_swapped,
    frame.num_preemptions]);
  drawPlots();
}

function connect() {
  const url = `${base}/events${key ? `?api_key=${encodeURIComponent(key)}` : ""}`;
  const source = new EventSource(url);
  const status = $("kv-status");
  source.addEventListener("open", () => { status.textContent = "live"; status.className = "status live"; });
  source.addEventListener("error", () => { status.textContent = "reconnecting…"; status.className = "status down"; });
  source.addEventListener("history", (message) => {
    state.history = JSON.parse(message.data);
    drawPlots();
  });
  source.addEventListener("snapshot", onSnapshot);
}

wireInteractions();
connect();
