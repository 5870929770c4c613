// One job: summary, actions, the live loss chart (from the job's SSE event stream), events, checkpoints with their
// scores, LoRA coverage, the expert load per layer; and its adaptation report page.
import { TERMINAL, api, baseNames, eventStream } from "./api.js";
import { legend, lineChart, onWidthChange, thinned } from "./chart.js";
import { eta, fmt, h, page, progressCell, replace, statusBadge, table, when } from "./dom.js";

const POLL_MS = 2000;
const SHOWN_EVENTS = 300;
// A week-long job reports hundreds of thousands of steps: the page keeps the events it shows, one loss per step,
// and draws at most this many points per series.
const DRAWN_POINTS = 2000;
// The expert-load table has a column per step up to this many (it scrolls sideways), then every k-th step.
const LOAD_COLUMNS = 400;
const jobId = () => decodeURIComponent(location.pathname.split("/")[3] || "");
const jobPath = (id) => `/v1/fine_tuning/jobs/${encodeURIComponent(id)}`;

export async function render(name) {
  return name === "report" ? renderReport(jobId()) : renderJob(jobId());
}

function notFound(id, error) {
  page("Job not found", h("p", { class: "error", role: "alert", id: "not-found" }, error.message),
    h("p", {}, h("a", { href: "/console/jobs" }, "All jobs")));
}

async function renderReport(id) {
  const answer = await api(`${jobPath(id)}/report.html`, { raw: true });
  const back = h("p", {}, h("a", { href: `/console/jobs/${encodeURIComponent(id)}` }, `Back to ${id}`));
  if (answer.status === 404 && answer.error.code === "job_not_found") return notFound(id, answer.error);
  if (!answer.ok) return page("Adaptation report", back, h("p", { class: "error", role: "alert" }, answer.error.message));
  // The API's self-contained page (inline SVG, no requests), framed with scripts off.
  page(`Adaptation report of ${id}`, back,
    h("iframe", { class: "report", id: "report-frame", title: `Adaptation report of ${id}`, sandbox: "", srcdoc: answer.data }));
}

function summaryRows(job, baseName) {
  const rows = [
    ["Status", statusBadge(job.status)], ["Base", h("span", { class: "mono id", title: job.model, id: "base-model" }, baseName(job))],
    ["Tuned model", h("span", { class: "mono", id: "tuned-model" }, job.fine_tuned_model || "–")],
    ["Progress", progressCell(job)], ["ETA", job.status === "running" ? eta(job.estimated_finish) : "–"],
    ["Train / valid loss", `${fmt(job.progress?.train_loss)} / ${fmt(job.progress?.valid_loss)}`],
    ["Parallelism", `${job.parallelism.num_workers} workers × ${job.parallelism.gpus_per_worker} GPU, ZeRO-${job.parallelism.zero_stage}, EP ${job.parallelism.expert_parallel_size ?? 1}${job.parallelism.context_parallel_size > 1 ? `, CP ${job.parallelism.context_parallel_size}` : ""}`],
    ["LoRA", `rank ${job.lora.rank}, ${Array.isArray(job.lora.target_modules) ? job.lora.target_modules.join(", ") : job.lora.target_modules}`],
    ["Created", when(job.created_at)], ["Finished", when(job.finished_at)],
  ];
  if (job.queue_reason) rows.push(["Waiting", job.queue_reason]);
  if (job.error) rows.push(["Error", h("span", { class: "error" }, `${job.error.code}: ${job.error.message}`)]);
  return table(["", ""], rows.map(([k, v]) => h("tr", {}, h("th", { scope: "row" }, k), h("td", {}, v))), { id: "summary" });
}

function coverageTable(rows) {
  return table(["Layer type", { text: "Layers adapted", num: true }, "LoRA on", "Not adapted", { text: "Trainable", num: true }],
    rows.map((r) => h("tr", {}, h("td", {}, r.layer_type), h("td", { class: "num" }, `${r.adapted_layers}/${r.layers}`),
      h("td", { class: "mono" }, r.adapted.join(", ") || "–"), h("td", { class: "mono" }, r.not_adapted.join(", ") || "–"),
      h("td", { class: "num" }, r.trainable_parameters.toLocaleString()))), { id: "coverage-table" });
}

// A step's figures as words: `expert_imbalance={'1': 1.6405}` reads "expert imbalance: layer 1 1.64".
const number = (v) => typeof v !== "number" ? String(v) : Number.isInteger(v) ? v.toLocaleString()
  : Math.abs(v) >= 100 ? Math.round(v).toLocaleString() : Number(v.toPrecision(3)).toString();
