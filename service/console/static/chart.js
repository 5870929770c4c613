// Line charts as inline SVG: one polyline per series; each carries how many points it draws (data-points).
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2457c5", "#c2410c", "#1a7f37", "#7c3aed", "#b42318", "#0e7490"];

function s(tag, attrs = {}, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function ticks(lo, hi, count = 5) {
  if (hi === lo) return [lo];
  return Array.from({ length: count }, (_, i) => lo + ((hi - lo) * i) / (count - 1));
}

// At most `most` of `points`: every k-th, the newest always.
export const thinned = (points, most) => {
  const k = Math.ceil(points.length / most);
  return k <= 1 ? points : points.filter((_, i) => i % k === 0 || i === points.length - 1);
};

// series: [{name, points: [[x, y], ...], dashed?}]
export function lineChart(series, { label = "chart", width = 760, height = 280, xLabel = "step" } = {}) {
  const pad = { left: 58, right: 14, top: 12, bottom: 34 };
  const all = series.flatMap((one) => one.points);
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": label });
  if (!all.length) {
    svg.append(s("text", { x: width / 2, y: height / 2, "text-anchor": "middle", fill: "#5b6470" }, "no points yet"));
    return svg;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs, Math.min(...xs) + 1)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => pad.left + ((x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
  const Y = (y) => height - pad.bottom - ((y - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);
  const axes = s("g", { fill: "#5b6470", "font-size": "11" });
  for (const y of ticks(y0, y1)) {
    axes.append(s("line", { x1: pad.left, x2: width - pad.right, y1: Y(y), y2: Y(y), stroke: "#e4e7ec" }));
    axes.append(s("text", { x: pad.left - 6, y: Y(y) + 4, "text-anchor": "end" }, y.toPrecision(3)));
  }
  for (const x of ticks(x0, x1, Math.min(6, x1 - x0 + 1))) {
    axes.append(s("text", { x: X(x), y: height - pad.bottom + 16, "text-anchor": "middle" }, Math.round(x)));
  }
  axes.append(s("text", { x: (pad.left + width) / 2, y: height - 4, "text-anchor": "middle" }, xLabel));
  svg.append(axes);
  series.forEach((one, i) => {
    const color = one.color || COLORS[i % COLORS.length];
    const points = one.points.map(([x, y]) => `${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(" ");
    svg.append(s("polyline", { points, fill: "none", stroke: color, "stroke-width": 2, class: `line ${one.cls || ""}`,
      "data-series": one.name, "data-points": one.points.length, "stroke-dasharray": one.dashed ? "5 4" : "none" }));
    for (const [x, y] of one.points.length < 40 ? one.points : []) {
      svg.append(s("circle", { cx: X(x), cy: Y(y), r: 2.5, fill: color }));
    }
  });
  return svg;
}

export function legend(series) {
  const el = document.createElement("div");
  el.className = "legend";
  series.forEach((one, i) => {
    const item = document.createElement("span");
    item.style.color = one.color || COLORS[i % COLORS.length];
    item.textContent = one.name;
    el.append(item);
  });
  return el;
}
