// Checkpoints table of the job page: best/latest badges, metrics, files with sha256 and downloads,
// the deterministic archive, and a copy button for the exact `vllm serve` command.
import { api } from "./api.js";
import { define } from "./metrics.js";
import { copyText, fmtBytes, fmtNum, fmtTime, h } from "./ui.js";

const serveCache = new Map();

async function serveCommand(ck) {
  if (!serveCache.has(ck.serve_url)) serveCache.set(ck.serve_url, api(ck.serve_url));
  return serveCache.get(ck.serve_url);
}

function commandCell(ck) {
  const pre = h("pre", { class: "mono", "aria-label": `vllm serve command for step ${ck.step}` }, "…");
  const btn = h("button", { type: "button", class: "small", "aria-label": `Copy the vllm serve command of step ${ck.step}`, disabled: true }, "Copy");
  serveCommand(ck).then((s) => {
    pre.textContent = s.command;
    pre.title = s.long_command || "";
    btn.disabled = false;
    btn.addEventListener("click", () => copyText(s.command));
  }).catch((e) => { serveCache.delete(ck.serve_url); pre.textContent = `unavailable: ${e.message}`; });
  return h("div", { class: "cmd" }, pre, btn);
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
  box.replaceChildren(h("div", { class: "table-wrap" }, h("table", { class: "cards checkpoints" },
    h("thead", {}, h("tr", {}, th("Step"), th("tau_sim", define("tau_sim")), th("AL", define("acceptance_length")),
      th("loss", define("loss")), th("Files (sha256)"), th("Download"), th("Serve with vLLM"))),
    h("tbody", {}, sorted.map((ck) => h("tr", { dataset: { step: ck.step } },
      h("td", { "data-label": "Step", title: fmtTime(ck.created_at) }, h("b", {}, String(ck.step)), " ",
        ck.is_best ? h("span", { class: "badge best", title: "Best checkpoint by the job's selection metric" }, "best") : null, " ",
        ck.is_latest ? h("span", { class: "badge latest", title: "Newest complete checkpoint" }, "latest") : null),
      h("td", { class: "num", "data-label": "tau_sim", title: define("tau_sim") }, fmtNum(ck.tau_sim ?? ck.metrics?.tau_sim)),
      h("td", { class: "num", "data-label": "AL", title: define("acceptance_length") }, fmtNum(ck.acceptance_length ?? ck.metrics?.acceptance_length)),
      h("td", { class: "num", "data-label": "loss", title: define("loss") }, fmtNum(ck.metrics?.loss ?? ck.metrics?.eval_loss)),
      h("td", { "data-label": "Files" }, filesCell(ck)),
      h("td", { "data-label": "Download" }, h("a", { class: "btn small", href: ck.archive_url, download: `${job.id}-step_${ck.step}.tar`, "aria-label": `Download the archive of step ${ck.step}`, title: "config.json + model.safetensors: what vllm serve loads (training_state.pt is listed under Files)" }, "Archive")),
      h("td", { "data-label": "vLLM" }, commandCell(ck))))))));
}