function figure(key, value) {
  const name = key.replace(/_mb$/, " (MB)").replaceAll("_", " ");
  if (Array.isArray(value)) return `${name}: ${value.map(number).join(", ")}`;
  if (value && typeof value === "object") {
    return `${name}: ${Object.entries(value).map(([k, v]) => `${/^\d+$/.test(k) ? "layer " : ""}${k} ${number(v)}`).join(", ")}`;
  }
  return `${name} ${number(value)}`;
}
export function metricsText({ step, total_steps: total, ...figures }) {
  return `Step ${step}${total ? `/${total}` : ""}: ${Object.entries(figures).map(([k, v]) => figure(k, v)).join("; ")}`;
}

// layers × steps of max / mean expert load (1 = balanced): a column for every step the job reported
function expertLoad({ layers, steps, ratio }) {
  const every = Math.ceil(steps.length / LOAD_COLUMNS);
  const columns = steps.map((step, j) => [step, j]).filter(([, j]) => j % every === 0 || j === steps.length - 1);
  const top = Math.max(1.0001, ...ratio.flat());
  const cell = (v) => h("td", { style: `background: rgba(194, 65, 12, ${((v - 1) / (top - 1)) * 0.6})` }, v.toFixed(2));
  return h("div", {}, h("p", { class: "muted" }, "Max / mean expert load per MoE layer (rows) and step (columns); 1.00 = balanced.",
    every > 1 ? ` Every ${every}th of ${steps.length} steps.` : ""),
  table(["Layer \\ step", ...columns.map(([step]) => ({ text: step, num: true }))],
    layers.map((layer, i) => h("tr", {}, h("th", { scope: "row", class: "mono" }, layer), columns.map(([, j]) => cell(ratio[i][j])))),
    { class: "heat", id: "expert-load-table" }));
}

