// batchfit's page: the form -> POST /estimate -> the table and the breakdown, then POST /timeline -> the chart.
// No framework, no build step: the lists come from GET /models, GET /gpus and the schema (/openapi.json), so the
// page offers what this service accepts; every number shown is the service's, formatted here.
"use strict";

const KEY = "batchfit-api-key";
const GIB = 2 ** 30;
const SVG = "http://www.w3.org/2000/svg";
// the breakdown's fields, bottom (left) up, as GET /estimate's Breakdown names them
const BREAKDOWN = ["parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs", "buffers",
  "workspace", "communication"];
const $ = (id) => document.getElementById(id);

const gib = (bytes) => (bytes / GIB).toFixed(2) + " GiB";
const words = (name) => name.replace(/_/g, " ");

function el(tag, attrs = {}, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

class Problem extends Error {
  constructor(status, doc) {
    super(typeof doc === "object" && doc ? doc.detail || doc.title : String(doc).slice(0, 300));
    this.status = status;
    this.doc = typeof doc === "object" && doc ? doc : {};
  }
}

async function call(path, body) {
  const headers = {Accept: "application/json, application/problem+json"};
  const key = $("key").value.trim();
  if (key) headers.Authorization = "Bearer " + key;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let reply;
  try {
    reply = await fetch(path, {method: body === undefined ? "GET" : "POST", headers,
      body: body === undefined ? undefined : JSON.stringify(body)});
  } catch (exc) {
    throw new Problem(0, {detail: "the service could not be reached (" + exc.message + ")"});
  }
  const json = (reply.headers.get("content-type") || "").includes("json");
  const doc = json ? await reply.json() : await reply.text();
  if (!reply.ok) throw new Problem(reply.status, doc);
  return doc;
}

// --- errors next to the fields they name ------------------------------------------------------------------

function clearErrors() {
  for (const node of document.querySelectorAll(".error")) { node.hidden = true; node.textContent = ""; }
  for (const node of document.querySelectorAll("[aria-invalid]")) node.removeAttribute("aria-invalid");
}

// The control a problem's ``field`` names: the one whose data-field is the field (indices dropped: gpus[1] is
// the cards' list) or the longest prefix of it; none (the form's own line) for a field the form has no control of.
function controlFor(field) {
  const path = (field || "").replace(/\[\d+\]/g, "");
  let best = null;
  for (const node of document.querySelectorAll("[data-field]")) {
    const f = node.dataset.field;
    if ((path === f || path.startsWith(f + ".")) && (!best || f.length > best.dataset.field.length)) best = node;
  }
  return best;
}

function showProblem(problem) {
  const doc = problem.doc;
  const control = problem.status === 401 ? $("key") : controlFor(doc.field);
  let text = problem.message;
  if (doc.expected !== undefined && doc.expected !== null) {
    text = "got " + JSON.stringify(doc.value) + "; expected " + doc.expected;
  }
  if (control && !control.closest("[hidden]")) {
    const box = $("err-" + control.id);
    box.textContent = (doc.field && doc.field !== control.dataset.field ? doc.field + ": " : "") + text;
    box.hidden = false;
    control.setAttribute("aria-invalid", "true");
    control.focus();
    $("status").textContent = "The service refused the request: see the field marked.";
  } else {
    const box = $("err-form");
    box.textContent = (doc.field ? doc.field + ": " : "") + text + (problem.status ? " (HTTP " + problem.status + ")" : "");
    box.hidden = false;
    $("status").textContent = "The service could not answer: see above the form.";
  }
}

// --- the lists -------------------------------------------------------------------------------------------

function fill(select, values, labels = values, chosen = []) {
  select.replaceChildren(...values.map((v, i) => {
    const option = el("option", {value: String(v)}, String(labels[i]));
    option.selected = chosen.includes(v);
    return option;
  }));
}

let MODELS = {};

function showSource() {
  const source = $("source").value;
  $("preset-row").hidden = source !== "transformers";
  $("name-row").hidden = source === "transformers";
  $("seq-row").hidden = source !== "transformers";  // the vision sources take no sequence length
  const listing = MODELS[source] || {};
  const names = source === "timm" ? listing.names || [] : Object.values(listing).flat();
  $("names").replaceChildren(...(source === "transformers" ? [] : names).map((n) => el("option", {value: n})));
}

async function loadLists() {
  clearErrors();
  $("status").textContent = "Loading the models, the cards and the schema…";
  try {
    const [gpus, models, schema] = await Promise.all([call("gpus"), call("models"), call("openapi.json")]);
    MODELS = models;
    const sources = Object.keys(models);
    fill($("source"), sources, sources, [sources.includes("transformers") ? "transformers" : sources[0]]);
    fill($("preset"), models.transformers.presets, models.transformers.presets, ["gpt2"]);
    const names = gpus.gpus.map((g) => g.name);
    const wanted = names.filter((n) => ["A100-80GB", "H100-80GB", "L4-24GB"].includes(n));
    fill($("gpus"), names, gpus.gpus.map((g) => g.name + " (" + gib(g.memory_bytes) + ")"),
      wanted.length ? wanted : names.slice(0, 1));
    const schemas = schema.components.schemas;
    const precisions = schemas.TrainingSpec.properties.precision.enum;
    fill($("precision"), precisions, precisions, [precisions.includes("amp-bf16") ? "amp-bf16" : precisions[0]]);
    const optimizers = schemas.OptimizerSpec.properties.name.enum;
    fill($("optimizer"), optimizers, optimizers, ["adamw"]);
    const modes = schemas.TrainingSpec.properties.gradient_checkpointing.anyOf.flatMap((s) => s.enum || [false, true]);
    fill($("checkpointing"), modes, modes.map((m) => (m === false ? "off" : m === true ? "on" : m)), [false]);
    if (!$("seq_len").value) $("seq_len").value = "1024";
    showSource();
    $("status").textContent = "";
  } catch (problem) {
    showProblem(problem);
    $("status").textContent = "The lists could not be loaded" + (problem.status === 401 ? ": enter the key." : ".");
  }
}

// --- the request --------------------------------------------------------------------------------------------

function integer(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

function request() {
  const source = $("source").value;
  const model = source === "transformers" ? {source, preset: $("preset").value} : {source, name: $("name").value.trim()};
  const input = {};
  if (!$("seq-row").hidden && integer("seq_len") !== undefined) input.seq_len = integer("seq_len");
  if (integer("image_size") !== undefined) input.image_size = [3, integer("image_size"), integer("image_size")];
  const mode = $("checkpointing").value;
  const body = {
    model, input,
    training: {precision: $("precision").value, optimizer: {name: $("optimizer").value},
      gradient_checkpointing: mode === "true" ? true : mode === "false" ? false : mode},
    gpus: Array.from($("gpus").selectedOptions, (o) => o.value),
  };
  if (integer("batch_size") !== undefined) body.batch_size = integer("batch_size");
  return body;
}

// --- the answer -------------------------------------------------------------------------------------------

function cell(row, value, bytes) {
  const none = value === null || value === undefined;
  const td = el("td", none ? {class: "none"} : {"data-value": String(value)}, none ? "-" : bytes ? gib(value) : String(value));
  row.append(td);
}

function showTable(answer) {
  const body = $("results").querySelector("tbody");
  body.replaceChildren();
  const tips = $("suggestions").querySelector("ul");
  tips.replaceChildren();
  for (const r of answer.results) {
    const row = el("tr", {"data-gpu": r.gpu});
    row.append(el("th", {scope: "row"}, r.gpu));
    cell(row, r.capacity_bytes, true);
    cell(row, r.max_batch_size);
    cell(row, r.recommended_batch_size);
    cell(row, r.max_memory && r.max_memory.device_peak_bytes, true);
    cell(row, r.recommended_memory && r.recommended_memory.device_peak_bytes, true);
    body.append(row);
    for (const s of r.suggestions || []) {
      const per = s.world_size > 1 ? " per rank, " + s.world_size + " ranks" : "";
      tips.append(el("li", {"data-gpu": r.gpu}, r.gpu + ": " + s.description + " (max " + (s.max_batch_size ?? "-") +
        ", recommended " + (s.recommended_batch_size ?? "-") + per + ")" + (s.changes_method ? "; it trains another way" : "")));
    }
  }
  $("suggestions").hidden = tips.children.length === 0;
  const notes = $("notes");
  notes.replaceChildren(...answer.warnings.map((w) => el("li", {class: "warning", "data-code": w.code}, w.message)),
    ...answer.assumptions.map((a) => el("li", {}, a)));
}

function legend(items) {
  const list = el("ul", {class: "legend"});
  for (const [cls, label] of items) {
    const li = el("li");
    li.append(el("span", {class: "swatch " + cls, "aria-hidden": "true"}), document.createTextNode(label));
    list.append(li);
  }
  return list;
}

// One stacked horizontal bar of the breakdown at the allocated peak, to the scale of the first card's capacity.
function showBreakdown(answer) {
  const b = answer.breakdown, first = answer.results[0];
  const parts = BREAKDOWN.filter((k) => b[k] > 0);
  const total = parts.reduce((s, k) => s + b[k], 0);
  const scale = Math.max(total, first.capacity_bytes);
  const W = 900, H = 56, left = 10, right = 10, width = W - left - right;
  const svg = el("svg:svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-labelledby": "breakdown-title"});
  svg.append(el("svg:title", {id: "breakdown-title"}, `Allocated at the peak, batch ${b.batch_size}: ${gib(total)} of ` +
    `${first.gpu}'s ${gib(first.capacity_bytes)}: ` + parts.map((k) => `${words(k)} ${gib(b[k])}`).join(", ")));
  let x = left;
  for (const k of parts) {
    const w = (b[k] / scale) * width;
    svg.append(el("svg:rect", {class: "bar c-" + k, x, y: 8, width: Math.max(w, 0.5), height: 26, "data-series": k,
      "data-bytes": b[k]}));
    x += w;
  }
  const cap = left + (first.capacity_bytes / scale) * width;
  svg.append(el("svg:line", {class: "usable", x1: cap, x2: cap, y1: 2, y2: 40, "data-series": "capacity"}));
  svg.append(el("svg:text", {x: cap, y: 52, "text-anchor": "end"}, `${first.gpu} ${gib(first.capacity_bytes)}`));
  const caption = el("figcaption", {}, `The first card's step at batch ${b.batch_size}, at its allocated peak: ` +
    `${gib(total)} by what it holds (requested bytes; the allocator's cache and the CUDA context come on top).`);
  $("breakdown").replaceChildren(caption, svg,
    legend(parts.map((k) => ["c-" + k, `${words(k)} ${gib(b[k])} (${((100 * b[k]) / total).toFixed(1)} %)`])));
}

// The timeline: the categories stacked as bands, allocated and reserved as lines, the usable capacity, the peak.
function showTimeline(t) {
  const W = 900, H = 380, left = 64, right = 16, top = 44, bottom = 36;
  const plotW = W - left - right, plotH = H - top - bottom;
  const ymax = Math.max(t.reserved_peak_bytes, t.usable_bytes, t.allocated_peak_bytes, 1) * 1.06;
  const span = Math.max(t.events - 1, 1);
  const X = (event) => left + (event / span) * plotW;
  const Y = (bytes) => top + plotH - (bytes / ymax) * plotH;
  const svg = el("svg:svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-labelledby": "timeline-title timeline-desc"});
  svg.append(el("svg:title", {id: "timeline-title"}, `Memory of one training step on ${t.gpu} at batch ${t.batch_size}`));
  svg.append(el("svg:desc", {id: "timeline-desc"}, `${t.events} allocator events; allocated peak ` +
    `${gib(t.allocated_peak_bytes)} in ${t.peak_phase} at event ${t.peak_event}; reserved peak ` +
    `${gib(t.reserved_peak_bytes)}; usable ${gib(t.usable_bytes)} of ${gib(t.capacity_bytes)}.`));
  // y grid in whole GiB steps, about five of them
  const step = Math.max(1, Math.ceil(ymax / GIB / 5)) * GIB;
  for (let v = 0; v <= ymax; v += step) {
    svg.append(el("svg:line", {class: "grid", x1: left, x2: W - right, y1: Y(v), y2: Y(v)}));
    svg.append(el("svg:text", {x: left - 6, y: Y(v) + 4, "text-anchor": "end"}, (v / GIB).toFixed(0) + " GiB"));
  }
  // the bands, bottom up, in the timeline's order
  const xs = t.points.map(X);
  const below = new Array(t.points.length).fill(0);
  const shown = [];
  for (const [category, values] of Object.entries(t.categories)) {
    if (!values.some((v) => v > 0)) continue;
    const upper = values.map((v, i) => below[i] + v);
    const d = "M" + xs.map((x, i) => `${x.toFixed(1)},${Y(upper[i]).toFixed(1)}`).join("L") +
      "L" + xs.map((x, i) => `${x.toFixed(1)},${Y(below[i]).toFixed(1)}`).reverse().join("L") + "Z";
    svg.append(el("svg:path", {class: "band c-" + category, d, "data-series": category}));
    upper.forEach((v, i) => { below[i] = v; });
    shown.push(category);
  }
  for (const name of ["reserved", "allocated"]) {
    const pts = xs.map((x, i) => `${x.toFixed(1)},${Y(t[name][i]).toFixed(1)}`).join(" ");
    svg.append(el("svg:polyline", {class: "line " + name, points: pts, "data-series": name}));
  }
  svg.append(el("svg:line", {class: "usable", x1: left, x2: W - right, y1: Y(t.usable_bytes), y2: Y(t.usable_bytes),
    "data-series": "usable"}));
  svg.append(el("svg:text", {class: "usable-label", x: W - right - 4, y: Y(t.usable_bytes) - 5, "text-anchor": "end"},
    `usable ${gib(t.usable_bytes)}`));
  svg.append(el("svg:line", {class: "axis", x1: left, x2: W - right, y1: top + plotH, y2: top + plotH}));
  svg.append(el("svg:text", {x: left, y: H - 8}, "event 0"));
  svg.append(el("svg:text", {x: W - right, y: H - 8, "text-anchor": "end"}, `event ${t.events - 1}`));
  svg.append(el("svg:text", {x: left + plotW / 2, y: H - 8, "text-anchor": "middle"},
    "the step's allocations and frees, in order"));
  $("timeline").replaceChildren(el("figcaption", {}, `${t.gpu}, batch ${t.batch_size}: bytes live by category ` +
    "(bands), what the allocator has allocated and reserved (lines), and what it can have on the card (usable: " +
    "capacity - CUDA context - reserve)."), svg);
  phaseLabels(svg, t.phases, X, top, left, W - right, top + plotH);
  // the peak, on top of everything, its label on the side with room
  const px = X(t.peak_event), py = Y(t.allocated_peak_bytes);
  svg.append(el("svg:circle", {class: "peak", cx: px, cy: py, r: 5, "data-series": "peak"}));
  const label = el("svg:text", {class: "peak-label", x: px, y: Math.max(py - 10, top + 10)},
    `peak ${gib(t.allocated_peak_bytes)} (${t.peak_phase})`);
  svg.append(label);
  const w = label.getComputedTextLength();
  label.setAttribute("x", String(px + w + 8 > W - right ? px - w - 8 : px + 8));
  $("timeline").append(legend([...shown.map((c) => ["c-" + c, words(c)]), ["line-swatch allocated", "allocated"],
    ["line-swatch reserved", "reserved"], ["line-swatch usable", "usable"]]));
}

