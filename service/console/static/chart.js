// Line charts as inline SVG: one polyline per series; each carries how many points it draws (data-points).
const SVG = "http://www.w3.org/2000/svg";
const FONT_PX = 12;
const COLORS = ["#2457c5", "#c2410c", "#1a7f37", "#7c3aed", "#b42318", "#0e7490"];

function s(tag, attrs = {}, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// Round ("nice") ticks covering [lo, hi]: a step of 1, 2 or 5 times a power of ten, about `count` of them.
export function niceTicks(lo, hi, count = 5, integers = false) {
  const raw = Math.max((hi - lo) / Math.max(count - 1, 1), integers ? 1 : 1e-12);
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((candidate) => candidate >= raw * 0.999);
  const digits = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  const first = Math.floor(lo / step + 1e-9), last = Math.ceil(hi / step - 1e-9);
  return Array.from({ length: last - first + 1 }, (_, i) => {
    const value = (first + i) * step;
    return { value, text: value.toFixed(digits) };
  });
}

// At most `most` of `points`: every k-th, the newest always.
export const thinned = (points, most) => {
  const k = Math.ceil(points.length / most);
  return k <= 1 ? points : points.filter((_, i) => i % k === 0 || i === points.length - 1);
};

// series: [{name, points: [[x, y], ...], dashed?}]. `width` is the width it is shown at, so that one unit of the
// drawing is one CSS pixel and the labels keep their font size (a scaled-down viewBox shrank them to ~7 px).
export function lineChart(series, { label = "chart", width = 760, height = 280, xLabel = "step" } = {}) {
  width = Math.max(260, Math.round(width));
  height = Math.min(height, Math.round(width * 0.6));
  const pad = { left: 54, right: 14, top: 12, bottom: 40 };
  const all = series.flatMap((one) => one.points);
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": label });
  if (!all.length) {
    svg.append(s("text", { x: width / 2, y: height / 2, "text-anchor": "middle", fill: "#5b6470", "font-size": FONT_PX }, "no points yet"));
    return svg;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const xTicks = niceTicks(Math.min(...xs), Math.max(...xs), Math.max(2, Math.floor((width - pad.left) / 70)), true);
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
  const yTicks = niceTicks(y0, y1, Math.max(3, Math.min(6, Math.floor(height / 50))));
  // the axes span whole ticks, so the first and last labels sit at the ends
  const [x0, x1] = [xTicks[0].value, Math.max(xTicks.at(-1).value, xTicks[0].value + 1)];
  [y0, y1] = [yTicks[0].value, yTicks.at(-1).value];
  const X = (x) => pad.left + ((x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
  const Y = (y) => height - pad.bottom - ((y - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);
  const axes = s("g", { fill: "#5b6470", "font-size": FONT_PX, class: "axes" });
  for (const { value, text } of yTicks) {
    axes.append(s("line", { x1: pad.left, x2: width - pad.right, y1: Y(value), y2: Y(value), stroke: "#e4e7ec" }));
    axes.append(s("text", { x: pad.left - 6, y: Y(value) + 4, "text-anchor": "end", class: "tick y" }, text));
  }
  for (const { value, text } of xTicks) {
    axes.append(s("text", { x: X(value), y: height - pad.bottom + 17, "text-anchor": "middle", class: "tick x" }, text));
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

// Calls redraw whenever the container's width changes (a chart is drawn at the width it is shown at).
export function onWidthChange(container, redraw) {
  let seen = container.clientWidth;
  new ResizeObserver(() => {
    if (container.clientWidth !== seen) { seen = container.clientWidth; redraw(); }
  }).observe(container);
}
