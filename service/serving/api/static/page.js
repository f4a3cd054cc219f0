// The credit page: calls this service's own /v1 API and draws what it returns. It computes no credit.
"use strict";

const EXAMPLES = {
  "tweet-sentiment": [
    "The food was great but the service was slow.",
    "I love this new phone, the battery lasts forever!",
    "Worst customer service ever. Never flying with them again.",
  ],
  "bbc-news-topics": [
    "Arsenal came from behind to beat Chelsea 2-1 at Highbury on Saturday. The striker scored twice in the " +
      "second half to lift the champions back to the top of the Premiership table.",
    "Shares in the telecoms group fell 8% after it warned that profits would miss forecasts. Analysts said the " +
      "firm's debt and weak sales in Europe would weigh on its results for the rest of the year.",
    "The new handheld console will let gamers download films and music as well as play online. The company " +
      "said its software would be updated over broadband connections.",
  ],
  "bbc-news-digests": [
    "Chancellor unveils budget: the chancellor set out tax cuts for families ahead of the election. " +
      "Arsenal beat Chelsea: the striker scored twice in the second half at Highbury.",
    "Box office record for new film: the fantasy sequel took more in its first weekend than any film before it.",
  ],
};
const GENERIC = ["This is a short example text.", "Another example, with two sentences. Here is the second."];
const NEG = [178, 24, 43];
const POS = [33, 102, 172];

const state = { key: null, result: null, target: null, answers: [], lookAgain: null };
const $ = (id) => document.getElementById(id);

class ApiError extends Error {
  constructor(status, doc, retryAfter) {
    super(describe(status, doc, retryAfter));
    this.status = status;
  }
}

function describe(status, doc, retryAfter) {
  const detail = doc && doc.error ? (typeof doc.error === "string" ? doc.error : doc.error.message) : "";
  switch (status) {
    case 401: return "This server needs an API key: type it in the API key field at the top, then Use key. " +
      `(${detail})`;
    case 413: return `Too large for this server: ${detail}.`;
    case 422: return `The server could not accept this request: ${detail}.`;
    case 503: return "The server is busy or shutting down" +
      (retryAfter ? `; try again in ${retryAfter} s` : "; try again shortly") + `. (${detail})`;
    case 504: return `The server did not finish in time: ${detail}.`;
    default: return `The server answered ${status}: ${detail || "no details"}.`;
  }
}

