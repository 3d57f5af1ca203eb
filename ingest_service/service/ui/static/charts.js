// trainguard dashboard: DOM building, readable formats and the SVG charts (loaded
// before app.js, which draws the pages with them). Text goes in with textContent
// only: names come from users, never as HTML.
"use strict";

function h(tag, attrs, ...kids) {
  const ns = ["svg", "line", "circle", "rect", "path", "text", "polyline", "title", "g"]
    .includes(tag) ? "http://www.w3.org/2000/svg" : null;
  const el = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "onclick") el.addEventListener("click", v);
    else el.setAttribute(k, String(v));
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

const fmtInt = (v) => (v === null || v === undefined ? "–" : String(v));
function fmtS(v) {
  if (v === null || v === undefined) return "–";
  if (v < 1) return (v * 1000).toFixed(0) + " ms";
  if (v < 120) return v.toFixed(1) + " s";
  if (v < 7200) return (v / 60).toFixed(1) + " min";
  return (v / 3600).toFixed(1) + " h";
}
function fmtAgo(ts) {
  if (!ts) return "–";
  return fmtS(Math.max(0, Date.now() / 1000 - ts)) + " ago";
}
function fmtBytes(v) {
  if (v === null || v === undefined) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(1) : String(v)) + " " + u[i];
}
// Readable numbers: never an exponent ("1e-9"), a few significant digits.
function fmtNum(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1000) return Math.round(v).toLocaleString("en-US");
  if (a >= 1) return v.toFixed(a >= 100 ? 1 : 2);
  if (a >= 0.001) return v.toFixed(4).replace(/0+$/, "").replace(/\.$/, "");
  // Small losses keep three significant digits, written out (never "1e-5").
  return v.toFixed(Math.min(20, 2 - Math.floor(Math.log10(a))));
}
function fmtClock(ts) {
  const d = new Date(ts * 1000);
  return [d.getHours(), d.getMinutes(), d.getSeconds()].map((n) => String(n).padStart(2, "0")).join(":");
}
// A stream ID "<epoch + 1>-<index>" in words (the raw ID stays in data-v).
function fmtId(id) {
  if (!id || !/^\d+-\d+$/.test(id)) return id ? String(id) : "–";
  const [ms, seq] = id.split("-").map(Number);
  if (ms === 0 && seq === 0) return "nothing yet";
  return `epoch ${ms}, record ${(seq + 1).toLocaleString("en-US")}`;
}
const cell = (k, v, text) => h("td", { "data-k": k, "data-v": v === null || v === undefined ? "" : v },
  text === undefined ? fmtInt(v) : text);
const stat = (k, v, text, label) => h("div", { class: "stat" },
  h("b", { "data-k": k, "data-v": v === null || v === undefined ? "" : v }, text === undefined ? fmtInt(v) : text),
  h("span", {}, label));
const table = (head, rows) => h("div", { class: "scroll" },
  h("table", {}, h("thead", {}, h("tr", {}, head.map((t) => h("th", {}, t)))), h("tbody", {}, rows)));
// A legend's colour square: SVG, since the page's CSP allows no inline style.
const swatch = (color) => h("svg", { class: "swatch", viewBox: "0 0 10 10", width: 10, height: 10 },
  h("rect", { width: 10, height: 10, fill: color }));
const card = (title, ...kids) => h("section", { class: "card" }, h("h2", {}, title), ...kids);

// ------------------------------------------------------------------ charts (SVG)

