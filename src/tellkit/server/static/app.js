// tellkit demo page: talks only to this server's /health, /api/samples, /api/caption and /api/recognize.
"use strict";

const $ = (id) => document.getElementById(id);
// maxFieldChars / maxPoints: the server's limits on the pad's strokes, from /health
const state = { caption: null, active: -1, captionFile: null, mathFile: null, maxFieldChars: 20000, maxPoints: 100000 };

// ---------------------------------------------------------------- errors and status
function showError(msg) {
  const el = $("error");
  el.textContent = msg;
  el.hidden = false;
}
function clearError() { $("error").hidden = true; $("error").textContent = ""; }

// A result that no longer answers what is on screen: greyed while a new request runs (or the
// input changed), removed when a request fails, so an error is never shown beside an old answer.
function staleResult(id) { $(id).classList.add("stale"); $(id).setAttribute("aria-busy", "true"); }
function freshResult(id) { $(id).classList.remove("stale"); $(id).removeAttribute("aria-busy"); $(id).hidden = false; }
function clearResult(id) {
  freshResult(id);
  $(id).hidden = true;
  if (id === "caption-result") state.caption = null;
}

// The confidence (0..1) and the "unsure" flag, when the server sends them; nothing otherwise.
function showConfidence(el, res, unsureText) {
  const c = typeof res.confidence === "number" && Number.isFinite(res.confidence)
    ? Math.min(1, Math.max(0, res.confidence)) : null;
  const unsure = res.unsure === true;
  el.textContent = "";
  el.classList.toggle("unsure", unsure);
  el.hidden = c === null && !unsure;
  if (el.hidden) return;
  if (c !== null) {
    const meter = document.createElement("span");
    meter.className = "meter";
    meter.setAttribute("role", "meter");
    meter.setAttribute("aria-valuemin", "0");
    meter.setAttribute("aria-valuemax", "100");
    meter.setAttribute("aria-valuenow", String(Math.round(100 * c)));
    const bar = document.createElement("span");
    bar.style.width = (100 * c).toFixed(1) + "%";
    meter.appendChild(bar);
    el.append("confidence", meter, `${Math.round(100 * c)}%`);
  }
  if (unsure) {
    const flag = document.createElement("span");
    flag.className = "flag";
    flag.textContent = "unsure";
    const why = document.createElement("span");
    why.className = "why";
    why.textContent = unsureText;
    el.append(flag, why);
  }
}
window.addEventListener("error", (e) => showError("Page error: " + e.message));
window.addEventListener("unhandledrejection", (e) => showError("Page error: " + (e.reason && e.reason.message || e.reason)));

function describeModel(info) {
  if (!info) return "not loaded";
  const where = info.checkpoint ? info.checkpoint.split("/").slice(-3).join("/") : "no checkpoint";
  const trained = info.trained ? (info.train_steps ? `trained ${info.train_steps} steps` : "trained") : "UNTRAINED";
  return `${info.name || info.family} (${trained}, ${where})`;
}

async function checkHealth() {
  const st = $("status");
  try {
    const r = await fetch("/health");
    const h = await r.json();
    const c = h.models.caption, m = h.models.recognize;
    st.textContent = `caption: ${describeModel(c)} | recognize: ${describeModel(m)}`;
    st.className = "status" + ([c, m].some((x) => x && !x.trained) ? " untrained" : "");
    const lim = h.limits || {};
    state.maxFieldChars = lim.max_stroke_chars || lim.max_article_chars || state.maxFieldChars;
    state.maxPoints = lim.max_stroke_points || state.maxPoints;
    if (c && !(c.contexts || []).includes("article")) {
      $("article").placeholder = "The served captioning model does not read articles (image only): text here is ignored.";
    }
    st.title = [c, m].filter((x) => x && x.note)
      .map((x) => (typeof x.note === "string" ? x.note : JSON.stringify(x.note))).join("\n");
  } catch (err) {
    st.textContent = "server unreachable";
    st.className = "status down";
    showError("Cannot reach the server: " + err.message);
  }
}

// Posts a form and returns the JSON body, or throws an Error with the server's message.
async function postForm(url, form) {
  let r;
  try {
    r = await fetch(url, { method: "POST", body: form });
  } catch (err) {
    throw new Error("network error: " + err.message);
  }
  let body = null;
  const text = await r.text();
  try { body = JSON.parse(text); } catch (_) { /* not JSON */ }
  if (!r.ok) {
    const detail = body && (body.detail || body.error) ? body.detail || body.error : text.slice(0, 300);
    throw new Error(`${r.status} ${r.statusText}: ${detail}`);
  }
  if (!body) throw new Error("the server sent a response that is not JSON");
  return body;
}

