// Job page: header + actions, phase timeline, live charts, logs, events, checkpoints.
import { actionAllowed, api, isTerminal, loadMeta, openStream } from "./api.js";
import { LineChart, linesFor, MetricStore, PALETTE, splitPreview, throttle } from "./charts.js";
import { renderCheckpoints } from "./checkpoints.js";
import { renderJobFunnel } from "./funnel.js";
import { renderJobTasks } from "./tasks.js";
import { CHARTS, previewChart } from "./metrics.js";
import { $, confirmDialog, fmtAgo, fmtDuration, fmtTime, h, mountTopbar, progressBar, showError, statusChip, tagList, toast } from "./ui.js";

mountTopbar("jobs");

const jobId = new URLSearchParams(location.search).get("id");
const META = await loadMeta(); // states, allowed actions and phases: the API's single sources
const PHASES = META.phases;
const MAX_POINTS = 2000;
const TAIL_POINTS = 1000;
let historyLoading = null;
const MAX_LOG_LINES = 2000;
const store = new MetricStore();
// The preview's points (`preview_*` keys, spec `preview`): a series of their own, whose steps start at 1 again.
const PREVIEW_PREFIX = META.metric_keys?.preview_prefix || "preview_";
const previewStore = new MetricStore();
const charts = new Map();
const streams = [];
let job = null;
let events = [];
let ckSig = "";
let xMode = "step";
let smoothing = 0.6;

window.__peagle = { store, previewStore, charts, ready: false, firstRenderMs: null }; // read by the browser tests

/** File one metric point: the main run's keys into `store`, the preview's into `previewStore`. */
function addPoint(p) {
  const [main, pre] = splitPreview(p, PREVIEW_PREFIX);
  const a = main ? store.add(main) : false;
  const b = pre ? previewStore.add(pre) : false;
  return a || b;
}

function previewConversations() {
  const pv = (job && (job.resolved_spec || job.spec) || {}).preview;
  return pv && pv.conversations ? pv.conversations : 0;
}

// ---------------------------------------------------------------- header + actions
const ACTIONS = [
  ["pause", "Pause", "Pause this job? It finishes the current step, saves a checkpoint and frees the worker."],
  ["resume", "Resume", "Resume this job from its last checkpoint?"],
  ["cancel", "Cancel", "Cancel this job? A running trainer is stopped; completed checkpoints are kept."],
  ["clone", "Clone", "Create a new job with the same spec?"],
];

function renderHead() {
  const j = job;
  const buttons = ACTIONS.map(([act, text, question]) => {
    const allowed = actionAllowed(META, act, j.status);
    return h("button", {
      type: "button", class: act === "cancel" ? "danger" : null, disabled: !allowed,
      "aria-label": `${text} job`, title: allowed ? question : `Not possible while ${j.status}`,
      onclick: () => act_(act, text, question),
    }, text);
  });
  buttons.push(h("a", { class: "btn", href: `/new.html?from=${encodeURIComponent(j.id)}`, title: "Open this spec in the editor" }, "Edit as new"));
  const p = j.progress || {};
  const err = j.error && (j.error.code || j.error.message)
    ? h("div", { class: "error-box", role: "alert", style: { marginTop: "10px" } },
      h("b", {}, `${j.error.code || "error"}: `), j.error.message || "", j.error.retryable ? " (retryable)" : "")
    : null;
  $("#head").replaceChildren(
    h("div", { class: "page-head" },
      h("h1", {}, j.name || j.id), statusChip(j.status),
      h("span", { class: "spacer" }), h("div", { class: "actions", role: "group", "aria-label": "Job actions" }, buttons)),
    h("div", { class: "panel" },
      h("div", { class: "grid2", style: { alignItems: "center" } },
        h("div", { class: "job-meta" },
          h("span", {}, "id ", h("b", { class: "mono" }, j.id)),
          h("span", {}, "phase ", h("b", {}, j.phase || "—")),
          h("span", {}, "attempt ", h("b", {}, String(j.attempt ?? 0))),
          h("span", {}, p.phase === "regenerating" ? "regenerated " : "step ",
            h("b", {}, p.total_steps ? `${p.step ?? 0} / ${p.total_steps}` : "—")),
          j.parent ? h("span", { id: "parent" }, "warm start from ", parentLink(j.parent)) : null,
          h("span", { title: fmtTime(j.created_at) }, "created ", h("b", {}, fmtAgo(j.created_at))),
          j.started_at ? h("span", {}, "started ", h("b", {}, fmtTime(j.started_at))) : null,
          j.finished_at ? h("span", {}, "finished ", h("b", {}, fmtTime(j.finished_at))) : null,
          (j.tags || []).length ? h("span", {}, tagList(j.tags)) : null),
        progressBar(j.progress, j.status)),
      err));
  document.title = `${j.name || j.id} · P-EAGLE`;
}

