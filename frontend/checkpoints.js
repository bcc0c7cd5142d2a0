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
    if (s.note) { note.textContent = s.note; note.hidden = false; }
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
  box.replaceChildren(h("div", { class: "table-wrap" }, h("table", { class: "cards checkpoints" },
    h("thead", {}, h("tr", {}, th("Step"), th("tau_sim (held-out)", define("eval_tau_sim")),
      th("AL (reference)", define("acceptance_length")), th("AL (vLLM)", define("vllm_acceptance_length")),
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
      num("AL (vLLM)", "vllm_acceptance_length", m.vllm_acceptance_length, define("vllm_acceptance_length")),
      num("train loss", "loss", m.loss, define("loss")),
      num("eval loss", "eval_loss", m.eval_loss, define("eval_loss")),
      h("td", { "data-label": "Files" }, filesCell(ck)),
      h("td", { "data-label": "Download" }, h("a", { class: "btn small", href: ck.archive_url, download: `${ck.folder}.tar`, "aria-label": `Download the archive of step ${ck.step}`, title: "config.json + model.safetensors: what vllm serve loads (training_state.pt is listed under Files)" }, "Archive")),
      h("td", { "data-label": "vLLM" }, commandCell(ck)));
    })))));
}