async function renderJob(id) {
  const first = await api(jobPath(id));
  if (!first.ok) return first.status === 404 ? notFound(id, first.error) : page(id, h("p", { class: "error" }, first.error.message));
  let job = first.data;
  const baseName = await baseNames();
  const train = new Map(), valid = new Map(), load = new Map(), events = [];
  let coverage = null, report = null;

  const summary = h("div", {});
  const status = h("p", { id: "action-status", role: "status", class: "muted" });
  const chart = h("div", { class: "chart", id: "chart" });
  const eventList = h("ul", { class: "plain events", id: "events", "aria-live": "polite" });
  const checkpoints = h("div", { id: "checkpoints" });
  const coverageBox = h("div", { id: "coverage" }, h("p", { class: "muted" }, "Reported once the job's checks have run."));
  const loadBox = h("div", { id: "expert-load" }, h("p", { class: "muted" }, "Measured by moetune's expert-parallel layers (expert LoRA or expert parallelism); none reported for this job yet."));
  const reportLink = h("a", { href: `/console/jobs/${encodeURIComponent(id)}/report`, id: "open-report", hidden: true }, "Open the adaptation report");
  const playLink = h("a", { id: "open-playground", hidden: true }, "Chat in the playground");
  const buttons = Object.fromEntries(["cancel", "pause", "resume", "deploy"].map((action) =>
    [action, h("button", { type: "button", id: action, class: action === "cancel" ? "secondary" : null, onclick: () => act(action) },
      action[0].toUpperCase() + action.slice(1))]));

  const drawChart = () => {
    const series = [
      { name: "train loss", cls: "train", points: thinned([...train].sort((a, b) => a[0] - b[0]), DRAWN_POINTS) },
      { name: "valid loss", cls: "valid", color: "#c2410c", dashed: true, points: thinned([...valid].sort((a, b) => a[0] - b[0]), DRAWN_POINTS) },
    ];
    replace(chart, legend(series), lineChart(series, { label: `loss of ${id}: ${train.size} steps`, width: chart.clientWidth }));
  };
  const drawEvents = () => replace(eventList, [...events].reverse().map((e) =>
    h("li", { class: e.level }, h("span", { class: "muted" }, new Date(e.created_at * 1000).toLocaleTimeString(), " "),
    e.type === "metrics" && e.data?.step !== undefined ? metricsText(e.data) : e.message)));
  const drawJob = () => {
    replace(summary, summaryRows(job, baseName));
    buttons.cancel.disabled = TERMINAL.has(job.status);
    buttons.pause.disabled = !["validating_files", "queued", "running"].includes(job.status);
    buttons.resume.disabled = job.status !== "paused";
    buttons.deploy.disabled = job.status !== "succeeded";
    reportLink.hidden = job.status !== "succeeded";
    if (job.fine_tuned_model) {
      playLink.href = `/console/playground?model=${encodeURIComponent(job.fine_tuned_model)}`;
      playLink.hidden = false;
    }
  };
  const drawCheckpoints = async () => {
    const answer = await api(`${jobPath(id)}/checkpoints?limit=100`);
    if (!answer.ok) return;
    const list = answer.data.data.sort((a, b) => a.step_number - b.step_number);
    const extra = [...new Set(list.flatMap((c) => Object.keys(c.metrics)))].filter((k) => !["step", "train_loss", "valid_loss"].includes(k));
    replace(checkpoints, list.length ? table([{ text: "Step", num: true }, { text: "Train loss", num: true }, { text: "Valid loss", num: true },
      ...extra.map((k) => ({ text: k, num: true })), "Location"],
    list.map((c) => h("tr", {}, h("td", { class: "num" }, c.step_number), h("td", { class: "num" }, fmt(c.metrics.train_loss)),
      h("td", { class: "num" }, fmt(c.metrics.valid_loss)), extra.map((k) => h("td", { class: "num" }, fmt(c.metrics[k]))),
      h("td", { class: "mono id" }, c.fine_tuned_model_checkpoint))), { id: "checkpoints-table" })
      : h("p", { class: "muted" }, "No complete checkpoint yet."));
  };
  const drawExtras = () => {
    if (coverage) replace(coverageBox, coverageTable(coverage));
    if (report?.expert_imbalance?.layers.length) return replace(loadBox, expertLoad(report.expert_imbalance));
    if (!load.size) return;
    const steps = [...load.keys()].sort((a, b) => a - b);
    const layers = Object.keys(load.get(steps.at(-1)));
    replace(loadBox, expertLoad({ layers, steps, ratio: layers.map((layer) => steps.map((step) => load.get(step)[layer] ?? 1)) }));
  };
  const loadReport = async () => {
    const answer = await api(`${jobPath(id)}/report`);
    if (!answer.ok) return;
    report = answer.data;
    coverage = coverage || report.lora_coverage;
    drawExtras();
  };

  async function act(action) {
    for (const b of Object.values(buttons)) b.disabled = true;
    status.textContent = `${action}…`;
    const answer = await api(`${jobPath(id)}/${action}`, { method: "POST" });
    if (answer.ok && action === "deploy") {
      status.textContent = `Serving ${answer.data.model} (base ${answer.data.base_model}) at ${answer.data.base_url}: ${answer.data.status}.`;
    } else {
      status.textContent = answer.ok ? `${action}: the job is now ${answer.data.status}.` : `${action} refused: ${answer.error.message}`;
      if (answer.ok) job = answer.data;
    }
    status.className = answer.ok ? "muted" : "error";
    drawJob();
  }

  const onEvent = (e) => {
    events.push(e);
    if (events.length > SHOWN_EVENTS) events.shift();
    if (e.type === "metrics" && e.data) {
      if (typeof e.data.train_loss === "number") train.set(e.data.step, e.data.train_loss);
      if (typeof e.data.valid_loss === "number") valid.set(e.data.step, e.data.valid_loss);
      if (e.data.expert_imbalance) load.set(e.data.step, e.data.expert_imbalance);
    }
    if (e.data?.lora_coverage) coverage = e.data.lora_coverage;
  };

  page(id,
    h("div", { class: "card" }, summary,
      h("div", { class: "row actions" }, Object.values(buttons), reportLink, playLink), status),
    h("div", { class: "grid" },
      h("section", { class: "card", "aria-labelledby": "loss-h" }, h("h2", { id: "loss-h" }, "Loss"), chart),
      h("section", { class: "card", "aria-labelledby": "events-h" }, h("h2", { id: "events-h" }, "Events"), eventList)),
    h("section", { class: "card", "aria-labelledby": "ckpt-h" }, h("h2", { id: "ckpt-h" }, "Checkpoints"), checkpoints),
    h("section", { class: "card", "aria-labelledby": "cov-h" }, h("h2", { id: "cov-h" }, "LoRA coverage"), coverageBox),
    h("section", { class: "card", "aria-labelledby": "load-h" }, h("h2", { id: "load-h" }, "Expert load per layer"), loadBox));
  drawJob();
  drawChart();
  onWidthChange(chart, drawChart);
  drawCheckpoints();
  if (job.status === "succeeded") loadReport();

  const poll = setInterval(async () => {
    const answer = await api(jobPath(id));
    if (!answer.ok) return;
    const was = job.status;
    job = answer.data;
    drawJob();
    drawCheckpoints();
    if (TERMINAL.has(job.status)) {
      clearInterval(poll);
      if (job.status === "succeeded" && was !== job.status) loadReport();
    }
  }, POLL_MS);

  // The stream replays every event oldest first, then follows the job live until it ends (`event: done`).
  let lastId = null;
  for (;;) {
    try {
      for await (const frame of eventStream(`${jobPath(id)}/events?stream=true${lastId ? `&after=${lastId}` : ""}`)) {
        if (frame.event === "done") return;
        lastId = frame.id || lastId;
        onEvent(JSON.parse(frame.data));
        drawChart();
        drawEvents();
        drawExtras();
      }
      return;
    } catch (error) {
      if (error.status) return replace(eventList, h("li", { class: "error" }, error.message));
      await new Promise((resolve) => setTimeout(resolve, 2000)); // a cut connection: continue after the last event
    }
  }
}
