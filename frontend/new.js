// New-job page: presets, a form for the common fields, a raw JSON editor for every field, inline
// validation errors from the API's 422 (JSON pointers), a dry-run estimate, and dataset upload.
import { api, loadMeta } from "./api.js";
import { funnelView } from "./funnel.js";
import { $, fmtBytes, fmtDuration, fmtNum, h, mountTopbar, showError, toast } from "./ui.js";

mountTopbar("new");

// [JSON pointer, label, kind]; the options of selects and the suggestions of text fields come from
// GET /v1/meta (the spec's own enums and built-in names).
const FIELDS = [
  ["/name", "Name", "text"],
  ["/tags", "Tags (comma separated)", "tags"],
  ["/target/model", "Target model", "text"],
  ["/target/dtype", "Target dtype", "select"],
  ["/data/sources/0/path", "Training data", "text"],
  ["/data/sources/0/max_samples", "Max samples (source)", "int"],
  ["/data/max_length", "Max tokens per conversation", "int"],
  ["/data/eval_samples", "Held-out conversations", "int"],
  ["/draft/num_layers", "Draft layers", "int"],
  ["/draft/draft_vocab_size", "Draft vocab size", "int"],
  ["/peagle/num_depths", "Parallel depths K", "int"],
  ["/peagle/down_sample_ratio", "Down-sample ratio r", "float"],
  ["/peagle/down_sample_ratio_min", "Down-sample floor r_min", "float"],
  ["/optim/lr", "Learning rate", "float"],
  ["/optim/epochs", "Epochs", "int"],
  ["/optim/max_steps", "Max steps", "int"],
  ["/optim/pack_length", "Pack length (tokens)", "int"],
  ["/checkpoints/every_steps", "Checkpoint every (steps)", "int"],
  ["/checkpoints/select_best_by", "Best checkpoint by", "select"],
  ["/resources/device", "Device", "select"],
  ["/resources/gpus", "GPUs", "int"],
];

let spec = {};
let schema = null;
let meta = { enums: {}, suggestions: {} };
const inputs = new Map(); // pointer -> {input, wrap, err}
const raw = $("#raw");
const rawError = $("#raw-error");
const otherErrors = $("#other-errors");
const result = $("#result");

// ---- JSON pointer helpers ----
const unesc = (s) => s.replace(/~1/g, "/").replace(/~0/g, "~");
const parts = (ptr) => ptr.split("/").slice(1).map(unesc);

function getAt(obj, ptr) {
  let cur = obj;
  for (const p of parts(ptr)) { if (cur == null) return undefined; cur = cur[p]; }
  return cur;
}

function setAt(obj, ptr, value) {
  const ps = parts(ptr);
  let cur = obj;
  ps.slice(0, -1).forEach((p, i) => {
    if (cur[p] == null || typeof cur[p] !== "object") cur[p] = /^\d+$/.test(ps[i + 1]) ? [] : {};
    cur = cur[p];
  });
  const last = ps[ps.length - 1];
  if (value === undefined) { if (Array.isArray(cur)) cur[last] = undefined; else delete cur[last]; } else cur[last] = value;
}

/** The JSON-schema node of a spec pointer (follows $ref, anyOf) for descriptions and bounds. */
function schemaAt(ptr) {
  if (!schema) return null;
  const resolve = (n) => {
    while (n && n.$ref) n = schema.$defs?.[n.$ref.split("/").pop()] || null;
    if (n && n.anyOf) n = n.anyOf.map(resolve).find((x) => x && x.type !== "null") || n;
    return n;
  };
  let node = resolve(schema);
  for (const p of parts(ptr)) {
    if (!node) return null;
    node = /^\d+$/.test(p) ? resolve(node.items) : (node.properties ? resolve(node.properties[p]) : null);
  }
  return node;
}

