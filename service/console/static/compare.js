// Two or more jobs side by side: their loss curves on one chart and the key figures of their reports (the CLI's
// `jobs compare`); curves come from the report's steps, or from the metrics events of a job without a report.
import { allPages, api, baseNames } from "./api.js";
import { legend, lineChart, onWidthChange } from "./chart.js";
import { fmt, h, page, replace, statusBadge, table } from "./dom.js";

const jobPath = (id) => `/v1/fine_tuning/jobs/${encodeURIComponent(id)}`;

async function curves(job) {
  const report = job.status === "succeeded" ? await api(`${jobPath(job.id)}/report`) : { ok: false };
  if (report.ok) {
    const steps = report.data.steps;
    return { report: report.data, train: steps.map((s) => [s.step, s.train_loss]),
      valid: steps.filter((s) => s.valid_loss !== null && s.valid_loss !== undefined).map((s) => [s.step, s.valid_loss]) };
  }
  const events = await allPages(`${jobPath(job.id)}/events`, 5000);
  const metrics = (events.items || []).filter((e) => e.type === "metrics" && e.data).reverse();
  return { report: null, train: metrics.filter((e) => typeof e.data.train_loss === "number").map((e) => [e.data.step, e.data.train_loss]),
    valid: metrics.filter((e) => typeof e.data.valid_loss === "number").map((e) => [e.data.step, e.data.valid_loss]) };
}

function lastScores(report) {
  const ev = report?.evaluation;
  if (!ev) return {};
  return Object.fromEntries(ev.metrics.map((m) => [`eval ${m}`, ev.scores[m]?.at(-1)]));
}

export async function render() {
  const params = new URLSearchParams(location.search);
  const chosen = new Set((params.get("jobs") || "").split(",").filter(Boolean));
  const [listed, baseName] = await Promise.all([allPages("/v1/fine_tuning/jobs", 200), baseNames()]);
  const jobs = listed.items || [];
  const out = h("div", { id: "comparison" });
  const picker = h("fieldset", { class: "card" }, h("legend", {}, "Jobs to compare"),
    jobs.length ? h("div", { class: "row" }, jobs.map((job) => h("label", { class: "check" },
      h("input", { type: "checkbox", value: job.id, checked: chosen.has(job.id), "data-job": job.id,
        onchange: (e) => { e.target.checked ? chosen.add(job.id) : chosen.delete(job.id); draw(); } }),
      h("span", { class: "mono id" }, job.id), ` (${job.status})`))) : h("p", { class: "muted" }, "No jobs yet."));
  page("Compare", picker, out);

  async function draw() {
    const url = new URL(location.href);
    url.searchParams.set("jobs", [...chosen].join(","));
    history.replaceState(null, "", url);
    const picked = jobs.filter((job) => chosen.has(job.id));
    const missing = [...chosen].filter((id) => !jobs.some((job) => job.id === id));
    if (picked.length < 2) {
      return replace(out, missing.length ? h("p", { class: "error", role: "alert" }, `No such job: ${missing.join(", ")}`) : null,
        h("p", { class: "muted" }, "Choose two or more jobs."));
    }
    replace(out, h("p", { class: "muted" }, "Loading…"));
    const data = await Promise.all(picked.map(curves));
    const series = picked.flatMap((job, i) => [
      { name: `${job.id} train`, points: data[i].train },
      { name: `${job.id} valid`, points: data[i].valid, dashed: true },
    ]).filter((one) => one.points.length);
    const rows = [
      ["Status", (job) => statusBadge(job.status)], ["Base", (job) => h("span", { title: job.model }, baseName(job))],
      ["Tuned model", (job) => h("span", { class: "mono id" }, job.fine_tuned_model || "–")],
      ["Steps", (job, d) => d.train.length], ["First train loss", (job, d) => fmt(d.train[0]?.[1])],
      ["Last train loss", (job, d) => fmt(d.train.at(-1)?.[1])], ["Last valid loss", (job, d) => fmt(d.valid.at(-1)?.[1])],
      ["Tokens/s", (job, d) => fmt(d.report?.throughput.tokens_per_second, 1)],
      ["Peak memory per rank (MB)", (job, d) => d.report ? d.report.memory.peak_mb_per_rank.map((m) => m.toFixed(0)).join(", ") : "–"],
      ["LoRA", (job) => `rank ${job.lora.rank}, ${job.lora.target_modules}`],
      ["Parallelism", (job) => `${job.parallelism.num_workers} workers, ZeRO-${job.parallelism.zero_stage}`],
    ];
    const scoreNames = [...new Set(data.flatMap((d) => Object.keys(lastScores(d.report))))];
    for (const name of scoreNames) rows.push([name, (job, d) => fmt(lastScores(d.report)[name])]);
    const chart = h("div", {});
    const drawChart = () => replace(chart, lineChart(series, { label: `loss of ${picked.map((j) => j.id).join(", ")}`, width: chart.clientWidth }));
    replace(out,
      h("section", { class: "card chart", id: "compare-chart" }, h("h2", {}, "Loss"), legend(series),
        chart),
      h("section", { class: "card" }, h("h2", {}, "Figures"),
        table(["", ...picked.map((job) => h("a", { href: `/console/jobs/${encodeURIComponent(job.id)}`, class: "mono id" }, job.id))],
          rows.map(([title, value]) => h("tr", {}, h("th", { scope: "row" }, title), picked.map((job, i) => h("td", {}, value(job, data[i]))))),
          { id: "compare-table" })));
    drawChart();
    onWidthChange(chart, drawChart);
  }
  await draw();
}
