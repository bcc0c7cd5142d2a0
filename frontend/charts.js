// Metric storage and uPlot charts (live, smoothed, step or time x-axis) for the job and compare pages.
import uPlot from "./vendor/uplot-1.6.32.esm.js";
import { define, label } from "./metrics.js";

export const PALETTE = ["#2857c5", "#d9480f", "#2b8a3e", "#9c36b5", "#c92a2a", "#0b7285", "#e67700", "#5c7cfa", "#862e9c", "#087f5b", "#a61e4d", "#364fc7"];

/** Column store of one job's metric points: steps, times and one column per key (null = absent). */
export class MetricStore {
  constructor() {
    this.step = [];
    this.time = [];
    this.cols = new Map();
    this.lastStep = -Infinity;
    this.version = 0;
  }

  /**
   * Append one point {step, time, values}. A point at the last step is merged into it: evaluation
   * results (eval_*, measured AL) are stored as their own record at the training step they follow.
   * Points before the last step are ignored (replays).
   */
  add(p) {
    if (p.step === undefined || p.step === null || p.step < this.lastStep) return false;
    if (p.step === this.lastStep) return this.merge(p.values || {});
    const n = this.step.length;
    this.step.push(p.step);
    this.time.push(typeof p.time === "number" ? p.time : Date.parse(p.time) / 1000);
    for (const [k, v] of Object.entries(p.values || {})) {
      let col = this.cols.get(k);
      if (!col) { col = new Array(n).fill(null); this.cols.set(k, col); }
      col.push(typeof v === "number" && isFinite(v) ? v : null);
    }
    for (const col of this.cols.values()) if (col.length === n) col.push(null);
    this.lastStep = p.step;
    this.version++;
    return true;
  }

  /** Merge older points (e.g. the downsampled history) in front of the ones already stored. */
  prepend(points) {
    const old = { step: this.step, time: this.time, cols: this.cols };
    const first = old.step.length ? old.step[0] : Infinity;
    this.step = []; this.time = []; this.cols = new Map(); this.lastStep = -Infinity;
    for (const p of points) if (p.step < first) this.add(p);
    for (let i = 0; i < old.step.length; i++) {
      const values = {};
      for (const [k, col] of old.cols) if (col[i] !== null) values[k] = col[i];
      this.add({ step: old.step[i], time: old.time[i], values });
    }
  }

  /** Add `values` to the last point; a later measurement of a key wins (a replay changes nothing). */
  merge(values) {
    const n = this.step.length;
    let changed = false;
    for (const [k, v] of Object.entries(values)) {
      if (typeof v !== "number" || !isFinite(v)) continue;
      let col = this.cols.get(k);
      if (!col) { col = new Array(n).fill(null); this.cols.set(k, col); }
      if (col[n - 1] !== v) { col[n - 1] = v; changed = true; }
    }
    if (changed) this.version++;
    return changed;
  }

  keys() { return [...this.cols.keys()]; }
  get length() { return this.step.length; }

  /** Latest non-null value of a key (or null). */
  last(key) {
    const col = this.cols.get(key);
    if (!col) return null;
    for (let i = col.length - 1; i >= 0; i--) if (col[i] !== null) return col[i];
    return null;
  }
}

/**
 * A metric point split into the main run's and the preview's (keys starting with `prefix`): `[main, preview]`,
 * each a point with its own values or null when it has none (a point with no values at all stays main).
 */
export function splitPreview(p, prefix) {
  const main = {}, pre = {};
  let nMain = 0, nPre = 0;
  for (const [k, v] of Object.entries(p.values || {})) {
    if (k.startsWith(prefix)) { pre[k] = v; nPre++; } else { main[k] = v; nMain++; }
  }
  return [nMain || !nPre ? { ...p, values: main } : null, nPre ? { ...p, values: pre } : null];
}

/**
 * Debiased exponential moving average (TensorBoard-style) over the non-null values; nulls stay null.
 * @param {Array<number|null>} y values
 * @param {number} w smoothing weight in [0, 1); 0 = none
 */
export function ema(y, w) {
  if (!w) return y;
  const out = new Array(y.length);
  let acc = 0, n = 0;
  for (let i = 0; i < y.length; i++) {
    const v = y[i];
    if (v === null) { out[i] = null; continue; }
    acc = acc * w + (1 - w) * v;
    n++;
    out[i] = acc / (1 - Math.pow(w, n));
  }
  return out;
}

function fmtTick(v) {
  if (v === null || v === undefined) return "";
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a < 1e-3 || a >= 1e6) return v.toExponential(1);
  return String(+v.toPrecision(3));
}

/** Tick spacings of a step axis: whole numbers only. */
export const STEP_INCRS = [1, 2, 5].flatMap((m) => [1, 10, 100, 1e3, 1e4, 1e5, 1e6, 1e7].map((p) => m * p)).sort((a, b) => a - b);