// The source of a warm start (`parent`: draft.init_from): a link to the parent job's page, or the upload's id.
function parentLink(p) {
  if (p.kind === "job") {
    const label = p.step == null ? `${p.id} (best)` : `${p.id} @ step ${p.step}`;
    return h("a", { class: "mono", href: `/job.html?id=${encodeURIComponent(p.id)}`, title: "The parent job" }, label);
  }
  return h("b", { class: "mono", title: "An uploaded draft (GET /v1/drafts/<id>)" }, `draft ${p.id}`);
}

async function act_(act, text, question) {
  if (!(await confirmDialog(`${text} job`, question, text))) return;
  try {
    const res = await api(`/v1/jobs/${encodeURIComponent(jobId)}/${act}`, { method: "POST", body: {} });
    if (act === "clone") { location.assign(`/job.html?id=${encodeURIComponent(res.id)}`); return; }
    job = res && res.id === jobId ? res : await api(`/v1/jobs/${encodeURIComponent(jobId)}`);
    toast(`${text}: job is ${job.status}`);
    renderHead();
    renderTimeline();
  } catch (e) {
    toast(e.message);
  }
}

// ---------------------------------------------------------------- timeline
function renderTimeline() {
  const firstSeen = {};
  for (const e of events) if (e.kind === "phase" && e.phase && !(e.phase in firstSeen)) firstSeen[e.phase] = e.time;
  // A failure sits under the phase its error was reported in (the job row may have moved on since).
  const errAt = job.status === "failed" ? [...events].reverse().find((e) => e.kind === "error" && PHASES.includes(e.phase)) : null;
  const cur = job.status === "succeeded" ? "done" : errAt ? errAt.phase : job.phase;
  const curIdx = PHASES.indexOf(cur);
  // A phase the pipeline passed over (e.g. the vLLM serve check when the spec did not ask for it) has no
  // event of its own while a later phase has one: it is shown as skipped, not as done.
  const lastSeenIdx = Math.max(-1, ...PHASES.map((ph, i) => (ph in firstSeen ? i : -1)));
  $("#timeline").replaceChildren(...PHASES.map((ph, i) => {
    let cls = "";
    if (job.status === "succeeded" || (curIdx >= 0 && i < curIdx)) cls = "done";
    else if (i === curIdx) cls = job.status === "failed" ? "failed" : isTerminal(META, job.status) ? "" : "current";
    const skipped = cls === "done" && ph !== "done" && !(ph in firstSeen) && i < lastSeenIdx;
    if (skipped) cls = "skipped";
    const when = skipped ? "skipped" : firstSeen[ph] ? fmtTime(firstSeen[ph]) : "\u00a0";
    return h("li", { class: cls, "aria-current": cls === "current" ? "step" : null,
                     title: skipped ? "not part of this job (see the job spec)" : null },
      ph.replace(/_/g, " "), h("span", { class: "t" }, when));
  }));
  // On a narrow window the timeline scrolls sideways: keep the current phase in view.
  const tl = $("#timeline");
  const cur_ = tl.querySelector(".current, .failed") || (job.status === "succeeded" ? tl.lastElementChild : null);
  if (cur_ && tl.scrollWidth > tl.clientWidth) tl.scrollLeft = cur_.offsetLeft - tl.clientWidth / 2 + cur_.offsetWidth / 2;
}

// ---------------------------------------------------------------- charts
// A job with a preview (spec `preview`) has its chart first; a job without one has none.
function chartList() {
  return previewConversations() ? [previewChart(previewConversations(), PREVIEW_PREFIX), ...CHARTS] : CHARTS;
}