// ---------------------------------------------------------------- tabs
document.querySelectorAll(".tab").forEach((tab) => tab.addEventListener("click", () => {
  document.querySelectorAll(".tab").forEach((t) => {
    const on = t === tab;
    t.classList.toggle("active", on);
    t.setAttribute("aria-selected", on ? "true" : "false");
    $(t.dataset.panel).hidden = !on;
  });
  clearError();  // an error belongs to the tab it came from
}));

// ---------------------------------------------------------------- file drop zones
function dropZone(zoneId, inputId, textId, onFile) {
  const zone = $(zoneId), input = $(inputId);
  input.addEventListener("change", () => { if (input.files[0]) onFile(input.files[0]); });
  ["dragenter", "dragover"].forEach((ev) => zone.addEventListener(ev, (e) => { e.preventDefault(); zone.classList.add("over"); }));
  ["dragleave", "drop"].forEach((ev) => zone.addEventListener(ev, (e) => { e.preventDefault(); zone.classList.remove("over"); }));
  zone.addEventListener("drop", (e) => {
    const f = e.dataTransfer.files[0];
    if (f) onFile(f);
  });
  return (f) => { $(textId).textContent = `${f.name} (${Math.round(f.size / 1024)} KiB)`; };
}
const captionLabel = dropZone("caption-drop", "caption-file", "caption-drop-text", (f) => {
  state.captionFile = f;
  captionLabel(f);
  if (state.caption) staleResult("caption-result");  // the result is for another image now
});
const mathLabel = dropZone("math-drop", "math-file", "math-drop-text", (f) => {
  state.mathFile = f;
  mathLabel(f);
  clearPad();  // the pad's drawing is not what is read now
  recognize(f);
});
const MATH_DROP_TEXT = $("math-drop-text").textContent;
function resetMathFile() { $("math-file").value = ""; state.mathFile = null; $("math-drop-text").textContent = MATH_DROP_TEXT; }

// ---------------------------------------------------------------- captioning
$("caption-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  clearError();
  const file = state.captionFile;
  if (!file) { clearResult("caption-result"); showError("Choose or drop an image first."); return; }
  const form = new FormData();
  form.append("image", file, file.name);
  form.append("article", $("article").value);
  $("caption-submit").disabled = true;
  $("caption-busy").hidden = false;
  staleResult("caption-result");
  try {
    const res = await postForm("/api/caption", form);
    await showCaption(res, file);
  } catch (err) {
    clearResult("caption-result");
    showError("Captioning failed: " + err.message);
  } finally {
    $("caption-submit").disabled = false;
    $("caption-busy").hidden = true;
  }
});

function loadImage(img, file) {
  return new Promise((resolve, reject) => {
    img.onload = () => resolve();
    img.onerror = () => reject(new Error("the browser cannot display this image"));
    if (img.src) URL.revokeObjectURL(img.src);
    img.src = URL.createObjectURL(file);
  });
}

async function showCaption(res, file) {
  await loadImage($("caption-image"), file);
  state.caption = res;
  state.active = -1;
  freshResult("caption-result");

  const cap = $("caption");
  cap.textContent = "";
  res.tokens.forEach((tok, i) => {
    const span = document.createElement("span");
    span.className = "word";
    span.textContent = tok.text;
    span.dataset.index = String(i);
    span.addEventListener("mouseenter", () => focusToken(i));
    span.addEventListener("click", () => focusToken(i));
    cap.appendChild(span);
  });
  if (!res.tokens.length) cap.textContent = "(the model produced an empty caption)";
  showConfidence($("caption-confidence"), res, "This photo looks unlike what the model learned "
    + "(Flickr8k: people, dogs, outdoor scenes): the caption may well be wrong.");

  renderArticle(res);
  let line = `model: ${describeModel(res.model)}; ${res.elapsed_ms} ms`;
  if (res.objects && res.objects.count === 0) {
    // no object detector ships offline: a new photo's objects context is empty
    line += `; objects: none (${res.objects.note || "no object detector available"})`;
  }
  $("model-line").textContent = line;
  focusToken(res.tokens.length ? 0 : -1);
}