function lineChart(series, opts) {
  // series: [{name, color, points: [[x, y], ...]}]
  const W = 600, H = 170, L = 64, B = 22, T = 8, R = 8; // L: room for "0.0000348"
  const pts = series.flatMap((s) => s.points);
  const svg = h("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": opts.label });
  if (!pts.length) {
    svg.append(h("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no samples yet"));
    return svg;
  }
  const x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
  const top = Math.max(...pts.map((p) => p[1]), ...(opts.hlines || []).map((l) => l.y));
  const y0 = opts.fromMin ? Math.min(...pts.map((p) => p[1])) : 0;
  // All-zero data still gets a readable scale (0 to 1), never a "1e-9" top label.
  const y1 = top > y0 ? top : y0 + 1;
  const sx = (x) => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - B - T);
  svg.append(h("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#e3e6eb" }));
  svg.append(h("text", { x: L - 4, y: T + 8, "text-anchor": "end" }, opts.fmt(y1)));
  svg.append(h("text", { x: L - 4, y: H - B, "text-anchor": "end" }, opts.fmt(y0)));
  // The time axis: clock times under the chart (x values are unix seconds).
  const ticks = x1 === x0 ? [x0] : [0, 1, 2, 3].map((i) => x0 + (i / 3) * (x1 - x0));
  ticks.forEach((t, i) => svg.append(h("text", { x: sx(t), y: H - 4, "data-axis": "time",
    "text-anchor": ticks.length === 1 ? "middle" : i === 0 ? "start" : i === ticks.length - 1 ? "end" : "middle" },
  fmtClock(t))));
  for (const m of opts.marks || []) {
    svg.append(h("line", { x1: sx(m.x), y1: T, x2: sx(m.x), y2: H - B, stroke: m.color,
      "stroke-dasharray": "4 3", "data-mark": m.kind }, h("title", {}, m.title)));
    const right = sx(m.x) > W - 120; // keep the label inside the chart
    svg.append(h("text", { x: sx(m.x) + (right ? -3 : 3), y: T + 10,
      "text-anchor": right ? "end" : "start" }, m.label));
  }
  for (const l of opts.hlines || []) {
    svg.append(h("line", { x1: L, y1: sy(l.y), x2: W - R, y2: sy(l.y), stroke: l.color,
      "stroke-dasharray": "2 2" }));
  }
  for (const s of series) {
    if (s.points.length > 1 && !opts.dots) {
      svg.append(h("polyline", { fill: "none", stroke: s.color, "stroke-width": 1.5,
        points: s.points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ") }));
    }
    if (opts.dots) for (const p of s.points) {
      svg.append(h("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 3, fill: s.color },
        h("title", {}, p[2] || "")));
    }
  }
  return svg;
}

function bars(items, opts) {
  // items: [{label, value, color, title}]
  const W = 600, H = 140, L = 44, B = 18, T = 8;
  const svg = h("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": opts.label });
  // One outlier (a save that waited on a stalled disk) must not flatten the rest: the
  // scale stops at twice the 90th percentile, and taller bars are cut with a mark.
  const sorted = items.map((i) => i.value || 0).sort((a, b) => a - b);
  const p90 = sorted[Math.floor(0.9 * (sorted.length - 1))] || 0;
  const top = sorted.length ? sorted[sorted.length - 1] : 0;
  const scaled = top > 4 * p90 && p90 > 0 ? 2 * p90 : top;
  const max = scaled > 0 ? scaled : 1; // all zero: a 0..1 scale, labelled as such
  const bw = (W - L) / Math.max(1, items.length);
  svg.append(h("text", { x: L - 4, y: T + 8, "text-anchor": "end" }, opts.fmt(max)));
  items.forEach((it, i) => {
    const cut = (it.value || 0) > max;
    const hgt = (Math.min(it.value || 0, max) / max) * (H - B - T);
    svg.append(h("rect", { x: L + i * bw + 1, y: H - B - hgt, width: Math.max(1, bw - 2),
      height: hgt, fill: it.color, "data-bar": it.label }, h("title", {}, it.title)));
    if (cut) svg.append(h("text", { x: L + i * bw + bw / 2, y: T - 1, "text-anchor": "middle" },
      "↑ " + opts.fmt(it.value)));
    if (items.length <= 32) svg.append(h("text", { x: L + i * bw + bw / 2, y: H - 4,
      "text-anchor": "middle" }, it.label));
  });
  return svg;
}