function buildCharts() {
  $("#charts").replaceChildren(...chartList().map((c) => {
    const box = h("div", { class: "chart-box" });
    const card = h("figure", { class: "chart-card", style: { margin: 0 }, dataset: { chart: c.id }, "aria-label": `${c.title} chart` },
      h("h3", { title: c.def }, c.title, h("span", { class: "def" }, c.def)), box);
    charts.set(c.id, new LineChart(box, { emptyText: "no points yet" }));
    if (c.id === "preview") card.hidden = true; // shown with its first point
    return card;
  }));
}

function drawCharts() {
  const all = store.keys();
  // A job that has ended draws only the charts it has points for; none at all = one line saying why.
  const ended = !!job && isTerminal(META, job.status);
  let drawn = 0;
  for (const c of chartList()) {
    const src = c.id === "preview" ? previewStore : store;
    const keys = typeof c.keys === "function" ? c.keys(all) : c.keys;
    const color = c.id === "acc" ? (k, i) => PALETTE[i % PALETTE.length] : undefined;
    const lines = linesFor(src, keys, { xMode, smoothing, color });
    charts.get(c.id).set(lines, xMode);
    const has = lines.some((l) => l.y.some((v) => v !== null));
    if (has) drawn++;
    const card = document.querySelector(`#charts [data-chart="${c.id}"]`);
    card.hidden = c.id === "preview" ? !has : ended && !has;
    if (c.id === "preview") card.querySelector("h3").firstChild.textContent = c.title; // N once the job is read
  }
  const note = $("#charts-none");
  note.hidden = !(ended && drawn === 0);
  note.textContent = `No metrics: the job ${job?.status || "ended"} before its first training step` +
    (job?.phase ? ` (in phase ${job.phase.replace(/_/g, " ")}).` : ".");
  const rendered = document.querySelectorAll("#charts .uplot").length;
  $("#charts").dataset.points = String(store.length);
  $("#charts").dataset.previewPoints = String(previewStore.length);
  $("#charts").dataset.rendered = String(rendered);
}
const redraw = throttle(drawCharts, 250);

$("#smoothing").addEventListener("input", (e) => {
  smoothing = Number(e.target.value);
  $("#smoothing-val").textContent = smoothing.toFixed(2);
  redraw();
});
document.querySelectorAll('input[name="xaxis"]').forEach((r) => r.addEventListener("change", () => { xMode = r.value; drawCharts(); }));

/**
 * Metrics in two steps so the page draws fast on long runs: first the newest TAIL_POINTS records at
 * full resolution (an indexed range read), then the whole history downsampled by the server, merged
 * in front of what is already drawn (live points keep arriving meanwhile). Returns the last seq read.
 */
async function loadMetrics() {
  const url = `/v1/jobs/${encodeURIComponent(jobId)}/metrics`;
  const from = Math.max(0, (job.metric_seq || 0) - TAIL_POINTS);
  const res = await api(url, { query: { after: from, limit: TAIL_POINTS + 100 } });
  for (const p of res.data || []) addPoint(p);
  if (from > 0) {
    historyLoading = api(url, { query: { max_points: MAX_POINTS, limit: 100000, step_to: store.step[0] } })
      .then((full) => {
        store.prepend((full.data || []).map((p) => splitPreview(p, PREVIEW_PREFIX)[0]).filter(Boolean));
        drawCharts();
        window.__peagle.historyAt = performance.now();
      })
      .catch((e) => toast(`metric history: ${e.message}`));
    // the preview's few points come before the tail: read them whole (the thinned history could drop them)
    const pv = (job.resolved_spec || job.spec || {}).preview;
    if (pv && pv.conversations) {
      const keys = previewChart(pv.conversations, PREVIEW_PREFIX).keys.join(",");
      api(url, { query: { keys, step_to: (pv.steps || 1000) + 1, limit: 100000 } })
        .then((r) => { previewStore.prepend((r.data || []).map((p) => splitPreview(p, PREVIEW_PREFIX)[1]).filter(Boolean)); drawCharts(); })
        .catch((e) => toast(`preview metrics: ${e.message}`));
    }
  }
  return Number(res.next_after) || (job.metric_seq || 0);
}

// ---------------------------------------------------------------- logs and events
const LEVELS = { debug: 0, info: 1, warning: 2, error: 3 };
const logs = [];

