// The tenant's jobs: status, base, tuned model, progress and ETA, filtered by status; refreshed every few seconds.
import { STATUSES, api, baseNames } from "./api.js";
import { eta, h, page, progressCell, replace, statusBadge, table, when } from "./dom.js";

const REFRESH_MS = 3000;

export async function render() {
  const params = new URLSearchParams(location.search);
  const baseName = await baseNames();
  const filter = h("select", { id: "status-filter", name: "status" },
    h("option", { value: "" }, "all statuses"), STATUSES.map((s) => h("option", { value: s }, s.replace("_", " "))));
  filter.value = params.get("status") || "";
  const body = h("tbody", { id: "jobs-body" });
  const count = h("p", { class: "muted", id: "jobs-count", role: "status" });
  const compare = h("button", { type: "button", class: "secondary", id: "compare-selected", disabled: true }, "Compare selected");
  const more = h("button", { type: "button", class: "secondary", id: "more", hidden: true }, "Load more");
  const selected = new Set();
  let jobs = [], hasMore = false, pages = 1;

  const draw = () => {
    const shown = jobs.filter((job) => !filter.value || job.status === filter.value);
    replace(body, shown.map((job) => h("tr", { "data-job": job.id },
      h("td", {}, h("input", { type: "checkbox", "aria-label": `select ${job.id} to compare`, checked: selected.has(job.id),
        onchange: (e) => { e.target.checked ? selected.add(job.id) : selected.delete(job.id); compare.disabled = selected.size < 2; } })),
      h("td", {}, h("a", { href: `/console/jobs/${encodeURIComponent(job.id)}`, class: "mono id" }, job.id)),
      h("td", {}, statusBadge(job.status)),
      h("td", { class: "mono id", title: job.model, "data-base": job.model }, baseName(job)),
      h("td", { class: "mono id" }, job.fine_tuned_model || "–"),
      h("td", { class: "nowrap" }, progressCell(job)),
      h("td", {}, job.status === "running" ? eta(job.estimated_finish) : "–"),
      h("td", { class: "nowrap" }, when(job.created_at)))));
    count.textContent = shown.length ? `${shown.length} job${shown.length > 1 ? "s" : ""}` + (filter.value ? ` ${filter.value.replace("_", " ")}` : "")
      : jobs.length ? "No job has this status." : "No jobs yet: start one under New job.";
    more.hidden = !hasMore;
  };

  const load = async () => {
    const fresh = [];
    let after = null;
    for (let i = 0; i < pages; i++) {
      const answer = await api(`/v1/fine_tuning/jobs?limit=100${after ? `&after=${after}` : ""}`);
      if (!answer.ok) { count.textContent = answer.error.message; return; }
      fresh.push(...answer.data.data);
      hasMore = answer.data.has_more;
      after = answer.data.last_id;
      if (!hasMore) break;
    }
    jobs = fresh;
    draw();
  };

  filter.addEventListener("change", () => {
    const url = new URL(location.href);
    filter.value ? url.searchParams.set("status", filter.value) : url.searchParams.delete("status");
    history.replaceState(null, "", url);
    draw();
  });
  more.addEventListener("click", () => { pages += 1; load(); });
  compare.addEventListener("click", () => location.assign(`/console/compare?jobs=${[...selected].map(encodeURIComponent).join(",")}`));

  page("Jobs",
    h("div", { class: "row card" }, h("label", {}, "Status", filter), compare, h("a", { href: "/console/new" }, "New job")),
    count,
    table(["", "Job", "Status", "Base", "Tuned model", "Progress", "ETA", "Created"], body, { id: "jobs-table" }),
    more);
  await load();
  setInterval(load, REFRESH_MS);
}
