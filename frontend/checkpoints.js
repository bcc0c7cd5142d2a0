// Checkpoints table of the job page: best/latest badges, metrics, the measured serving speedup, files with
// sha256 and downloads, the deterministic archive, and a copy button for the exact `vllm serve` command
// (the long form with the K recommended by the measurement); below it, the evaluated checkpoint's AL per
// prompt set and its speedup per K and batch size.
import { api } from "./api.js";
import { define } from "./metrics.js";
import { copyText, fmtBytes, fmtNum, fmtTime, h } from "./ui.js";

const serveCache = new Map();

async function serveCommand(ck) {
  if (!serveCache.has(ck.serve_url)) serveCache.set(ck.serve_url, api(ck.serve_url));
  return serveCache.get(ck.serve_url);
}

// Both commands run where the draft was downloaded: beside the unpacked archive (`ck.folder`, also what
// `peagle jobs download` writes by default); the long form names the verifier and K explicitly.
function commandLine(cls, label, copyLabel) {
  const pre = h("pre", { class: "mono", "aria-label": label }, "…");
  const btn = h("button", { type: "button", class: "small", "aria-label": copyLabel, disabled: true }, "Copy");
  return { pre, btn, box: h("div", { class: cls }, pre, btn) };
}

function commandCell(ck) {
  const short = commandLine("cmd", `vllm serve command for step ${ck.step}`, `Copy the vllm serve command of step ${ck.step}`);
  const long = commandLine("cmd-long", `Long form of the vllm serve command for step ${ck.step}`, `Copy the long vllm serve command of step ${ck.step}`);
  const fill = (line, text) => {
    line.pre.textContent = text;
    line.btn.disabled = false;
    line.btn.addEventListener("click", () => copyText(text));
  };
  const note = h("div", { class: "hint note", hidden: true });
  serveCommand(ck).then((s) => {
    fill(short, s.command);
    fill(long, s.long_command);
    const notes = [s.speedup_note, s.note].filter(Boolean);
    if (notes.length) { note.textContent = notes.join(" "); note.hidden = false; }
  }).catch((e) => { serveCache.delete(ck.serve_url); short.pre.textContent = `unavailable: ${e.message}`; });
  return h("div", { class: "serve" },
    h("div", { class: "hint" }, "After ", h("code", {}, `tar xf ${ck.folder}.tar`), " (or ",
      h("code", {}, "peagle jobs download"), "):"),
    short.box,
    h("div", { class: "hint" }, "Long form (explicit verifier and K):"),
    long.box, note);
}

function filesCell(ck) {
  const total = ck.files.reduce((s, f) => s + (f.size || 0), 0);
  return h("details", {},
    h("summary", {}, `${ck.files.length} files · ${fmtBytes(total)}`),
    h("table", {}, h("tbody", {}, ck.files.map((f) => h("tr", {},
      h("td", {}, h("a", { href: f.url, download: f.path.split("/").pop(), "aria-label": `Download ${f.path} of step ${ck.step}` }, f.path)),
      h("td", { class: "num" }, fmtBytes(f.size)),
      h("td", { class: "sha", title: "sha256 of the file" }, f.sha256))))));
}

// ---------------------------------------------------------------- measured serving speedup (issue 18)
// The wording of a speedup comes from the trainer (`speedup_text`: "1.07x faster", "0.45x (2.22x slower)"),
// so the page, the CLI and the serve note say the same thing; below 1 is a slowdown and styled as one.
function speedupSpan(row, prefix = "") {
  if (!row || typeof row.speedup !== "number") return null;
  const text = row.speedup_text || `${row.speedup.toFixed(2)}x`;
  return h("span", { class: row.speedup < 1 ? "speedup slower" : "speedup faster",
    title: `${fmtNum(row.base_tokens_per_s, 3)} tokens/s alone -> ${fmtNum(row.spec_tokens_per_s, 3)} tokens/s with the draft (median of ${row.rounds} interleaved rounds), AL ${fmtNum(row.acceptance_length, 3)}` },
  `${prefix}${text}`);
}

