// Compare page: 2-4 jobs; overlaid curves, per-depth accuracy and AL side by side, config diff.
import { api, isTerminal, listAll, loadMeta } from "./api.js";
import { LineChart, linesFor, MetricStore, PALETTE, splitPreview } from "./charts.js";
import { define, label, PREVIEW_PREFIX } from "./metrics.js";
import { $, fmtNum, h, mountTopbar, showError, statusChip } from "./ui.js";

mountTopbar("compare");

const OVERLAYS = [
  { key: "loss", title: "Loss" },
  { key: "tau_sim", title: "tau_sim" },
  { key: "acceptance_length", title: "Measured AL" },
  { key: "eval_loss", title: "Eval loss" },
  { key: "lr", title: "Learning rate" },
  { key: "tokens_per_s", title: "Tokens/s" },
];
const ids = (new URLSearchParams(location.search).get("ids") || "").split(",").map((s) => s.trim()).filter(Boolean).slice(0, 4);
const box = $("#compare");
let runs = []; // [{job, store, checkpoints, color}]
const charts = new Map();
let xMode = "step";
let smoothing = 0.6;

// ---------------------------------------------------------------- picker
async function buildPicker() {
  const picker = $("#picker");
  let jobs;
  try { jobs = await listAll("/v1/jobs", {}, 200); } catch (e) { showError(picker, e); return; }
  const chosen = new Set(ids);
  const go = h("button", { type: "button", class: "primary", "aria-label": "Compare the chosen jobs" }, "Compare");
  const update = () => { go.disabled = chosen.size < 2 || chosen.size > 4; };
  go.addEventListener("click", () => location.assign(`/compare.html?ids=${[...chosen].map(encodeURIComponent).join(",")}`));
  picker.replaceChildren(
    jobs.length ? h("div", { class: "form-grid" }, jobs.map((j) => {
      const cb = h("input", { type: "checkbox", checked: chosen.has(j.id), "aria-label": `compare ${j.name || j.id}` });
      cb.addEventListener("change", () => { cb.checked ? chosen.add(j.id) : chosen.delete(j.id); update(); });
      return h("label", { class: "pick", title: j.name || j.id }, cb, statusChip(j.status), h("span", { class: "pick-name" }, j.name || j.id));
    })) : h("div", { class: "empty" }, "No jobs yet."),
    h("div", { class: "toolbar", style: { marginTop: "12px" } }, go, h("span", { class: "sub" }, "2 to 4 jobs")));
  update();
}

// ---------------------------------------------------------------- data
async function loadRun(id, i) {
  const enc = encodeURIComponent(id);
  const [job, metrics, cks] = await Promise.all([
    api(`/v1/jobs/${enc}`),
    api(`/v1/jobs/${enc}/metrics`, { query: { max_points: 1000, limit: 100000 } }),
    api(`/v1/jobs/${enc}/checkpoints`).catch(() => ({ data: [] })),
  ]);
  const store = new MetricStore();
  // the main runs are compared; a preview's points (steps from 1 again) are not theirs
  (metrics.data || []).forEach((p) => { const main = splitPreview(p, PREVIEW_PREFIX)[0]; if (main) store.add(main); });
  return { job, store, checkpoints: cks.data || [], color: PALETTE[i % PALETTE.length] };
}

const nameOf = (r) => r.job.name || r.job.id;

// ---------------------------------------------------------------- views
function renderHeader() {
  return h("div", { class: "panel" }, h("div", { class: "toolbar", style: { marginBottom: 0 } },
    runs.map((r) => h("span", { style: { display: "inline-flex", gap: "6px", alignItems: "center" } },
      h("span", { "aria-hidden": "true", style: { width: "14px", height: "4px", background: r.color, display: "inline-block", borderRadius: "2px" } }),
      h("a", { href: `/job.html?id=${encodeURIComponent(r.job.id)}` }, nameOf(r)), statusChip(r.job.status))),
    h("span", { style: { flex: 1 } }),
    h("label", { title: "Exponential moving average of training curves" }, "Smoothing ",
      h("input", { type: "range", min: 0, max: 0.99, step: 0.01, value: smoothing, "aria-label": "Smoothing",
        oninput: (e) => { smoothing = Number(e.target.value); drawCharts(); } })),
    h("label", {}, "X axis ", h("select", { "aria-label": "X axis", onchange: (e) => { xMode = e.target.value; drawCharts(); } },
      h("option", { value: "step" }, "step"), h("option", { value: "elapsed" }, "elapsed time")))));
}

function renderCharts() {
  return h("div", { class: "charts" }, OVERLAYS.map((o) => {
    const b = h("div", { class: "chart-box" });
    charts.set(o.key, new LineChart(b, { emptyText: "no job has this metric yet" }));
    return h("figure", { class: "chart-card", style: { margin: 0 }, dataset: { chart: o.key } },
      h("h3", { title: define(o.key) }, o.title, h("span", { class: "def" }, define(o.key))), b);
  }));
}

function drawCharts() {
  for (const o of OVERLAYS) {
    const lines = runs.flatMap((r) => linesFor(r.store, [o.key], { xMode, smoothing, color: r.color, dashEval: false })
      .map((l) => ({ ...l, key: `${r.job.id}:${o.key}`, label: nameOf(r), title: define(o.key) })));
    charts.get(o.key).set(lines, xMode);
  }
}

