// Job page, retrain and promotion panel (docs/retrain.md): a succeeded job's Retrain form, the current draft
// of the job's target (force-promote, undo), and the promotion decisions about this job with both sides' numbers.
import { api, ApiError, isTerminal, listAll, loadMeta } from "./api.js";
import { $, confirmDialog, fmtTime, h, showError, toast } from "./ui.js";

const jobId = new URLSearchParams(location.search).get("id");
const root = $("#retrain");

const fx = (v) => (typeof v === "number" ? `${v.toFixed(2)}x` : "–");
const al = (v) => (typeof v === "number" ? v.toFixed(2) : "–");

function retrainForm(job, datasets) {
  const ds = h("select", { id: "retrain-datasets", multiple: true, "aria-label": "Uploaded datasets to retrain on", size: Math.min(5, Math.max(2, datasets.length)) },
    datasets.map((d) => h("option", { value: d.id }, `${d.filename || d.id} (${d.id})`)));
  const sources = h("input", { id: "retrain-sources", type: "text", placeholder: "builtin:sharegpt", "aria-label": "Other data sources (comma separated)" });
  const steps = h("input", { id: "retrain-steps", type: "number", min: "1", placeholder: "as the parent", "aria-label": "Max steps" });
  const sizes = h("input", { id: "retrain-batch-sizes", type: "text", value: "1", "aria-label": "Promotion batch sizes (comma separated)" });
  const out = h("div", { class: "retrain-result", "aria-live": "polite" });
  const go = h("button", { type: "button", class: "primary", "aria-label": "Retrain this job" }, "Retrain");
  go.addEventListener("click", async () => {
    const body = {
      datasets: [...ds.selectedOptions].map((o) => o.value),
      sources: sources.value.split(",").map((s) => s.trim()).filter(Boolean).map((path) => ({ path })),
      promotion_batch_sizes: sizes.value.split(",").map((s) => Number(s.trim())).filter((n) => n > 0),
    };
    if (steps.value) body.overrides = { optim: { max_steps: Number(steps.value) } };
    go.disabled = true;
    try {
      const child = await api(`/v1/jobs/${encodeURIComponent(job.id)}/retrain`, { method: "POST", body });
      toast(`Retrain job ${child.id} queued`);
      out.replaceChildren(h("span", {}, "Child job: ", h("a", { href: `/job.html?id=${encodeURIComponent(child.id)}`, class: "mono" }, child.id)));
    } catch (e) {
      showError(out, e);
    } finally {
      go.disabled = false;
    }
  });
  return h("div", { class: "retrain-form" },
    h("p", { class: "sub" }, "A child job continues from this job's best checkpoint on new data. At its end it is measured beside the current draft in one vLLM comparison and becomes current only if it is faster at every batch size named (and its AL not lower)."),
    h("div", { class: "row", style: { flexWrap: "wrap", gap: "10px", alignItems: "flex-end" } },
      h("label", {}, "Datasets ", ds), h("label", {}, "Sources ", sources), h("label", {}, "Max steps ", steps),
      h("label", {}, "Promote if faster at batch sizes ", sizes), go),
    out);
}

function currentBox(job, current) {
  const target = job.spec.target.model;
  const mine = current && current.job_id === job.id;
  const children = [h("b", {}, "Current draft for "), h("span", { class: "mono" }, target), ": "];
  children.push(current
    ? h("span", { id: "current-draft" }, mine ? "this job" : h("a", { href: `/job.html?id=${encodeURIComponent(current.job_id)}`, class: "mono" }, current.job_id),
      ` (step ${current.checkpoint_step ?? "–"}, since ${fmtTime(current.updated_at)})`)
    : h("span", { id: "current-draft" }, "none yet"));
  const promote = h("button", { type: "button", class: "small", disabled: job.status !== "succeeded" || mine, "aria-label": "Make this job the current draft" }, "Make current");
  promote.addEventListener("click", async () => {
    if (!(await confirmDialog("Make current", `Make this job the current draft for ${target} without measuring it? You can undo it.`, "Make current"))) return;
    await act(() => api("/v1/promotion/promote", { method: "POST", body: { job_id: job.id } }), "This job is now the current draft");
  });
  const undo = h("button", { type: "button", class: "small", disabled: !current, "aria-label": "Undo the last promotion" }, "Undo promotion");
  undo.addEventListener("click", async () => {
    if (!(await confirmDialog("Undo promotion", `The current draft for ${target} goes back to the one before.`, "Undo"))) return;
    await act(() => api("/v1/promotion/undo", { method: "POST", body: { target } }), "Promotion undone");
  });
  return h("div", { class: "row current-draft", style: { flexWrap: "wrap", gap: "8px", alignItems: "center" } }, ...children, promote, undo);
}