function hardwareText(hw) {
  if (!hw) return "unknown hardware";
  const where = hw.gpu ? `${hw.gpu}${hw.gpu_count > 1 ? ` x${hw.gpu_count}` : ""}` : `${hw.cpu || "CPU"} (${hw.cpu_count} CPUs)`;
  const load = Array.isArray(hw.load_average) ? `, load average ${hw.load_average[0]} at the start` : "";
  return `${hw.device} ${where}${load}`;
}

function speedupCell(ck) {
  const s = ck.evaluation && ck.evaluation.serving;
  if (!s) return h("span", { class: "hint", title: "Measured after training when vLLM evaluates (eval.speedup)" }, "—");
  const lines = [];
  if (s.batch_1) lines.push(h("div", {}, speedupSpan(s.batch_1, "batch 1: ")));
  if (s.batch_n) lines.push(h("div", {}, speedupSpan(s.batch_n, `batch ${s.batch_n.batch_size}: `)));
  return h("div", { title: `K=${s.num_speculative_tokens} in vLLM ${s.vllm_version || ""} on ${hardwareText(s.hardware)}: the number only holds there` }, lines);
}

function spreadText(sp) {
  if (!sp) return "—";
  return `median ${fmtNum(sp.median, 3)} (p25–p75 ${fmtNum(sp.p25, 3)}–${fmtNum(sp.p75, 3)}, min–max ${fmtNum(sp.min, 3)}–${fmtNum(sp.max, 3)})`;
}

/** Evaluation of one checkpoint: AL per prompt set with the per-request spread, the speedup table (K x batch
 * size), the recommended K per batch size, and the hardware it was measured on. */
function evaluationPanel(ck) {
  const ev = ck.evaluation;
  const parts = [h("h3", {}, `Evaluation of step ${ck.step} (${ev.engine === "vllm" ? "vLLM" : "reference decoder"})`)];
  const sets = Object.entries(ev.prompt_sets || {});
  if (sets.length) {
    parts.push(h("table", { class: "eval-sets", "aria-label": `AL per prompt set of step ${ck.step}` },
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "prompt set"),
        h("th", { scope: "col", class: "num", title: "1 + accepted / drafts, pooled over the prompts (vLLM's definition)" }, "AL"),
        h("th", { scope: "col", title: "AL of each prompt on its own: how unequal they are (their mean is not the AL)" }, "per-prompt AL"),
        h("th", { scope: "col", class: "num" }, "prompts"))),
      h("tbody", {}, sets.map(([name, r]) => h("tr", {},
        h("td", {}, name), h("td", { class: "num" }, r.acceptance_length == null ? "no drafts" : fmtNum(r.acceptance_length, 3)),
        h("td", {}, spreadText(r.per_request_spread)), h("td", { class: "num" }, fmtNum(r.num_prompts)))))));
  }
  const s = ev.serving;
  if (s && (s.table || []).length) {
    const sizes = [...new Set(s.table.map((r) => r.batch_size))].sort((a, b) => a - b);
    const ks = [...new Set(s.table.map((r) => r.num_speculative_tokens))].sort((a, b) => a - b);
    const cell = (k, b) => s.table.find((r) => r.num_speculative_tokens === k && r.batch_size === b);
    const rec = new Map((s.recommended || []).map((r) => [r.batch_size, r.num_speculative_tokens]));
    parts.push(h("p", { class: "hint" }, `Serving speedup in vLLM ${s.vllm_version || ""}: the verifier alone vs with the draft, same prompts (${s.num_prompts}), greedy, interleaved, median of ${s.rounds} rounds, on ${hardwareText(s.hardware)}. AL of the same run: ${fmtNum(s.acceptance_length, 3)}.`));
    parts.push(h("table", { class: "speedup-table", "aria-label": `Serving speedup of step ${ck.step} per K and batch size` },
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "K"), sizes.map((b) => h("th", { scope: "col" }, `batch ${b}`)))),
      h("tbody", {},
        ks.map((k) => h("tr", { dataset: { k } }, h("th", { scope: "row" }, `K=${k}`), sizes.map((b) => {
          const r = cell(k, b);
          return h("td", { class: rec.get(b) === k ? "recommended" : "" }, r ? [speedupSpan(r), h("div", { class: "hint" }, `${fmtNum(r.base_tokens_per_s, 3)} → ${fmtNum(r.spec_tokens_per_s, 3)} tok/s`)] : "—");
        }))),
        h("tr", { class: "rec-row" }, h("th", { scope: "row" }, "recommended"), sizes.map((b) => {
          const k = rec.get(b);
          return h("td", {}, k ? `K=${k}` : k === 0 ? "no draft (slower at every K)" : "—");
        })))));
  }
  return h("section", { class: "evaluation", dataset: { step: ck.step } }, parts);
}

