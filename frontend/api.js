// Thin client of the public /v1 API for the dashboard pages.
// Auth: the session cookie set by POST /v1/auth/session (HttpOnly, so scripts never see the key);
// fetch() and EventSource send it automatically on the same origin.

export class ApiError extends Error {
  /**
   * @param {number} status HTTP status (0 = network error)
   * @param {{code?: string, message?: string, param?: string|null, details?: any}} err envelope body
   */
  constructor(status, err) {
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code || "error";
    this.param = err.param || null;
    this.details = err.details || null;
  }
}

function signInUrl() {
  const next = location.pathname + location.search;
  return `/signin.html?next=${encodeURIComponent(next)}`;
}

/**
 * Call the API and return the parsed JSON (null for 204).
 * @param {string} path e.g. "/v1/jobs"
 * @param {{method?: string, body?: any, query?: Record<string, any>, form?: FormData,
 *          signal?: AbortSignal, headers?: Record<string,string>, redirect401?: boolean}} opts
 */
export async function api(path, opts = {}) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(opts.query || {})) {
    if (v === undefined || v === null || v === "") continue;
    if (Array.isArray(v)) v.forEach((x) => url.searchParams.append(k, x));
    else url.searchParams.set(k, String(v));
  }
  const init = { method: opts.method || "GET", credentials: "same-origin", headers: { ...(opts.headers || {}) }, signal: opts.signal };
  if (opts.form) init.body = opts.form;
  else if (opts.body !== undefined) {
    init.body = JSON.stringify(opts.body);
    init.headers["Content-Type"] = "application/json";
  }
  let resp;
  try {
    resp = await fetch(url, init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, { code: "network_error", message: `cannot reach the API (${e.message})` });
  }
  if (resp.status === 401 && opts.redirect401 !== false) {
    location.assign(signInUrl());
    throw new ApiError(401, { code: "unauthenticated", message: "sign in first" });
  }
  if (resp.status === 204) return null;
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!resp.ok) {
    const err = (data && data.error) || { code: "http_" + resp.status, message: text.slice(0, 200) || resp.statusText };
    throw new ApiError(resp.status, err);
  }
  return data;
}

/** All pages of a cursor-paginated list ({data, has_more}), up to `max` items. */
export async function listAll(path, query = {}, max = 500) {
  const out = [];
  let after;
  for (;;) {
    const page = await api(path, { query: { ...query, after, limit: Math.min(100, max - out.length) } });
    const items = page.data || [];
    out.push(...items);
    if (!page.has_more || !items.length || out.length >= max) return out;
    after = page.next_after || items[items.length - 1].id;
  }
}

/**
 * Open a Server-Sent Events stream of the API (cookie-authenticated).
 * @param {string} path e.g. `/v1/jobs/${id}/metrics/stream`
 * @param {{query?: Record<string, any>, onItem: (item: any, ev: MessageEvent) => void,
 *          onEnd?: () => void, onState?: (s: string) => void}} h
 * @returns {{close: () => void}}
 */
export function openStream(path, h) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(h.query || {})) if (v !== undefined && v !== null) url.searchParams.set(k, String(v));
  const es = new EventSource(url, { withCredentials: true });
  const onMsg = (ev) => {
    let item;
    try { item = JSON.parse(ev.data); } catch { return; }
    h.onItem(item, ev);
  };
  es.onmessage = onMsg;
  for (const name of ["metric", "event", "log"]) es.addEventListener(name, onMsg);
  es.addEventListener("end", () => { es.close(); h.onState?.("ended"); h.onEnd?.(); });
  es.onopen = () => h.onState?.("live");
  es.onerror = () => h.onState?.(es.readyState === EventSource.CLOSED ? "closed" : "reconnecting");
  return { close: () => es.close() };
}

let metaPromise = null;

/**
 * What the API says about jobs, from its single sources (GET /v1/meta; fetched once per page):
 * `{states, terminal_states, actions_by_state, phases, enums, suggestions, metric_keys}`.
 * @returns {Promise<any>}
 */
export function loadMeta() {
  if (!metaPromise) metaPromise = api("/v1/meta", { redirect401: false }).catch((e) => { metaPromise = null; throw e; });
  return metaPromise;
}

/** Whether `action` changes a job in `status` (the API's state machine; the API still decides). */
export function actionAllowed(meta, action, status) {
  return (meta.actions_by_state[status] || []).includes(action);
}

/** Whether `status` is terminal. */
export function isTerminal(meta, status) {
  return meta.terminal_states.includes(status);
}