function sideRows(d) {
  const n = d.numbers || {};
  const rows = (n.rows || []).map((r) => h("tr", {},
    h("td", {}, `batch ${r.batch_size}`),
    h("td", { class: "num" }, r.child ? `${fx(r.child.speedup)} (K=${r.child.k})` : "–"),
    h("td", { class: "num" }, r.current ? `${fx(r.current.speedup)} (K=${r.current.k})` : "–")));
  const base = n.baseline || "current";
  if (n.child || n[base]) {
    rows.push(h("tr", {}, h("td", {}, "AL"), h("td", { class: "num" }, al(n.child && n.child.acceptance_length)),
      h("td", { class: "num" }, al(n[base] && n[base].acceptance_length))));
  }
  if (!rows.length) return null;
  return h("table", { class: "promotion-numbers" },
    h("thead", {}, h("tr", {}, h("th", {}, ""), h("th", {}, "this draft"), h("th", {}, n.baseline === "parent" ? "parent" : "current draft"))),
    h("tbody", {}, rows));
}

function decisionList(decisions) {
  if (!decisions.length) return h("div", { class: "sub", id: "promotion-decisions" }, "No promotion decision about this job.");
  return h("ul", { id: "promotion-decisions", class: "decisions" }, decisions.map((d) => h("li", { "data-decision": d.decision },
    h("b", {}, d.decision.replace("_", " ")), ` ${fmtTime(d.created_at)} by ${d.decided_by}`,
    d.compared_with ? h("span", {}, " against ", h("a", { href: `/job.html?id=${encodeURIComponent(d.compared_with)}`, class: "mono" }, d.compared_with)) : null,
    h("div", { class: "reason" }, d.reason), sideRows(d))));
}

async function act(fn, message) {
  try {
    await fn();
    toast(message);
  } catch (e) {
    toast(e instanceof ApiError ? `${e.code}: ${e.message}` : String(e));
  }
  await refresh();
}

let job = null;

/** The current draft and the decisions (the form, if any, keeps what the user typed). */
async function refresh() {
  const target = job.spec && job.spec.target && job.spec.target.model;
  const [current, decisions] = await Promise.all([
    api("/v1/promotion/current", { query: { target } }).then((r) => r.data[0] || null),
    api("/v1/promotion/decisions", { query: { job_id: job.id } }).then((r) => r.data),
  ]);
  const pending = job.status === "succeeded" && job.spec.draft && job.spec.draft.init_from
    && !decisions.some((d) => d.job_id === job.id);
  const note = pending ? [h("div", { class: "sub" }, "A retrain child's promotion is measured after it succeeds: the decision appears here.")] : [];
  $("#promotion-state", root).replaceChildren(currentBox(job, current), ...note, decisionList(decisions));
  return pending;
}

async function render() {
  job = await api(`/v1/jobs/${encodeURIComponent(jobId)}`);
  const datasets = job.status === "succeeded"
    ? await listAll("/v1/datasets").then((rows) => rows.filter((d) => d.status === "ready")).catch(() => []) : [];
  root.replaceChildren(
    h("h2", { id: "retrain-h" }, "Retrain and promotion"), h("div", { id: "promotion-state" }),
    job.status === "succeeded" ? retrainForm(job, datasets) : h("p", { class: "sub" }, `Retrain is possible once the job has succeeded (now ${job.status}).`));
  root.hidden = false;
  return refresh();
}

async function loop(first) {
  try {
    const meta = await loadMeta();
    const wasTerminal = job && isTerminal(meta, job.status);
    const pending = first || !wasTerminal ? await render() : await refresh();
    if (!isTerminal(meta, job.status) || pending) setTimeout(() => loop(false), 5000);
  } catch (e) {
    // before the panel was shown, the error (no such job, signed out) is the page header's (job.js): not twice
    if (!root.hidden) showError(root, e);
  }
}

if (root && jobId) loop(true);