// A tick where each phase begins and its name above the plot: each label on the first of two rows where it
// clears the one before by 6 px (measured, not guessed), else only the tick, its name as the tick's tooltip.
function phaseLabels(svg, phases, X, top, x0, x1, y1) {
  const several = new Set(phases.map((p) => p.iteration)).size > 1;
  const ends = [-Infinity, -Infinity];
  for (const p of phases) {
    const name = several ? `${p.phase} ${p.iteration}` : p.phase;
    const x = X(p.start);
    const tick = el("svg:line", {class: "phase-tick", x1: x, x2: x, y1: top - 4, y2: y1});
    svg.append(tick);
    const text = el("svg:text", {class: "phase-label", y: 0}, name);
    svg.append(text);
    const w = text.getComputedTextLength();
    const at = Math.max(x0, Math.min(x + 2, x1 - w));
    const row = ends.findIndex((end) => at >= end + 6);
    if (row < 0) {
      text.remove();
      tick.append(el("svg:title", {}, name));
      continue;
    }
    text.setAttribute("x", String(at));
    text.setAttribute("y", String(top - 24 + row * 14));
    text.setAttribute("data-row", String(row));
    ends[row] = at + w;
  }
}

// --- the form -----------------------------------------------------------------------------------------------

async function submit(event) {
  event.preventDefault();
  clearErrors();
  const button = $("submit"), status = $("status");
  button.disabled = true;
  $("answer").hidden = true;  // an answer to another request, no longer the form's
  const body = request();
  try {
    status.textContent = "Estimating: a model's first estimate simulates its step, a minute or more…";
    const answer = await call("estimate", body);
    showTable(answer);
    showBreakdown(answer);
    $("timeline").replaceChildren();
    $("answer").hidden = false;
    $("answer-title").focus();
    const first = answer.results[0];
    // the batch POST /timeline would pick, given: one simulation rather than the planner's search again
    const batch = body.batch_size ?? first.recommended_batch_size ?? first.max_batch_size ?? first.min_batch_size;
    status.textContent = `Drawing ${first.gpu}'s step at batch ${batch}…`;
    showTimeline(await call("timeline", {...body, batch_size: batch}));
    const p = answer.provenance;
    status.textContent = `Done: ${p.simulations} simulations, ${p.seconds.toFixed(1)} s (batchfit ${p.batchfit}).`;
  } catch (problem) {
    if (!(problem instanceof Problem)) throw problem;
    showProblem(problem);
  } finally {
    button.disabled = false;
  }
}

function start() {
  const key = $("key");
  key.value = sessionStorage.getItem(KEY) || "";
  key.addEventListener("change", () => {
    sessionStorage.setItem(KEY, key.value.trim());
    loadLists();
  });
  $("source").addEventListener("change", showSource);
  $("job").addEventListener("submit", submit);
  loadLists();
}

document.addEventListener("DOMContentLoaded", start);