function renderArticle(res) {
  const view = $("article-view");
  view.textContent = "";
  state.articleSpans = [];
  const text = res.article_text || "";
  if (!((res.model && res.model.contexts) || []).includes("article")) {
    view.textContent = "(this model does not read the article)";
    return;
  }
  if (!text) { view.textContent = "(no article given)"; return; }
  const toks = (res.article_tokens || []).map((t, i) => ({ ...t, i })).filter((t) => t.end > t.start)
    .sort((a, b) => a.start - b.start);
  let pos = 0;
  for (const t of toks) {
    if (t.start < pos) continue;
    if (t.start > pos) view.appendChild(document.createTextNode(text.slice(pos, t.start)));
    const span = document.createElement("span");
    span.className = "tok";
    span.textContent = text.slice(t.start, t.end);
    span.title = t.text;
    state.articleSpans[t.i] = span;
    view.appendChild(span);
    pos = t.end;
  }
  if (pos < text.length) {
    const rest = document.createElement("span");
    rest.className = "unread";
    rest.title = "beyond the article encoder's token limit: not seen by the model";
    rest.style.color = "#999";
    rest.textContent = text.slice(pos);
    view.appendChild(rest);
  }
}

function focusToken(i) {
  const res = state.caption;
  if (!res) return;
  state.active = i;
  document.querySelectorAll("#caption .word").forEach((w) => w.classList.toggle("active", Number(w.dataset.index) === i));
  const att = i >= 0 ? res.tokens[i].attention : {};
  drawOverlay(res, att);
  highlightArticle(att.article || []);
  listFaces(res, att.faces || []);
  $("focus").textContent = i >= 0 ? `word ${i + 1}: "${res.tokens[i].text.trim()}"` : "";
}

function drawOverlay(res, att) {
  const img = $("caption-image"), cv = $("overlay");
  const w = img.clientWidth, h = img.clientHeight;
  cv.width = w; cv.height = h;
  cv.style.width = w + "px"; cv.style.height = h + "px";
  const ctx = cv.getContext("2d");
  ctx.clearRect(0, 0, w, h);
  const sx = w / res.image_size[0], sy = h / res.image_size[1];
  const weights = att.image || [];
  cv.dataset.heatmap = weights.length ? "drawn" : "none";
  if (weights.length) {
    const { rows, cols, box } = res.grid;
    const max = Math.max(...weights) || 1;
    const cw = (box[2] - box[0]) / cols, ch = (box[3] - box[1]) / rows;
    for (let r = 0; r < rows; r++) {
      for (let c = 0; c < cols; c++) {
        const a = weights[r * cols + c] / max;
        ctx.fillStyle = `rgba(255, 40, 0, ${(0.65 * a).toFixed(3)})`;
        ctx.fillRect((box[0] + c * cw) * sx, (box[1] + r * ch) * sy, cw * sx + 0.5, ch * sy + 0.5);
      }
    }
    ctx.strokeStyle = "rgba(255,255,255,0.7)";
    ctx.setLineDash([4, 3]);
    ctx.strokeRect(box[0] * sx, box[1] * sy, (box[2] - box[0]) * sx, (box[3] - box[1]) * sy);
    ctx.setLineDash([]);
  }
  cv.dataset.faces = String((res.faces || []).length);
  const fw = att.faces || [];
  const fmax = Math.max(...fw, 1e-9);
  (res.faces || []).forEach((f, k) => {
    const [x0, y0, x1, y1] = f.box;
    const a = fw.length ? fw[k] / fmax : 0;
    ctx.lineWidth = 2 + 4 * a;
    ctx.strokeStyle = `rgba(0, 200, 255, ${0.5 + 0.5 * a})`;
    ctx.strokeRect(x0 * sx, y0 * sy, (x1 - x0) * sx, (y1 - y0) * sy);
    ctx.fillStyle = "rgba(0, 200, 255, 0.9)";
    ctx.font = "12px sans-serif";
    ctx.fillText(`face ${k + 1}${fw.length ? " " + (100 * fw[k]).toFixed(0) + "%" : ""}`, x0 * sx + 2, Math.max(12, y0 * sy - 3));
  });
}

function highlightArticle(weights) {
  const max = Math.max(...weights, 1e-9);
  (state.articleSpans || []).forEach((span, i) => {
    if (!span) return;
    const a = (weights[i] || 0) / max;
    span.style.background = a > 0.02 ? `rgba(255, 140, 0, ${(0.8 * a).toFixed(3)})` : "";
    span.title = `${(100 * (weights[i] || 0)).toFixed(1)}%`;
  });
}

function listFaces(res, weights) {
  const ul = $("faces");
  ul.textContent = "";
  if (!(res.model && res.model.contexts || []).includes("faces")) { ul.textContent = "(this model does not use faces)"; return; }
  if (!res.faces.length) { ul.textContent = "(no face detected)"; return; }
  res.faces.forEach((f, k) => {
    const li = document.createElement("li");
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = (120 * (weights[k] || 0)).toFixed(1) + "px";
    li.append(`face ${k + 1} (p=${f.score.toFixed(2)})`, bar, `${(100 * (weights[k] || 0)).toFixed(1)}%`);
    ul.appendChild(li);
  });
}