function logLine(l) {
  const t = new Date(typeof l.time === "number" ? l.time * 1000 : l.time);
  return h("div", { class: `lv-${l.level}`, dataset: { level: l.level } },
    h("span", { class: "ts" }, `${isNaN(t) ? "" : t.toLocaleTimeString()} `), `${(l.level || "").toUpperCase().padEnd(7)} ${l.message}`);
}

function passes(l) {
  return (LEVELS[l.level] ?? 1) >= (LEVELS[$("#log-level").value] ?? 1);
}

/** Full re-render (level change); live lines are appended by flushLogs. */
function renderLogs() {
  const el = $("#logs");
  const shown = logs.filter(passes);
  pendingLogs.length = 0;
  el.replaceChildren(...(shown.length ? shown.map(logLine) : [h("span", { class: "ts placeholder" }, "no log lines at this level yet")]));
  if ($("#follow").checked) el.scrollTop = el.scrollHeight;
}

function flushLogs() {
  const el = $("#logs");
  const fresh = pendingLogs.splice(0).filter(passes);
  if (!fresh.length) return;
  el.querySelector(".placeholder")?.remove();
  el.append(...fresh.map(logLine));
  while (el.childElementCount > MAX_LOG_LINES) el.firstElementChild.remove();
  if ($("#follow").checked) el.scrollTop = el.scrollHeight;
}
const pendingLogs = [];
const redrawLogs = throttle(flushLogs, 300);
$("#log-level").addEventListener("change", renderLogs);
$("#follow").addEventListener("change", () => { if ($("#follow").checked) $("#logs").scrollTop = $("#logs").scrollHeight; });
$("#logs").addEventListener("wheel", () => {
  const el = $("#logs");
  if (el.scrollTop + el.clientHeight < el.scrollHeight - 30) $("#follow").checked = false;
});

function addLog(l) {
  logs.push(l);
  pendingLogs.push(l);
  if (logs.length > MAX_LOG_LINES) logs.splice(0, logs.length - MAX_LOG_LINES);
  redrawLogs();
}

function describeEvent(e) {
  const d = e.data || {};
  if (e.message) return e.message;
  if (e.kind === "phase") return `phase ${e.phase}`;
  if (e.kind === "checkpoint") return `checkpoint at step ${d.step}${d.is_best ? " (best)" : ""}`;
  if (e.kind === "eval") return `eval: ${Object.entries(d.metrics || {}).filter(([, v]) => typeof v === "number").map(([k, v]) => `${k}=${+v.toFixed(4)}`).join(" ")}`;
  if (e.kind === "progress" && d.phase === "regenerating") return `regenerated ${d.step}/${d.total_steps} conversations`;
  if (e.kind === "progress") return `step ${d.step}/${d.total_steps}`;
  return JSON.stringify(d).slice(0, 160);
}

function renderEvents() {
  const shown = events.filter((e) => e.kind !== "progress").slice(-300).reverse();
  $("#events").replaceChildren(shown.length
    ? h("table", {}, h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "time"), h("th", { scope: "col" }, "kind"), h("th", { scope: "col" }, "what"))),
      h("tbody", {}, shown.map((e) => h("tr", {}, h("td", { class: "sub" }, fmtTime(e.time)), h("td", {}, e.kind), h("td", {}, describeEvent(e))))))
    : h("div", { class: "empty" }, "No events yet."));
  renderJobFunnel(events);
}
const redrawEvents = throttle(() => { renderEvents(); renderTimeline(); }, 300);

function onEvent(e) {
  if (events.length && e.seq != null && e.seq <= events[events.length - 1].seq) return;
  events.push(e);
  if (e.kind === "phase" && e.phase && job) job.phase = e.phase;
  // A checkpoint, or the final AL measured on one (eval naming checkpoint_step), changes the table.
  if (e.kind === "checkpoint" || (e.kind === "eval" && e.data && e.data.checkpoint_step != null)) refreshCheckpoints();
  if (["progress", "state", "status", "phase"].includes(e.kind)) refreshJobSoon();
  redrawEvents();
}