/**
 * Render the checkpoints of a job into `box`.
 * @param {HTMLElement} box
 * @param {object} job the job (for its id)
 * @param {Array<object>} cks CheckpointOut list (newest first or any order)
 */
export function renderCheckpoints(box, job, cks) {
  if (!cks.length) {
    box.replaceChildren(h("div", { class: "empty" }, "No checkpoint yet."));
    return;
  }
  const sorted = [...cks].sort((a, b) => b.step - a.step);
  const th = (t, title) => h("th", { scope: "col", title }, t);
  // Every number says what it is: tau_sim on the held-out rows (training-batch value when the job has
  // none), the training loss of the interval before the checkpoint next to the held-out loss, and the
  // measured AL of the reference decoder next to vLLM's own.
  const num = (label, key, v, title) => h("td", { class: "num", "data-label": label, "data-key": key, title }, fmtNum(v));
  // Who measured the job's AL (the resolved eval.engine); with the reference decoder the serve check adds vLLM's.
  const engine = (job && job.resolved_spec && job.resolved_spec.eval && job.resolved_spec.eval.engine)
    || (sorted.find((c) => c.evaluation && c.evaluation.engine) || {}).evaluation?.engine || "reference";
  const byVllm = engine === "vllm";
  box.replaceChildren(h("div", { class: "table-wrap" }, h("table", { class: "cards checkpoints" },
    h("thead", {}, h("tr", {}, th("Step"), th("tau_sim (held-out)", define("eval_tau_sim")),
      th(byVllm ? "AL (vLLM)" : "AL (reference)", define("acceptance_length")),
      byVllm ? null : th("AL (vLLM)", define("vllm_acceptance_length")),
      th("Speedup (vLLM)", define("speedup")),
      th("train loss", define("loss")), th("eval loss", define("eval_loss")),
      th("Files (sha256)"), th("Download"), th("Serve with vLLM"))),
    h("tbody", {}, sorted.map((ck) => {
      const m = ck.metrics || {};
      const heldOut = m.eval_tau_sim != null;
      return h("tr", { dataset: { step: ck.step } },
      h("td", { "data-label": "Step", title: fmtTime(ck.created_at) }, h("b", {}, String(ck.step)), " ",
        ck.is_best ? h("span", { class: "badge best", title: "Best checkpoint by the job's selection metric" }, "best") : null, " ",
        ck.is_latest ? h("span", { class: "badge latest", title: "Newest complete checkpoint" }, "latest") : null),
      num(heldOut ? "tau_sim (held-out)" : "tau_sim (train)", "tau_sim", ck.tau_sim ?? m.tau_sim,
        heldOut ? define("eval_tau_sim") : define("tau_sim")),
      num("AL", "acceptance_length", ck.acceptance_length ?? m.acceptance_length, define("acceptance_length")),
      byVllm ? null : num("AL (vLLM)", "vllm_acceptance_length", m.vllm_acceptance_length, define("vllm_acceptance_length")),
      h("td", { "data-label": "Speedup" }, speedupCell(ck)),
      num("train loss", "loss", m.loss, define("loss")),
      num("eval loss", "eval_loss", m.eval_loss, define("eval_loss")),
      h("td", { "data-label": "Files" }, filesCell(ck)),
      h("td", { "data-label": "Download" }, h("a", { class: "btn small", href: ck.archive_url, download: `${ck.folder}.tar`, "aria-label": `Download the archive of step ${ck.step}`, title: "config.json + model.safetensors: what vllm serve loads (training_state.pt is listed under Files)" }, "Archive")),
      h("td", { "data-label": "vLLM" }, commandCell(ck)));
    })))), ...sorted.filter((ck) => ck.evaluation).map(evaluationPanel));
}
