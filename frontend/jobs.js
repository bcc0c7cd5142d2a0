// Jobs page: list with status chips, phase, progress + ETA, tags; filters and search; light polling.
import { api, listAll } from "./api.js";
import { $, fmtAgo, h, mountTopbar, progressBar, showError, statusChip, tagList } from "./ui.js";

mountTopbar("jobs");

const box = $("#jobs");
const q = $("#q");
const statusSel = $("#status");
const tagInput = $("#tag");
const compareBtn = $("#compare-btn");
const refreshState = $("#refresh-state");
const selected = new Set();
const POLL_MS = 3000;
let jobs = null;
let timer = null;

// Filters live in the URL so a filtered view can be shared and survives reloads.
const params = new URLSearchParams(location.search);
q.value = params.get("q") || "";
statusSel.value = params.get("status") || "";
tagInput.value = params.get("tag") || "";

function syncUrl() {
  const p = new URLSearchParams();
  if (q.value) p.set("q", q.value);
  if (statusSel.value) p.set("status", statusSel.value);
  if (tagInput.value.trim()) p.set("tag", tagInput.value.trim());
  history.replaceState(null, "", p.toString() ? `?${p}` : location.pathname);
}

function matches(job, text) {
  if (!text) return true;
  const t = text.toLowerCase();
  return [job.id, job.name || "", ...(job.tags || [])].some((s) => s.toLowerCase().includes(t));
}

function render() {
  if (!jobs) return;
  const visible = jobs.filter((j) => matches(j, q.value.trim()));
  if (!visible.length) {
    const filtered = q.value || statusSel.value || tagInput.value;
    box.replaceChildren(h("div", { class: "empty" }, filtered
      ? "No job matches these filters."
      : h("span", {}, "No jobs yet. ", h("a", { href: "/new.html" }, "Start one from a preset"), ".")));
    return;
  }
  const rows = visible.map((j) => {
    // (headline: the job's latest measured AL, else its best checkpoint's held-out tau_sim)
    const cb = h("input", { type: "checkbox", "aria-label": `select ${j.name || j.id} for comparison`, checked: selected.has(j.id) });
    cb.addEventListener("change", () => { cb.checked ? selected.add(j.id) : selected.delete(j.id); updateCompare(); });
    return h("tr", { dataset: { id: j.id } },
      h("td", { "data-label": "Select" }, cb),
      h("td", { class: "name", "data-label": "Job" }, h("div", {}, h("a", { href: `/job.html?id=${encodeURIComponent(j.id)}` }, j.name || j.id), h("span", { class: "sub" }, j.id))),
      h("td", { "data-label": "Status" }, statusChip(j.status)),
      h("td", { "data-label": "Phase" }, j.phase || "—"),
      h("td", { "data-label": "Progress" }, progressBar(j.progress, j.status)),
      h("td", { class: "headline", "data-label": "AL / best" }, headline(j.progress)),
      h("td", { "data-label": "Tags" }, tagList(j.tags)),
      h("td", { "data-label": "Created", title: j.created_at }, fmtAgo(j.created_at)));
  });
  const table = h("table", { class: "jobs cards" },
    h("thead", {}, h("tr", {}, ["", "Job", "Status", "Phase", "Progress", "AL / best", "Tags", "Created"].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, rows));
  box.replaceChildren(h("div", { class: "panel table-wrap cards-panel" }, table));
}

function updateCompare() {
  const n = selected.size;
  compareBtn.disabled = n < 2 || n > 4;
  compareBtn.textContent = n ? `Compare selected (${n})` : "Compare selected";
  compareBtn.title = n > 4 ? "Pick at most 4 jobs" : n < 2 ? "Pick 2 to 4 jobs" : "";
}

compareBtn.addEventListener("click", () => {
  location.assign(`/compare.html?ids=${[...selected].map(encodeURIComponent).join(",")}`);
});

async function load() {
  clearTimeout(timer);
  try {
    jobs = await listAll("/v1/jobs", { status: statusSel.value, tag: tagInput.value.trim() }, 300);
    refreshState.textContent = `updated ${new Date().toLocaleTimeString()}`;
    render();
  } catch (e) {
    if (e.name === "AbortError") return;
    refreshState.textContent = "";
    if (jobs === null) showError(box, e);
    else refreshState.textContent = `refresh failed: ${e.message}`;
  }
  if (!document.hidden) timer = setTimeout(load, POLL_MS);
}

let debounce;
const reload = () => { syncUrl(); clearTimeout(debounce); debounce = setTimeout(load, 250); };
q.addEventListener("input", () => { syncUrl(); render(); });
statusSel.addEventListener("change", reload);
tagInput.addEventListener("input", reload);
document.addEventListener("visibilitychange", () => { if (!document.hidden) load(); });

box.replaceChildren(h("div", { class: "empty" }, "Loading jobs…"));
updateCompare();
load();

/** The job's headline number from `progress` (the worker folds it in, docs/progress.md): the latest
 * measured acceptance length (by the job's eval engine, and vLLM's when the serve check ran), else the best
 * checkpoint's held-out tau_sim; rounded for people, labelled by its title. */
export function headline(progress) {
  const p = progress || {};
  const al = p.acceptance_length, vllm = p.vllm_acceptance_length, tau = p.best_tau_sim;
  if (typeof al === "number") {
    const text = `AL ${al.toFixed(2)}` + (typeof vllm === "number" ? ` · vLLM ${vllm.toFixed(2)}` : "");
    return h("span", { title: "measured acceptance length (the job's eval engine: reference decoder or vLLM)" + (typeof vllm === "number" ? ", and in the vLLM serve check" : "") }, text);
  }
  if (typeof tau === "number") {
    return h("span", { title: "tau_sim of the best checkpoint on held-out rows (no AL measured yet)" }, `tau_sim ${tau.toFixed(2)}`);
  }
  return h("span", { class: "sub", title: "no evaluation yet" }, "—");
}