// ---- form ----
function buildForm() {
  const groups = new Map();
  for (const [ptr, labelText, kind] of FIELDS) {
    const section = parts(ptr)[0];
    const group = ["name", "tags"].includes(section) ? "job" : section;
    if (!groups.has(group)) groups.set(group, []);
    const id = "f" + ptr.replace(/[^a-z0-9]/gi, "_");
    const node = schemaAt(ptr) || {};
    const key = ptr.replace(/\/\d+(?=\/|$)/g, "/*"); // meta keys name array items `*`
    const opts = kind === "select" ? meta.enums[key] || node.enum || [] : meta.suggestions[key] || null;
    const desc = node.description || "";
    let input;
    if (kind === "select") {
      input = h("select", { id }, opts.map((o) => h("option", { value: o }, o)));
    } else {
      input = h("input", {
        id, type: kind === "int" || kind === "float" ? "number" : "text",
        step: kind === "float" ? "any" : kind === "int" ? "1" : null,
        min: node.minimum ?? node.exclusiveMinimum ?? null, max: node.maximum ?? null,
        list: opts ? id + "-list" : null, placeholder: node.default != null ? `default ${node.default}` : null,
      });
    }
    input.dataset.pointer = ptr;
    input.title = desc;
    const err = h("div", { class: "field-error", id: id + "-err", role: "alert" });
    input.setAttribute("aria-describedby", err.id);
    const wrap = h("div", { class: "field", dataset: { pointer: ptr } },
      h("label", { for: id, title: desc }, labelText), input,
      opts && kind !== "select" ? h("datalist", { id: id + "-list" }, opts.map((o) => h("option", { value: o }))) : null,
      err);
    input.addEventListener("input", () => onFieldInput(ptr, kind, input));
    inputs.set(ptr, { input, wrap, err, kind });
    groups.get(group).push(wrap);
  }
  const titles = { job: "Job", target: "Target", data: "Data", draft: "Draft", peagle: "P-EAGLE", optim: "Optimisation", checkpoints: "Checkpoints", resources: "Resources" };
  $("#fields").replaceChildren(...[...groups].map(([g, wraps]) =>
    h("fieldset", {}, h("legend", {}, titles[g] || g), h("div", { class: "form-grid" }, wraps))));
}

function onFieldInput(ptr, kind, input) {
  let v = input.value;
  if (kind === "int" || kind === "float") v = v === "" ? undefined : Number(v);
  else if (kind === "tags") v = v.split(",").map((s) => s.trim()).filter(Boolean);
  else if (kind === "text" && v === "" && ptr !== "/target/model" && !ptr.endsWith("/path")) v = undefined;
  setAt(spec, ptr, v);
  clearError(ptr);
  writeRaw();
}

function fillForm() {
  for (const [ptr, { input, kind }] of inputs) {
    const v = getAt(spec, ptr);
    if (document.activeElement === input) continue;
    input.value = v == null ? "" : kind === "tags" ? v.join(", ") : String(v);
  }
}

function writeRaw() {
  if (document.activeElement !== raw) raw.value = JSON.stringify(spec, null, 2);
  rawError.textContent = "";
  raw.classList.remove("has-error");
}

raw.addEventListener("input", () => {
  try {
    const parsed = JSON.parse(raw.value);
    if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) throw new Error("the spec must be a JSON object");
    spec = parsed;
    rawError.textContent = "";
    raw.classList.remove("has-error");
    fillForm();
  } catch (e) {
    rawError.textContent = `Not valid JSON: ${e.message}`;
    raw.classList.add("has-error");
  }
});

// ---- errors at the offending field ----
function clearError(ptr) {
  const f = inputs.get(ptr);
  if (!f) return;
  f.err.textContent = "";
  f.wrap.classList.remove("has-error");
  f.input.removeAttribute("aria-invalid");
}

function clearErrors() {
  for (const ptr of inputs.keys()) clearError(ptr);
  otherErrors.replaceChildren();
  raw.classList.remove("has-error");
}