window.addEventListener("resize", () => { if (state.caption) focusToken(state.active); });

// ---------------------------------------------------------------- math: drawing pad
// The pad draws in a fixed 640 x 200 space (its canvas size), whatever its size on screen:
// pointer positions are scaled back into that space, so a stroke means the same to the model
// on a phone as on a desktop.
const pad = $("pad");
const pctx = pad.getContext("2d");
const INK = { lineWidth: 5, lineCap: "round", lineJoin: "round", strokeStyle: "#000" };
function clearPad() {
  pctx.fillStyle = "#fff";
  pctx.fillRect(0, 0, pad.width, pad.height);
  state.inked = false;
  state.strokes = [];  // what is sent: the pen's points, rendered on the server like InkML
}
clearPad();
let drawing = false;
function padPoint(e) {
  const r = pad.getBoundingClientRect();
  return [(e.clientX - r.left) * pad.width / r.width, (e.clientY - r.top) * pad.height / r.height];
}
pad.addEventListener("pointerdown", (e) => {
  drawing = true;
  pad.setPointerCapture(e.pointerId);
  const [x, y] = padPoint(e);
  pctx.beginPath();
  pctx.moveTo(x, y);
  pctx.lineTo(x + 0.1, y + 0.1);
  Object.assign(pctx, INK);
  pctx.stroke();
  state.inked = true;
  state.strokes.push([[x, y]]);
  if (!$("math-result").hidden) staleResult("math-result");  // the drawing no longer matches it
});
pad.addEventListener("pointermove", (e) => {
  if (!drawing) return;
  const [x, y] = padPoint(e);
  pctx.lineTo(x, y);
  pctx.stroke();
  state.strokes[state.strokes.length - 1].push([x, y]);
});
["pointerup", "pointercancel"].forEach((ev) => pad.addEventListener(ev, () => { drawing = false; }));
$("pad-clear").addEventListener("click", () => { clearPad(); clearResult("math-result"); clearError(); });
$("pad-recognize").addEventListener("click", () => {
  if (!state.inked) { clearResult("math-result"); showError("Draw an expression first."); return; }
  recognize(null, state.strokes);
});

// The strokes as sent: one decimal (a tenth of a pad pixel, far finer than the model's render),
// repeated points dropped; points closer than `gap` pad pixels are thinned out as well when
// the JSON would pass the server's limits (characters of the field, points in all).
function wireStrokes(strokes, gap) {
  return strokes.map((s) => {
    const out = [];
    for (const [x, y] of s) {
      const p = [Math.round(10 * x) / 10, Math.round(10 * y) / 10];
      const last = out[out.length - 1];
      if (!last || Math.hypot(p[0] - last[0], p[1] - last[1]) > gap) out.push(p);
    }
    const end = s[s.length - 1];  // keep where the stroke ends
    const e = [Math.round(10 * end[0]) / 10, Math.round(10 * end[1]) / 10];
    const last = out[out.length - 1];
    if (last[0] !== e[0] || last[1] !== e[1]) out.push(e);
    return out;
  });
}
function strokesField(strokes) {
  for (const gap of [0, 1, 2, 3, 5]) {
    const wire = wireStrokes(strokes, gap);
    const text = JSON.stringify(wire);
    if (text.length <= state.maxFieldChars && wire.flat().length <= state.maxPoints) return text;
  }
  return null;
}

async function recognize(file, strokes) {
  clearError();
  const form = new FormData();
  if (strokes) {
    const text = strokesField(strokes);
    if (text === null) {
      clearResult("math-result");
      showError("This drawing has more points than the server accepts; clear the pad and draw it again.");
      return;
    }
    form.append("strokes", text);
  } else {
    form.append("image", file, file.name);
  }
  $("math-busy").hidden = false;
  staleResult("math-result");
  try {
    const res = await postForm("/api/recognize", form);
    freshResult("math-result");
    $("latex").textContent = res.latex;
    renderLatex(res.latex);
    showConfidence($("math-confidence"), res, "This looks unlike the handwriting the model learned "
      + "(CROHME expressions): the LaTeX may well be wrong.");
    $("math-model-line").textContent = `model: ${describeModel(res.model)}; score ${res.score === null ? "n/a" : res.score.toFixed(3)}; ${res.elapsed_ms} ms`;
  } catch (err) {
    clearResult("math-result");
    showError("Recognition failed: " + err.message);
  } finally {
    $("math-busy").hidden = true;
  }
}

