// A tiny element builder: text always goes in as text nodes, never as HTML.
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "class") el.className = value;
    else el.setAttribute(key, value === true ? "" : value);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export const main = () => document.getElementById("main");

// The page's body under its heading; the focus moves to it so a keyboard user starts there.
export function page(title, ...children) {
  document.title = `${title} · moetune console`;
  return replace(main(), h("h1", { title }, title), ...children); // one line, cut with an ellipsis (ids never wrap)
}

export const fmt = (value, digits = 4) =>
  value === null || value === undefined ? "–" : typeof value === "number" ? Number(value.toFixed(digits)).toString() : String(value);

export function when(seconds) {
  if (!seconds) return "–";
  return new Date(seconds * 1000).toLocaleString();
}

export function eta(seconds) {
  if (!seconds) return "–";
  const left = Math.round(seconds - Date.now() / 1000);
  if (left <= 0) return "any moment";
  return left < 90 ? `${left} s` : left < 5400 ? `${Math.round(left / 60)} min` : `${(left / 3600).toFixed(1)} h`;
}

export const statusBadge = (status) => h("span", { class: `status ${status}`, "data-status": status }, status.replace("_", " "));

export function progressCell(job) {
  const { step = 0, total_steps: total } = job.progress || {};
  if (!total) return h("span", { class: "muted" }, step ? `step ${step}` : "–");
  return h("span", {}, h("progress", { max: total, value: step, "aria-label": `step ${step} of ${total}` }),
    ` ${step}/${total}`);
}

export function table(headers, rows, attrs = {}) {
  const head = headers.some((title) => title !== "") && h("thead", {}, h("tr", {}, headers.map((title) =>
    h("th", { scope: "col", class: title.num ? "num" : null }, title.text ?? title))));
  return h("div", { class: "scroll" }, h("table", attrs, head,
    rows instanceof HTMLTableSectionElement ? rows : h("tbody", {}, rows)));
}

// GiB, or MiB below a hundredth of one (tiny models would read 0.00 GiB everywhere)
export function gib(bytes) {
  const [value, unit] = bytes && bytes < 2 ** 30 / 100 ? [bytes / 2 ** 20, "MiB"] : [bytes / 2 ** 30, "GiB"];
  return `${value.toLocaleString(undefined, { maximumFractionDigits: 2, minimumFractionDigits: 2 })} ${unit}`;
}