async function api(path, body) {
  const headers = {};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (state.key) headers["Authorization"] = "Bearer " + state.key;  // kept in memory only, never in a URL
  let response;
  try {
    response = await fetch(path, { method: body === undefined ? "GET" : "POST", headers,
                                   body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (e) {
    throw new Error("The server cannot be reached: " + e.message);
  }
  let doc = null;
  try { doc = await response.json(); } catch (e) { doc = null; }
  if (!response.ok) throw new ApiError(response.status, doc, response.headers.get("Retry-After"));
  return doc;
}

function showError(message) {
  const el = $("error");
  el.textContent = message;
  el.hidden = !message;
}

function setStatus(message) { $("status").textContent = message; }

function colour(value, scale) {
  const v = Math.max(-1, Math.min(1, scale > 0 ? value / scale : 0));
  const c = v < 0 ? NEG : POS;
  const a = Math.abs(v);
  const mix = c.map((x) => Math.round(255 * (1 - a) + x * a));
  return `rgb(${mix[0]}, ${mix[1]}, ${mix[2]})`;
}

function ink(value, scale) {  // white text on the darkest backgrounds
  return scale > 0 && Math.abs(value) / scale > 0.6 ? "#fff" : "";
}

function maxAbs(values) {
  let m = 0;
  for (const v of values) m = Math.max(m, Math.abs(v));
  return m || 1e-9;
}

function fmt(x) { return Math.abs(x) >= 100 ? x.toFixed(1) : x.toPrecision(3); }

const LOOK_AGAIN_MS = 5000;  // while the server has no model loaded, how often the page asks again

async function loadModels() {
  clearTimeout(state.lookAgain);
  showError("");
  const select = $("model");
  try {
    const list = await api("v1/models");
    select.replaceChildren(...list.models.map((m) => {
      const o = document.createElement("option");
      o.value = m.name;
      o.textContent = `${m.name} (${m.labels.join(", ")})`;
      o.selected = m.name === list.default;
      return o;
    }));
    showExamples();
    if (!list.models.length) {  // a server started on an empty repository: models come later
      showError("No model is loaded yet: this page looks again every few seconds.");
      state.lookAgain = setTimeout(loadModels, LOOK_AGAIN_MS);
    }
  } catch (e) {
    showError(e.message);
  }
}

function chosenModels() {
  return [...$("model").selectedOptions].map((o) => o.value);
}

function showExamples() {
  const model = chosenModels()[0];
  const texts = EXAMPLES[model] || GENERIC;
  $("examples").replaceChildren(...texts.map((t, k) => {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "example";
    b.textContent = `Example ${k + 1}`;
    b.title = t;
    b.addEventListener("click", () => { $("text").value = t; });
    return b;
  }));
}

async function explain() {
  const text = $("text").value;
  const models = chosenModels();
  if (!text.trim()) { showError("Type or paste a text first."); return; }
  if (!models.length) { showError("No model to ask: load the models first (an API key may be needed)."); return; }
  showError("");
  setStatus("Explaining…");
  $("explain").disabled = true;
  try {
    // several models: one request, the text encoded once for the models on one backbone
    const method = $("method").value;
    const bodies = models.length === 1
      ? [await api(`v1/models/${encodeURIComponent(models[0])}/explain`, { inputs: [text], target: "all", method })]
      : (await api("v1/explain", { inputs: [text], target: "all", models, method })).responses;
    state.answers = bodies.map((b) => ({ model: b.model, result: b.results[0] }));
    state.text = text;
    showAnswer(0);
    setStatus("");
  } catch (e) {
    setStatus("");
    showError(e.message);
  } finally {
    $("explain").disabled = false;
  }
}

function showAnswer(k) {
  state.result = state.answers[k].result;
  state.target = state.result.label;
  $("answered-row").hidden = state.answers.length < 2;
  $("answered").replaceChildren(...state.answers.map((a, j) => {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "target" + (j === k ? " active" : "");
    b.textContent = a.model;
    b.dataset.model = a.model;
    b.addEventListener("click", () => showAnswer(j));
    return b;
  }));
  render();
}

function render() {
  const r = state.result;
  $("output").hidden = false;
  $("label").textContent = r.label;
  $("score").textContent = `(${(100 * r.score).toFixed(1)}%)`;
  $("bars").replaceChildren(...Object.entries(r.scores).map(([label, p]) => {
    const row = document.createElement("div");
    row.className = "bar";
    row.dataset.label = label;
    row.innerHTML = '<span class="name"></span><div class="track"><div class="fill"></div></div><span class="p"></span>';
    row.querySelector(".name").textContent = label;
    row.querySelector(".fill").style.width = `${(100 * p).toFixed(1)}%`;
    row.querySelector(".p").textContent = `${(100 * p).toFixed(1)}%`;
    return row;
  }));
  $("targets").replaceChildren(...r.targets.map((label) => {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "target";
    b.textContent = label;
    b.dataset.label = label;
    b.addEventListener("click", () => { state.target = label; recolour(); });
    return b;
  }));
  recolour();
}

function recolour() {
  const r = state.result;
  const c = r.credit[state.target];
  for (const b of $("targets").children) b.setAttribute("aria-pressed", String(b.dataset.label === state.target));
  const units = r.method === "shares"
    ? "routing shares (eq. 15), unit variance"
    : `logits of ${r.contrast ? `"${state.target}" minus the mean of all labels` : `"${state.target}"`}` +
      (r.method === "end_to_end" ? ", split over the input tokens through the encoder" : "");
  $("columns").textContent = r.method === "end_to_end"
    ? "the depth through which the head reads each input token's share"
    : "where the head reads each token's hidden state";
  const scale = maxAbs(c.words.map((w) => w.credit));
  legend($("legend"), scale, `word credit, ${units}` +
    (c.logit === null ? "" : `; logit ${fmt(c.logit)} = baseline ${fmt(c.baseline)} + the tokens' credit`));
  renderText(c, scale);
  renderSentences(c, scale);
  renderHeatmap(c);
}

function legend(el, scale, text) {
  el.innerHTML = '<span class="lo"></span><span class="scale"></span><span class="hi"></span><span class="what"></span>';
  el.querySelector(".lo").textContent = `−${fmt(scale)}`;
  el.querySelector(".hi").textContent = `+${fmt(scale)}`;
  el.querySelector(".what").textContent = `(0 is white) ${text}`;
}

function renderText(c, scale) {
  const text = state.text;
  const tokens = state.result.tokens;
  const frag = document.createDocumentFragment();
  let last = 0;
  let t = 0;
  for (const w of c.words) {
    if (w.start > last) frag.append(text.slice(last, w.start));
    const span = document.createElement("span");
    span.className = "word";
    span.textContent = text.slice(w.start, w.end);
    span.dataset.credit = String(w.credit);
    span.style.background = colour(w.credit, scale);
    span.style.color = ink(w.credit, scale);
    const pieces = [];
    while (t < tokens.length && (tokens[t].special || tokens[t].end <= w.start)) t += 1;
    for (let k = t; k < tokens.length && tokens[k].start < w.end; k += 1) if (!tokens[k].special) pieces.push(tokens[k].token);
    span.title = `${span.textContent}: credit ${w.credit.toFixed(4)}\ntokens: ${pieces.join(" ")}`;
    frag.append(span);
    last = Math.max(last, w.end);
  }
  if (last < text.length) frag.append(text.slice(last));
  $("rendered").replaceChildren(frag);
}

function renderSentences(c, scale) {
  const el = $("sentences");
  if (c.sentences.length < 2) { el.replaceChildren(); return; }
  const head = document.createElement("h2");
  head.textContent = "Sentence totals";
  el.replaceChildren(head, ...c.sentences.map((s) => {
    const row = document.createElement("div");
    row.className = "sentence";
    row.dataset.credit = String(s.credit);
    const total = maxAbs(c.sentences.map((x) => x.credit));
    row.style.background = colour(s.credit, total);
    row.style.color = ink(s.credit, total);
    row.innerHTML = "<span></span><strong></strong>";
    row.firstChild.textContent = s.text;
    row.lastChild.textContent = fmt(s.credit);
    return row;
  }));
}

function renderHeatmap(c) {
  const canvas = $("heatmap");
  const tokens = state.result.tokens;
  const rows = c.depth.length;
  const cols = rows ? c.depth[0].length : 0;
  const cell = { w: 36, h: rows > 400 ? 4 : 16 };
  const left = cell.h >= 12 ? 120 : 0;
  canvas.width = left + cols * cell.w;
  canvas.height = Math.max(1, rows * cell.h) + 18;
  canvas.dataset.rows = String(rows);
  canvas.dataset.cols = String(cols);
  const ctx = canvas.getContext("2d");
  const scale = maxAbs(c.depth.flat());
  legend($("heat-legend"), scale, "credit of one token at one depth");
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#555";
  for (let e = 0; e < cols; e += 1) ctx.fillText(e === 0 ? "emb" : `L${e}`, left + e * cell.w + 6, 12);
  for (let p = 0; p < rows; p += 1) {
    const y = 18 + p * cell.h;
    for (let e = 0; e < cols; e += 1) {
      ctx.fillStyle = colour(c.depth[p][e], scale);
      ctx.fillRect(left + e * cell.w, y, cell.w - 1, cell.h - (cell.h > 4 ? 1 : 0));
    }
    if (left) {
      ctx.fillStyle = "#333";
      ctx.fillText(tokens[p].token.slice(0, 16), 4, y + cell.h - 4);
    }
  }
  canvas.onmousemove = (ev) => {
    const rect = canvas.getBoundingClientRect();
    const e = Math.floor((ev.clientX - rect.left - left) / cell.w);
    const p = Math.floor((ev.clientY - rect.top - 18) / cell.h);
    const tip = $("tip");
    if (p < 0 || p >= rows || e < 0 || e >= cols) { tip.hidden = true; return; }
    tip.hidden = false;
    tip.textContent = `${tokens[p].token} · depth ${e}: ${c.depth[p][e].toFixed(4)}`;
    tip.style.left = `${ev.offsetX + 12}px`;
    tip.style.top = `${ev.offsetY + 12}px`;
  };
  canvas.onmouseleave = () => { $("tip").hidden = true; };
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.key = $("key").value.trim() || null;
  loadModels();
});
$("model").addEventListener("change", showExamples);
$("explain").addEventListener("click", explain);
$("method").addEventListener("change", () => { if (state.result) explain(); });
loadModels();