// ---------------------------------------------------------------- checkpoints
let ckRequest = 0; // only the newest request may render: an older, slower response must not overwrite it
async function refreshCheckpoints() {
  const mine = ++ckRequest;
  try {
    const res = await api(`/v1/jobs/${encodeURIComponent(jobId)}/checkpoints`);
    if (mine !== ckRequest) return;
    const cks = res.data || res;
    const sig = JSON.stringify(cks.map((c) => [c.step, c.is_best, c.is_latest, c.complete, c.tau_sim, c.acceptance_length, c.metrics?.vllm_acceptance_length, c.metrics?.eval_loss, c.evaluation]));
    if (sig === ckSig) return;
    ckSig = sig;
    renderCheckpoints($("#checkpoints"), job, cks);
  } catch (e) {
    if (mine === ckRequest) showError($("#checkpoints"), e);
  }
}

// ---------------------------------------------------------------- job polling and streams
let jobTimer = null;
async function refreshJob() {
  clearTimeout(jobTimer);
  try {
    const prev = job;
    job = await api(`/v1/jobs/${encodeURIComponent(jobId)}`);
    renderHead();
    renderTimeline();
    renderJobTasks(job);
    if (!prev || prev.latest_checkpoint_step !== job.latest_checkpoint_step || prev.best_checkpoint_step !== job.best_checkpoint_step) refreshCheckpoints();
    $("#spec").textContent = JSON.stringify({ resolved_spec: job.resolved_spec || null, spec: job.spec, provenance: job.provenance || null }, null, 2);
    if (isTerminal(META, job.status) && !(prev && isTerminal(META, prev.status)) && window.__peagle.ready) drawCharts();
  } catch (e) {
    if (!job) throw e;
  }
  if (!isTerminal(META, job.status)) jobTimer = setTimeout(refreshJob, document.hidden ? 15000 : 3000);
}
const refreshJobSoon = throttle(refreshJob, 1000);

function setLive(s) {
  $("#live-state").textContent = s === "live" ? "● live" : s === "ended" ? "job finished" : s === "reconnecting" ? "reconnecting…" : "";
}

async function start() {
  if (!jobId) { showError($("#head"), { code: "bad_request", message: "no job id in the address (?id=job_…)" }); return; }
  const t0 = performance.now();
  try {
    await refreshJob();
    buildCharts(); // after the job: the preview chart names its conversations
    const lastSeq = await loadMetrics();
    drawCharts();
    window.__peagle.firstRenderMs = performance.now() - t0; // from script start
    window.__peagle.readyAt = performance.now(); // from navigation start
    window.__peagle.ready = true;
    const base = `/v1/jobs/${encodeURIComponent(jobId)}`;
    // Events: the first 100 (phase changes happen early) and the newest 500.
    const evTail = Math.max(100, (job.event_seq || 0) - 500);
    const [evHead, evLast, lg] = await Promise.all([
      api(`${base}/events`, { query: { limit: 100 } }).catch(() => ({ data: [] })),
      api(`${base}/events`, { query: { after: evTail, limit: 500 } }).catch(() => ({ data: [] })),
      api(`${base}/logs`, { query: { tail: 500 } }).catch(() => ({ data: [] })),
    ]);
    events = [...evHead.data, ...evLast.data.filter((e) => e.seq > 100)];
    (lg.data || lg).forEach((l) => logs.push(l));
    renderEvents();
    renderTimeline();
    renderLogs();
    // The events just loaded are not replayed by the stream: a checkpoint or final-AL event among them
    // may be newer than the checkpoints table drawn by refreshJob above.
    refreshCheckpoints();
    const lastEv = events.length ? events[events.length - 1].seq : 0;
    const lastLog = logs.length ? logs[logs.length - 1].seq : 0;
    streams.push(openStream(`${base}/metrics/stream`, { query: { after: lastSeq }, onItem: (p) => { if (addPoint(p)) redraw(); }, onState: setLive }));
    streams.push(openStream(`${base}/events/stream`, { query: { after: lastEv }, onItem: onEvent, onEnd: () => refreshJob() }));
    streams.push(openStream(`${base}/logs/stream`, { query: { after: lastLog }, onItem: (l) => { if (!logs.length || l.seq > logs[logs.length - 1].seq) addLog(l); } }));
  } catch (e) {
    showError($("#head"), e);
  }
}
window.addEventListener("pagehide", () => streams.forEach((s) => s.close()));
window.__peagle.fmtDuration = fmtDuration;
start();