/** Show every 422 problem at its field (JSON pointer); problems without a form field go under the editor. */
function showProblems(err) {
  clearErrors();
  const details = Array.isArray(err.details) && err.details.length ? err.details : [{ param: err.param, message: err.message }];
  const rest = [];
  let first = null;
  for (const d of details) {
    const ptr = String(d.param || "").replace(/^\/spec(?=\/|$)/, "");
    const f = inputs.get(ptr);
    if (f) {
      f.err.textContent = f.err.textContent ? `${f.err.textContent}; ${d.message}` : d.message;
      f.wrap.classList.add("has-error");
      f.input.setAttribute("aria-invalid", "true");
      first ??= f.input;
    } else rest.push({ ptr, message: d.message });
  }
  if (rest.length) {
    raw.classList.add("has-error");
    otherErrors.replaceChildren(h("div", { class: "error-box", role: "alert" },
      h("b", {}, "Problems in the spec:"),
      h("ul", {}, rest.map((r) => h("li", {}, h("code", {}, r.ptr || "(root)"), ": ", r.message)))));
  }
  (first || raw).focus();
  result.replaceChildren(h("div", { class: "error-box", role: "alert" },
    `${details.length} problem${details.length === 1 ? "" : "s"} in the job spec: fix the highlighted fields.`));
}

// ---- presets ----
const presetSpecs = new Map();

function loadPreset(name) {
  const p = presetSpecs.get(name);
  if (!p) { showError(result, { code: "unknown_preset", message: `no preset called ${name}` }); return; }
  spec = structuredClone(p);
  clearErrors();
  result.replaceChildren();
  fillForm();
  raw.value = JSON.stringify(spec, null, 2);
  document.querySelectorAll("#presets button").forEach((b) => b.setAttribute("aria-pressed", String(b.dataset.preset === name)));
}

async function buildPresets() {
  try {
    const r = await api("/v1/presets");
    for (const p of r.data || []) presetSpecs.set(p.name, p.spec);
  } catch (e) {
    showError(result, e);
  }
  $("#presets").replaceChildren(...[...presetSpecs].map(([n, sp]) =>
    h("button", { type: "button", dataset: { preset: n }, title: sp.name || `Load the ${n} preset`, "aria-pressed": "false", onclick: () => loadPreset(n) }, n)));
}

// ---- dry run and submit ----
const int = (v) => Number(v).toLocaleString("en-US");
const ESTIMATE_LABELS = {
  rows: ["conversations", int],
  tokens: ["training tokens (after templating)", int],
  optimizer_steps: ["optimizer steps", int],
  tokens_per_step: ["tokens per step", int],
  hidden_state_bytes: ["hidden-state disk (offline capture)", fmtBytes],
  wall_clock_seconds: ["wall-clock estimate", fmtDuration],
  first_curve_s: ["first training curve after", fmtDuration],
  queue: ["queue", String],
  queue_position: ["jobs ahead in the queue", String],
};

/** A placeholder filled with the funnel view (funnel.js) once the reason sentences are loaded. */
function funnelSlot(f) {
  const slot = h("div", { class: "funnel-slot" });
  funnelView(f).then((v) => { if (v) slot.replaceChildren(v); });
  return slot;
}

function estimateView(est) {
  const rows = Object.entries(ESTIMATE_LABELS).filter(([k]) => est[k] !== undefined && est[k] !== null)
    .flatMap(([k, [name, fmt]]) => [h("dt", {}, name), h("dd", {}, fmt(est[k]))]);
  const phases = Object.entries(est.phase_seconds || {}).filter(([, s]) => s > 0)
    .map(([ph, s]) => h("li", { dataset: { phase: ph } }, `${ph.replace(/_/g, " ")}: ${fmtDuration(s)}`));
  return h("div", { class: "notice ok estimate" }, h("b", {}, "Valid. Dry-run estimate (nothing queued):"),
    h("dl", { class: "kv", style: { marginTop: "8px" } }, rows),
    est.wall_clock_range_seconds ? h("div", { class: "sub", dataset: { accuracy: est.basis } },
      `range ${fmtDuration(est.wall_clock_range_seconds[0])} – ${fmtDuration(est.wall_clock_range_seconds[1])}; ${est.accuracy}`) : null,
    phases.length ? h("ul", { class: "estimate-phases" }, phases) : null,
    funnelSlot(est.funnel),
    (est.notes || []).length ? h("ul", { class: "sub" }, est.notes.map((n) => h("li", {}, n))) : null);
}

