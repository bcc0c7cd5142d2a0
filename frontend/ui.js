// DOM and formatting helpers shared by the dashboard pages.
import { api } from "./api.js";

/** h("a", {href: "/x", class: "btn"}, "text", child) -> element. Strings become text nodes (no HTML). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "style" && typeof v === "object") Object.assign(el.style, v);
    else if (v === true) el.setAttribute(k, "");
    else el.setAttribute(k, String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export const $ = (sel, root = document) => root.querySelector(sel);

export function fmtDuration(s) {
  if (s === null || s === undefined || !isFinite(s)) return "—";
  s = Math.max(0, Math.round(s));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, "0")}s`;
  const hrs = Math.floor(s / 3600);
  return `${hrs}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

export function toDate(t) {
  if (t === null || t === undefined || t === "") return null;
  return typeof t === "number" ? new Date(t * 1000) : new Date(t);
}

export function fmtTime(t) {
  const d = toDate(t);
  if (!d || isNaN(d)) return "—";
  const now = new Date();
  const sameDay = d.toDateString() === now.toDateString();
  return sameDay ? d.toLocaleTimeString() : d.toLocaleString();
}

export function fmtAgo(t) {
  const d = toDate(t);
  if (!d || isNaN(d)) return "—";
  const s = (Date.now() - d.getTime()) / 1000;
  if (s < 5) return "just now";
  return `${fmtDuration(s)} ago`;
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "—";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

export function fmtNum(v, digits = 4) {
  if (v === null || v === undefined || typeof v !== "number" || !isFinite(v)) return "—";
  if (v !== 0 && (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e6)) return v.toExponential(2);
  return String(+v.toPrecision(digits));
}

const STATUS_TITLES = {
  queued: "Waiting for a worker.",
  running: "A worker is running the trainer.",
  pausing: "Pause requested: finishing the step and saving a checkpoint.",
  paused: "Stopped after a checkpoint; resume continues exactly.",
  cancelling: "Cancel requested: the trainer is stopping.",
  cancelled: "Cancelled by a user.",
  succeeded: "Finished; the best checkpoint is exported.",
  failed: "Stopped with an error.",
};

export function statusChip(status) {
  return h("span", { class: `chip ${status}`, title: STATUS_TITLES[status] || status }, status);
}

/** Progress bar with percent and ETA from a job's `progress` object. */
export function progressBar(progress, status) {
  const p = progress || {};
  let pct = typeof p.percent === "number" ? p.percent : (p.total_steps ? (100 * (p.step || 0)) / p.total_steps : 0);
  if (status === "succeeded") pct = 100;
  pct = Math.max(0, Math.min(100, pct));
  const eta = status === "running" && p.seconds_remaining != null ? ` · ETA ${fmtDuration(p.seconds_remaining)}` : "";
  const steps = p.total_steps ? `${p.step || 0}/${p.total_steps}` : "";
  // regeneration reports conversations regenerated, training optimizer steps (docs/progress.md 5)
  const unit = p.phase === "regenerating" ? "conversations regenerated" : "step";
  return h("div", { class: "progress", title: steps ? `${unit} ${steps}` : "no progress yet" },
    h("div", { class: "bar", role: "progressbar", "aria-label": "job progress", "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": Math.round(pct) },
      h("span", { style: { width: `${pct.toFixed(1)}%` } })),
    h("span", { class: "pct" }, `${pct.toFixed(0)}%${eta}`));
}

export function tagList(tags) {
  return h("span", {}, (tags || []).map((t) => h("span", { class: "tag" }, t)));
}

let toastTimer;
export function toast(msg) {
  let el = $("#toast");
  if (!el) { el = h("div", { id: "toast", class: "toast", role: "status", "aria-live": "polite" }); document.body.append(el); }
  el.textContent = msg;
  el.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { el.hidden = true; }, 2500);
}

/** A modal confirmation (native <dialog>); resolves true when confirmed. */
export function confirmDialog(title, text, okLabel = "Confirm") {
  return new Promise((resolve) => {
    const ok = h("button", { class: "primary", type: "button" }, okLabel);
    const cancel = h("button", { type: "button" }, "Keep it");
    const dlg = h("dialog", { "aria-label": title }, h("h2", {}, title), h("p", {}, text), h("div", { class: "row" }, cancel, ok));
    const done = (v) => { dlg.close(); dlg.remove(); resolve(v); };
    ok.addEventListener("click", () => done(true));
    cancel.addEventListener("click", () => done(false));
    dlg.addEventListener("cancel", () => done(false));
    document.body.append(dlg);
    dlg.showModal();
    ok.focus();
  });
}

export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const ta = h("textarea", { "aria-hidden": "true", style: { position: "fixed", opacity: "0" } });
    ta.value = text;
    document.body.append(ta);
    ta.select();
    document.execCommand("copy");
    ta.remove();
  }
  toast("Copied to the clipboard");
}

/** The top bar: brand, navigation, signed-in owner and sign-out. */
export function mountTopbar(active) {
  const links = [["jobs", "/", "Jobs"], ["new", "/new.html", "New job"], ["compare", "/compare.html", "Compare"]];
  const who = h("span", { class: "owner" });
  const signOut = h("button", { type: "button", class: "small", "aria-label": "Sign out" }, "Sign out");
  signOut.addEventListener("click", async () => {
    try { await api("/v1/auth/session", { method: "DELETE", redirect401: false }); } catch { /* already out */ }
    location.assign("/signin.html");
  });
  const bar = h("header", { class: "topbar" },
    h("a", { class: "brand", href: "/" }, "P-EAGLE"),
    h("nav", { "aria-label": "main" }, links.map(([id, href, text]) =>
      h("a", { href, "aria-current": id === active ? "page" : null }, text))),
    h("div", { class: "who" }, who, signOut));
  document.body.prepend(bar);
  api("/v1/auth/session").then((s) => { who.textContent = s && s.owner ? `signed in as ${s.owner.name || s.owner}` : ""; }).catch(() => {});
}

/** Render an API error into a container. */
export function showError(container, err) {
  container.replaceChildren(h("div", { class: "error-box", role: "alert" },
    h("b", {}, err.code ? `${err.code}: ` : "Error: "), err.message || String(err)));
}
