// The data funnel (peagle/spec/funnel.py): read -> kept (+ dropped, each under a reason) -> held out ->
// packed rows -> tokens. One view for the job page (from the job's `data` event), the dry-run estimate and
// the dataset report; reason sentences come from the API (GET /v1/meta `funnel_reasons`).
import { loadMeta } from "./api.js";
import { $, h } from "./ui.js";

const num = (v) => (v === null || v === undefined ? "—" : Number(v).toLocaleString("en-US"));

/** A `<div class="funnel">` for `f` (a funnel object), or null when there is none. */
export async function funnelView(f) {
  if (!f || typeof f !== "object") return null;
  const meta = await loadMeta().catch(() => ({}));
  const reasons = meta.funnel_reasons || {};
  const step = (key, label, value, extra) => h("li", { dataset: { key } }, h("span", { class: "n" }, num(value)), ` ${label}`, extra || null);
  const drops = Object.entries(f.dropped_by_reason || {});
  return h("div", { class: "funnel", "aria-label": "Data funnel" },
    f.estimated ? h("div", { class: "sub" }, "Estimated before the data is read; the job reports the counted funnel.") : null,
    h("ol", { class: "funnel-steps" },
      step("read", "conversations read", f.read),
      step("dropped", "dropped", f.dropped, drops.length
        ? h("ul", { class: "funnel-reasons" }, drops.map(([k, n]) =>
          h("li", { dataset: { reason: k }, title: reasons[k] || k }, `${num(n)} ${k.replace(/_/g, " ")}`,
            reasons[k] ? h("span", { class: "sub" }, ` (${reasons[k]})`) : null)))
        : null),
      step("kept", "kept", f.kept, f.truncated ? h("span", { class: "sub" }, ` (${num(f.truncated)} cut at max_length)`) : null),
      f.prompts_only ? step("prompts_only", "without an answer (the target writes it when regenerating)", f.prompts_only) : null,
      step("held_out", "held out for evaluation", f.held_out),
      step("train_conversations", "training conversations", f.train_conversations),
      f.packed_rows !== null && f.packed_rows !== undefined ? step("packed_rows", "packed rows", f.packed_rows) : null,
      f.train_tokens !== null && f.train_tokens !== undefined ? step("train_tokens", "training tokens", f.train_tokens) : null));
}

/** Job page: draw the newest `data` event's funnel in a section after the timeline (created once). */
export async function renderJobFunnel(events) {
  const ev = [...events].reverse().find((e) => e.kind === "data" && e.data && e.data.funnel);
  if (!ev) return;
  let sec = document.getElementById("funnel");
  if (!sec) {
    sec = h("section", { class: "panel", id: "funnel", "aria-labelledby": "funnel-h" }, h("h2", { id: "funnel-h" }, "Data"), h("div"));
    $("#timeline").closest("section").after(sec);
  }
  if (sec.dataset.seq === String(ev.seq)) return;
  sec.dataset.seq = String(ev.seq);
  sec.lastElementChild.replaceChildren((await funnelView(ev.data.funnel)) || "");
}