function fmtElapsed(s) {
  if (s < 60) return `${Math.round(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(Math.round(s % 60)).padStart(2, "0")}`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}`;
}

/**
 * One uPlot chart of several lines. Lines with the same `x` array share the x column; lines from
 * different jobs are aligned with uPlot.join. The chart is rebuilt only when its set of lines changes.
 */
export class LineChart {
  /**
   * @param {HTMLElement} box element the chart fills (its width is followed with a ResizeObserver)
   * @param {{height?: number, emptyText?: string}} opts
   */
  constructor(box, opts = {}) {
    this.box = box;
    this.height = opts.height || 200;
    this.emptyText = opts.emptyText || "no points yet";
    this.plot = null;
    this.sig = "";
    this.ro = new ResizeObserver(() => this.resize());
    this.ro.observe(box);
    this.showEmpty();
  }

  showEmpty() {
    this.plot?.destroy();
    this.plot = null;
    this.sig = "";
    this.box.replaceChildren(Object.assign(document.createElement("div"), { className: "chart-empty", textContent: this.emptyText }));
  }

  resize() {
    if (!this.plot) return;
    const w = Math.max(200, Math.floor(this.box.clientWidth));
    if (Math.abs(w - this.plot.width) > 1) this.plot.setSize({ width: w, height: this.height });
  }

  /**
   * @param {Array<{key: string, label: string, x: number[], y: Array<number|null>, color?: string, dash?: number[]}>} lines
   * @param {"step"|"time"|"elapsed"} xMode
   */
  set(lines, xMode) {
    lines = lines.filter((l) => l.x.length && l.y.some((v) => v !== null));
    if (!lines.length) { if (this.plot || !this.box.querySelector(".chart-empty")) this.showEmpty(); return; }
    const groups = new Map();
    for (const l of lines) {
      if (!groups.has(l.x)) groups.set(l.x, []);
      groups.get(l.x).push(l);
    }
    const ordered = [...groups.values()].flat();
    const tables = [...groups.entries()].map(([x, ls]) => [x, ...ls.map((l) => l.y)]);
    const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
    const sig = xMode + "|" + ordered.map((l) => l.key + l.label).join(",");
    if (this.plot && sig === this.sig) { this.plot.setData(data); return; }
    this.plot?.destroy();
    this.sig = sig;
    this.box.replaceChildren();
    const opts = {
      width: Math.max(200, Math.floor(this.box.clientWidth || 500)),
      height: this.height,
      scales: { x: { time: xMode === "time" } },
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      series: [
        { label: xMode === "step" ? "step" : "time", value: xMode === "elapsed" ? (u, v) => (v == null ? "—" : fmtElapsed(v)) : undefined },
        ...ordered.map((l, i) => ({
          label: l.label,
          stroke: l.color || PALETTE[i % PALETTE.length],
          width: 1.5,
          dash: l.dash,
          spanGaps: true,
          points: { show: (u, si) => countNonNull(u.data[si]) < 60, size: 5 },
          value: (u, v) => (v == null ? "—" : fmtTick(v)),
        })),
      ],
      axes: [
        xMode === "step"
          // steps are whole numbers: integer tick spacing only (no 0.5 ticks early in a run)
          ? { stroke: "#5d6675", grid: { stroke: "#eef0f3" }, incrs: STEP_INCRS, values: (u, vs) => vs.map((v) => (Number.isInteger(v) ? String(v) : "")) }
          : { stroke: "#5d6675", grid: { stroke: "#eef0f3" }, values: xMode === "elapsed" ? (u, vs) => vs.map(fmtElapsed) : undefined },
        { stroke: "#5d6675", grid: { stroke: "#eef0f3" }, size: 56, values: (u, vs) => vs.map(fmtTick) },
      ],
    };
    this.plot = new uPlot(opts, data, this.box);
    // Definitions on hover: each legend entry carries the metric's one-line definition.
    const rows = this.plot.root.querySelectorAll(".u-legend .u-series");
    ordered.forEach((l, i) => { const r = rows[i + 1]; if (r) r.title = l.title || define(l.key); });
  }

  destroy() { this.ro.disconnect(); this.plot?.destroy(); }
}

function countNonNull(a) {
  let n = 0;
  for (let i = 0; i < a.length; i++) if (a[i] != null && ++n >= 60) break;
  return n;
}

/** x column of a store for an x-axis mode. */
export function xColumn(store, xMode) {
  if (xMode === "step") return store.step;
  if (xMode === "time") return store.time;
  const cacheKey = "_elapsed" + store.version;
  if (!store[cacheKey]) {
    const t0 = store.time[0] || 0;
    store[cacheKey] = store.time.map((t) => t - t0);
    for (const k of Object.keys(store)) if (k.startsWith("_elapsed") && k !== cacheKey) delete store[k];
  }
  return store[cacheKey];
}

/** Lines for one store and a list of keys (smoothed), ready for LineChart.set. */
export function linesFor(store, keys, { xMode, smoothing, prefix = "", color, dashEval = true }) {
  const x = xColumn(store, xMode);
  return keys.filter((k) => store.cols.has(k)).map((k, i) => ({
    key: k,
    label: prefix + label(k),
    x,
    y: k.startsWith("eval_") || k === "acceptance_length" ? store.cols.get(k) : ema(store.cols.get(k), smoothing),
    color: typeof color === "function" ? color(k, i) : color,
    dash: dashEval && (k.startsWith("eval_") || k === "acceptance_length") ? [6, 4] : undefined,
    title: define(k),
  }));
}

/** Run `fn` at most once per `ms`; a call during the wait is covered by the scheduled run. */
export function throttle(fn, ms) {
  let timer = null, last = 0;
  return () => {
    if (timer) return;
    const wait = Math.max(0, ms - (performance.now() - last));
    timer = setTimeout(() => { timer = null; last = performance.now(); requestAnimationFrame(fn); }, wait);
  };
}
