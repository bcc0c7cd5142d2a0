// The job's tasks (GET /v1/jobs/{id}/tasks, issue 37): its trainer and, for a job split over engine workers
// (resources.engine), one row per engine worker with the chunks it ran and its capture rate.
import { api } from "./api.js";
import { $, h } from "./ui.js";

const num = (v) => (v === null || v === undefined ? "—" : Number(v).toLocaleString("en-US"));

/** A `<table class="tasks">` of `rows` (the endpoint's `data`). */
export function tasksTable(rows) {
  const head = ["Role", "Worker", "GPUs", "State", "Chunks done", "Tokens/s"];
  return h("table", { class: "tasks", "aria-label": "Tasks" },
    h("thead", {}, h("tr", {}, head.map((t) => h("th", {}, t)))),
    h("tbody", {}, rows.map((r) => h("tr", { dataset: { role: r.role } },
      h("td", {}, r.role), h("td", {}, r.worker || "—"), h("td", {}, String(r.gpus)), h("td", {}, r.state),
      h("td", {}, r.role === "engine" ? `${num(r.chunks_done)} / ${num(r.chunks_total)}` : "—"),
      h("td", {}, num(r.tokens_per_second))))));
}

/** Job page: draw the tasks of a split job in a section after the timeline (nothing for a one-worker job). */
export async function renderJobTasks(job) {
  if (!job || !job.spec || !job.spec.resources || !job.spec.resources.engine) return;
  const res = await api(`/v1/jobs/${encodeURIComponent(job.id)}/tasks`).catch(() => null);
  if (!res) return;
  let sec = document.getElementById("tasks");
  if (!sec) {
    sec = h("section", { class: "panel", id: "tasks", "aria-labelledby": "tasks-h" }, h("h2", { id: "tasks-h" }, "Tasks"), h("div"));
    $("#timeline").closest("section").after(sec);
  }
  sec.lastChild.replaceChildren(tasksTable(res.data || []));
}