/** Table of latest per-depth accuracy, tau_sim and best measured AL, one column per job, with bars. */
function renderSideBySide() {
  const K = Math.max(0, ...runs.map((r) => r.store.keys().filter((k) => /^acc_\d+$/.test(k)).length));
  const bestAL = (r) => {
    const vals = r.checkpoints.map((c) => c.acceptance_length).filter((v) => typeof v === "number");
    return vals.length ? Math.max(...vals) : r.store.last("acceptance_length");
  };
  const rows = [];
  for (let d = 0; d < K; d++) rows.push({ key: `acc_${d}`, name: `accuracy, ${label(`acc_${d}`)}`, get: (r) => r.store.last(`acc_${d}`), max: 1 });
  rows.push({ key: "tau_sim", name: "tau_sim (latest)", get: (r) => r.store.last("tau_sim") });
  rows.push({ key: "acceptance_length", name: "measured AL (best checkpoint)", get: bestAL });
  rows.push({ key: "loss", name: "loss (latest)", get: (r) => r.store.last("loss") });
  const cell = (v, max, color) => h("td", { class: "num" },
    h("div", { style: { display: "flex", gap: "8px", alignItems: "center", justifyContent: "flex-end" } },
      max && typeof v === "number" ? h("span", { class: "bar", style: { maxWidth: "110px" }, "aria-hidden": "true" }, h("span", { style: { width: `${Math.min(100, (100 * v) / max)}%`, background: color } })) : null,
      h("span", { style: { minWidth: "4.5em" } }, fmtNum(v))));
  return h("section", { class: "panel", "aria-labelledby": "sbs-h" }, h("h2", { id: "sbs-h" }, "Per-depth accuracy and acceptance, side by side"),
    h("div", { class: "table-wrap" }, h("table", { class: "side-by-side" },
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "metric"), runs.map((r) => h("th", { scope: "col", class: "num", style: { color: r.color } }, nameOf(r))))),
      h("tbody", {}, rows.map((row) => {
        const vals = runs.map(row.get);
        const max = row.max || Math.max(...vals.filter((v) => typeof v === "number"), 0) || null;
        return h("tr", {}, h("th", { scope: "row", title: define(row.key) }, row.name), vals.map((v, i) => cell(v, row.key === "loss" ? null : max, runs[i].color)));
      })))));
}

function flatten(obj, prefix = "", out = {}) {
  if (obj && typeof obj === "object" && !Array.isArray(obj)) {
    for (const [k, v] of Object.entries(obj)) flatten(v, prefix ? `${prefix}.${k}` : k, out);
  } else out[prefix] = JSON.stringify(obj);
  return out;
}

/**
 * One row per field of the submitted specs (what the user wrote, defaults filled in). Where the run
 * resolved a field to another value (an "auto", or optim.max_steps capped by the data), the cell says
 * both: `12 (resolved: 9)`.
 */
function renderDiff() {
  const specs = runs.map((r) => flatten(r.job.spec || {}));
  const resolved = runs.map((r) => flatten(r.job.resolved_spec || {}));
  const flats = specs.map((f, i) => Object.fromEntries(Object.entries(f).map(([k, v]) => {
    const got = resolved[i][k];
    return [k, got !== undefined && got !== v ? `${v} (resolved: ${got})` : v];
  })));
  const keys = [...new Set(flats.flatMap(Object.keys))].sort();
  const differs = (k) => new Set(flats.map((f) => f[k])).size > 1;
  const tbody = h("tbody");
  const showAll = h("input", { type: "checkbox", "aria-label": "Show identical fields too" });
  const fill = () => {
    const shown = keys.filter((k) => showAll.checked || differs(k));
    tbody.replaceChildren(...(shown.length ? shown.map((k) => h("tr", {}, h("td", { class: "mono" }, k),
      flats.map((f) => h("td", { class: `val${differs(k) ? " changed" : ""}` }, f[k] ?? "—"))))
      : [h("tr", {}, h("td", { colspan: runs.length + 1, class: "sub" }, "The specs are identical."))]));
  };
  showAll.addEventListener("change", fill);
  fill();
  return h("section", { class: "panel", "aria-labelledby": "diff-h" },
    h("div", { class: "toolbar" }, h("h2", { id: "diff-h", style: { margin: 0 } }, "Config diff"), h("span", { style: { flex: 1 } }),
      h("label", {}, showAll, " show identical fields")),
    h("div", { class: "table-wrap" }, h("table", { class: "diff" },
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "field"), runs.map((r) => h("th", { scope: "col", style: { color: r.color } }, nameOf(r))))),
      tbody)));
}

async function load() {
  let meta;
  try {
    [runs, meta] = await Promise.all([Promise.all(ids.map(loadRun)), loadMeta()]);
  } catch (e) {
    showError(box, e);
    return;
  }
  charts.forEach((c) => c.destroy());
  charts.clear();
  box.replaceChildren(renderHeader(), renderCharts(), h("div", { style: { height: "14px" } }), renderSideBySide(), renderDiff());
  drawCharts();
  box.dataset.ready = "1";
  if (runs.some((r) => !isTerminal(meta, r.job.status))) setTimeout(load, 15000);
}

buildPicker();
if (ids.length >= 2) load();
else {
  $("#picker-box").open = true;
  box.replaceChildren(h("div", { class: "empty" }, "Choose 2 to 4 jobs above (or select them on the jobs page)."));
}