function renderLatex(latex) {
  const out = $("rendered");
  if (typeof katex === "undefined") {
    out.textContent = "";
    showError("KaTeX is not loaded (static/vendor/katex is missing: run `make setup`), so the LaTeX cannot be rendered.");
    return;
  }
  try {
    katex.render(latex, out, { throwOnError: true, displayMode: true });
  } catch (err) {
    out.textContent = "";
    showError("The recognised LaTeX does not render: " + err.message);
  }
}

// ---------------------------------------------------------------- packaged samples, one click away
const SAMPLE_GROUPS = {
  inside: "Photos like those the model learned (people, dogs, outdoor scenes):",
  outside: "Photos unlike them (expect a wrong caption):",
};

async function loadSamples() {
  let index;
  try {
    const r = await fetch("/api/samples");
    if (!r.ok) return;  // an older server: the page works without samples
    index = await r.json();
  } catch (_) { return; }
  const strip = $("caption-samples");
  const photos = index.caption || [];
  for (const domain of [...Object.keys(SAMPLE_GROUPS), undefined]) {
    const these = photos.filter((s) => (domain ? s.domain === domain : !(s.domain in SAMPLE_GROUPS)));
    if (!these.length) continue;
    const group = document.createElement("div");
    group.className = "sample-group";
    group.dataset.domain = domain || "other";
    const title = document.createElement("span");
    title.className = "samples-title";
    title.textContent = domain ? SAMPLE_GROUPS[domain] : "Sample photos:";
    group.appendChild(title);
    these.forEach((s) => group.appendChild(sampleButton(s)));
    strip.appendChild(group);
  }
  strip.hidden = !photos.length;
  const formulas = index.recognize || [];
  formulas.forEach((m) => $("math-samples").appendChild(formulaButton(m)));
  $("math-samples").hidden = !formulas.length;
}

function sampleButton(s) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "sample";
  b.title = (s.about || s.name) + (s.article ? " (with its article)" : "");
  b.dataset.sample = s.name;
  if (s.domain) b.dataset.domain = s.domain;
  const img = document.createElement("img");
  img.src = s.url;
  img.alt = s.about || s.name;
  b.appendChild(img);
  b.addEventListener("click", () => captionSample(s));
  return b;
}

function formulaButton(m) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "formula";
  b.dataset.sample = m.name;
  b.title = `pen strokes of ${m.latex}`;
  try {
    katex.render(m.latex, b, { throwOnError: true });
  } catch (_) {
    b.textContent = m.latex;  // KaTeX missing: the LaTeX as text (renderLatex reports the cause)
  }
  b.addEventListener("click", () => mathSample(m));
  return b;
}

async function captionSample(s) {
  clearError();
  $("caption-file").value = "";  // the file input no longer holds what is captioned
  try {
    const r = await fetch(s.url);
    if (!r.ok) throw new Error(`${r.status} ${r.statusText}`);
    const blob = await r.blob();
    const file = new File([blob], s.name, { type: blob.type });
    state.captionFile = file;
    captionLabel(file);
    $("article").value = s.article || "";
  } catch (err) {
    clearResult("caption-result");
    showError("Could not load the sample: " + err.message);
    return;
  }
  $("caption-form").requestSubmit();
}

// draws the sample's pen strokes on the pad, scaled to fit, and recognises them like a drawing
function mathSample(sample) {
  clearPad();
  resetMathFile();
  const pts = sample.strokes.flat();
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  const x0 = Math.min(...xs), y0 = Math.min(...ys);
  const w = Math.max(...xs) - x0 || 1, h = Math.max(...ys) - y0 || 1;
  const margin = 20;
  const k = Math.min((pad.width - 2 * margin) / w, (pad.height - 2 * margin) / h);
  const ox = (pad.width - k * w) / 2, oy = (pad.height - k * h) / 2;
  Object.assign(pctx, INK);
  sample.strokes.forEach((stroke) => {
    const placed = stroke.map(([x, y]) => [ox + (x - x0) * k, oy + (y - y0) * k]);
    pctx.beginPath();
    pctx.moveTo(placed[0][0], placed[0][1]);
    placed.forEach(([x, y]) => pctx.lineTo(x, y));
    if (placed.length === 1) pctx.lineTo(placed[0][0] + 0.1, placed[0][1] + 0.1);
    pctx.stroke();
    state.strokes.push(placed);
  });
  state.inked = true;
  recognize(null, state.strokes);
}

checkHealth();
loadSamples();