async function send(dryRun) {
  if (raw.classList.contains("has-error") && rawError.textContent) { raw.focus(); return; }
  clearErrors();
  result.replaceChildren(h("div", { class: "sub" }, dryRun ? "Validating…" : "Submitting…"));
  try {
    const res = await api("/v1/jobs", {
      method: "POST", body: { spec }, query: dryRun ? { dry_run: "true" } : {},
      headers: dryRun ? {} : { "Idempotency-Key": crypto.randomUUID() },
    });
    if (dryRun && res.valid === false) { showProblems({ message: "not runnable", details: res.problems }); return; }
    if (dryRun) { result.replaceChildren(estimateView(res)); return; }
    toast(`Submitted ${res.id}`);
    location.assign(`/job.html?id=${encodeURIComponent(res.id)}`);
  } catch (e) {
    if (e.status === 422) showProblems(e);
    else showError(result, e);
  }
}
$("#estimate-btn").addEventListener("click", () => send(true));
$("#submit-btn").addEventListener("click", () => send(false));
$("#form").addEventListener("submit", (ev) => { ev.preventDefault(); send(true); });

// ---- dataset upload ----
function reportView(ds) {
  const r = ds.report || {};
  const bad = r.bad_rows || r.errors || [];
  const items = Object.entries(r).filter(([k, v]) => v !== null && typeof v !== "object" && !["format", "ok", "path"].includes(k));
  // only a `ready` dataset can train (the API refuses the others before queueing): say why not
  const why = ds.status === "ready" ? null : ds.status === "validating"
    ? "Still being validated: usable once its status is ready."
    : `Not usable for training: ${r.error || `the dataset is ${ds.status}`}`;
  const use = h("button", { type: "button", class: "small", disabled: why ? true : null, title: why,
    "aria-describedby": why ? `why-${ds.id}` : null, onclick: () => {
      setAt(spec, "/data/sources/0/path", `dataset:${ds.id}`);
      fillForm(); writeRaw(); toast("Training data set to the uploaded dataset");
    } }, "Use for training");
  return h("div", { class: r.ok === false || why ? "error-box" : "notice ok" },
    h("div", { class: "toolbar" }, h("b", {}, `${ds.filename} · ${ds.status}`), use),
    why ? h("div", { class: "field-error", id: `why-${ds.id}`, role: "note" }, why) : null,
    h("dl", { class: "kv" },
      h("dt", {}, "id"), h("dd", { class: "mono" }, ds.id),
      h("dt", {}, "format"), h("dd", {}, ds.format),
      h("dt", {}, "size"), h("dd", {}, fmtBytes(ds.size)),
      h("dt", {}, "sha256"), h("dd", { class: "sha" }, ds.sha256),
      items.map(([k, v]) => [h("dt", {}, k.replace(/_/g, " ")), h("dd", {}, typeof v === "number" ? fmtNum(v, 6) : String(v))])),
    funnelSlot(r.funnel),
    bad.length ? h("details", {}, h("summary", {}, `${bad.length} bad row(s)`),
      h("ul", {}, bad.slice(0, 50).map((b) => h("li", {}, typeof b === "object" ? `line ${b.line}: ${b.reason || b.message || b.error}` : String(b))))) : null);
}

$("#upload").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const file = $("#ds-file").files[0];
  const out = $("#ds-report");
  if (!file) { out.replaceChildren(h("div", { class: "field-error" }, "Choose a file first.")); return; }
  const form = new FormData();
  form.append("format", $("#ds-format").value);
  form.append("file", file);
  out.replaceChildren(h("div", { class: "sub" }, `Uploading ${file.name}…`));
  try {
    out.replaceChildren(reportView(await api("/v1/datasets", { method: "POST", form })));
  } catch (e) {
    showError(out, e);
  }
});

// ---- start ----
async function start() {
  try { schema = await api("/v1/spec/schema"); } catch { schema = null; }
  try { meta = await loadMeta(); } catch { /* the form still works without options */ }
  buildForm();
  await buildPresets();
  const from = new URLSearchParams(location.search).get("from");
  if (from) {
    try {
      const job = await api(`/v1/jobs/${encodeURIComponent(from)}`);
      spec = job.spec;
      fillForm();
      raw.value = JSON.stringify(spec, null, 2);
      return;
    } catch (e) { showError(result, e); }
  }
  loadPreset(new URLSearchParams(location.search).get("preset") || "tiny");
}
start();
