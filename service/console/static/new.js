// A new job: upload the JSONL (files API; a refused row is shown on its row), choose base, method, LoRA preset and
// parallelism, ask the planner, submit. A 4xx names its field (`error.param`) and is shown next to that field.
import { allPages, api, upload } from "./api.js";
import { gib, h, page, replace, table } from "./dom.js";

const PRESETS = ["all-linear", "attention", "mlp", "experts"];
const ZERO_STAGES = [1, 2, 3]; // every stage the API takes, so whatever the planner recommends can be chosen
const GPUS_PER_NODE = 8;
const PREVIEW_ROWS = 11; // the refused row and five on each side
const PLAN_ROWS = [["lora_parameters", "LoRA parameters"], ["lora_gradients", "LoRA gradients"],
  ["optimizer_state", "optimizer state"], ["activations", "activations (saved)"], ["logits", "loss (logits)"],
  ["loss_chunk", "loss chunk (transient)"], ["all_to_all", "all-to-all buffers"], ["zero_buckets", "ZeRO buckets"], ["zero3_gather", "ZeRO-3 gathered layer"],
  ["cuda_context", "CUDA context, NCCL (stated)"]];

// An input with its label and the element its error goes in; `param` is the API's field path.
function field(param, label, control, hint) {
  const error = h("span", { class: "field-error", id: `error-${param}`, role: "alert" });
  control.name = param;
  control.id = `field-${param}`;
  control.setAttribute("aria-describedby", `error-${param}`);
  return h("label", { for: control.id }, label, control, hint ? h("span", { class: "muted" }, hint) : null, error);
}
const input = (attrs) => h("input", { type: "text", autocomplete: "off", ...attrs });
const select = (options, value) => {
  const el = h("select", {}, options.map(([v, text]) => h("option", { value: v }, text)));
  el.value = value;
  return el;
};

export async function render() {
  const [models, files] = await Promise.all([api("/v1/models"), allPages("/v1/files?purpose=fine-tune")]);
  const bases = models.ok ? models.data.data.filter((m) => m.owned_by === "moetune").map((m) => m.id) : [];
  const modelList = h("datalist", { id: "bases" }, bases.map((b) => h("option", { value: b })));

  const fileInput = h("input", { type: "file", id: "upload-file", accept: ".jsonl,application/jsonl,application/json,text/plain" });
  const uploadButton = h("button", { type: "button", id: "upload" }, "Upload");
  const uploadStatus = h("p", { id: "upload-status", role: "status" });
  const preview = h("div", { id: "upload-rows" });
  const fileOptions = (list) => [["", "— choose an uploaded file —"], ...list.map((f) => [f.id, `${f.filename} (${f.rows} rows, ${f.id})`])];
  const trainingFile = select(fileOptions(files.items || []), files.items?.[0]?.id || "");
  const validationFile = select([["", "none"], ...fileOptions(files.items || []).slice(1)], "");

  const f = {
    model: input({ list: "bases", value: bases[0] || "", placeholder: "a base's name or s3://…", size: 30 }),
    method: select([["supervised", "supervised (SFT)"], ["dpo", "DPO (preference pairs)"]], "supervised"),
    target_modules: select(PRESETS.map((p) => [p, p]), "all-linear"),
    rank: input({ inputmode: "numeric", value: "8", size: 5 }),
    alpha: input({ inputmode: "numeric", value: "16", size: 5 }),
    max_steps: input({ inputmode: "numeric", value: "12", size: 6 }),
    global_batch_size: input({ inputmode: "numeric", value: "4", size: 5 }),
    micro_batch_size: input({ value: "1", size: 5 }),
    seq_len: input({ inputmode: "numeric", value: "96", size: 6 }),
    learning_rate: input({ inputmode: "decimal", value: "0.003", size: 8 }),
    eval_every: input({ inputmode: "numeric", value: "", size: 5, placeholder: "off" }),
    checkpoint_every: input({ inputmode: "numeric", value: "", size: 5, placeholder: "off" }),
    num_workers: input({ inputmode: "numeric", value: "2", size: 4 }),
    gpus_per_worker: input({ inputmode: "numeric", value: "0", size: 4 }),
    zero_stage: select(ZERO_STAGES.map((stage) => [String(stage), `ZeRO-${stage}`]), "2"),
    expert_parallel_size: input({ inputmode: "numeric", value: "1", size: 4 }),
    suffix: input({ value: "", size: 16, placeholder: "optional" }),
    nodes: input({ inputmode: "numeric", value: "1", size: 4 }),
    gpus_per_node: input({ inputmode: "numeric", value: "1", size: 4 }),
    gpu_memory: input({ value: "80GB", size: 8 }),
    nic: input({ value: "100Gbps", size: 9 }),
  };
  // The planner's cluster follows the job's workers × GPUs (a CPU worker plans as one device) until edited by hand.
  const edited = new Set();
  const followJob = () => {
    const devices = Math.max(1, num(f.num_workers) || 1) * Math.max(1, num(f.gpus_per_worker) || 0);
    const nodes = Math.ceil(devices / GPUS_PER_NODE);
    if (!edited.has(f.nodes)) f.nodes.value = String(nodes);
    if (!edited.has(f.gpus_per_node)) f.gpus_per_node.value = String(Math.ceil(devices / nodes));
  };
  for (const el of [f.nodes, f.gpus_per_node]) el.addEventListener("input", () => edited.add(el));
  for (const el of [f.num_workers, f.gpus_per_worker]) el.addEventListener("input", followJob);
  const formError = h("p", { class: "error", id: "form-error", role: "alert" });
  const planButton = h("button", { type: "button", class: "secondary", id: "plan" }, "Plan");
  const planOut = h("div", { id: "plan-result", role: "status" });
  const submit = h("button", { type: "submit", id: "submit" }, "Submit job");

  const num = (el) => (el.value.trim() === "" ? undefined : Number(el.value));
  const drop = (obj) => Object.fromEntries(Object.entries(obj).filter(([, v]) => v !== undefined && v !== ""));
  followJob();
  const body = () => drop({
    model: f.model.value.trim(), training_file: trainingFile.value, validation_file: validationFile.value || undefined,
    suffix: f.suffix.value.trim() || undefined, method: { type: f.method.value },
    lora: drop({ target_modules: f.target_modules.value, rank: num(f.rank), alpha: num(f.alpha) }),
    training: drop({ max_steps: num(f.max_steps), global_batch_size: num(f.global_batch_size),
      micro_batch_size: f.micro_batch_size.value.trim() === "auto" ? "auto" : num(f.micro_batch_size),
      seq_len: num(f.seq_len), learning_rate: num(f.learning_rate), eval_every: num(f.eval_every),
      checkpoint_every: num(f.checkpoint_every) }),
    parallelism: drop({ num_workers: num(f.num_workers), gpus_per_worker: num(f.gpus_per_worker),
      zero_stage: num(f.zero_stage), expert_parallel_size: num(f.expert_parallel_size) }),
  });

  const clearErrors = () => {
    formError.textContent = "";
    for (const el of document.querySelectorAll(".field-error")) el.textContent = "";
    for (const el of document.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
  };
  // The error next to the field its param names (the longest field path it starts with), else above the form.
  const showError = (error, prefix = "") => {
    const param = (error.param || "").replace(/^body\./, "").replace(prefix, "");
    const fieldsByParam = [...document.querySelectorAll("[id^='error-']")].map((el) => el.id.slice(6))
      .filter((p) => param === p || param.startsWith(`${p}.`) || param.startsWith(`${p}[`)).sort((a, b) => b.length - a.length);
    const target = fieldsByParam.length && document.getElementById(`error-${fieldsByParam[0]}`);
    if (target) {
      target.textContent = error.message;
      const control = document.getElementById(`field-${fieldsByParam[0]}`);
      control.setAttribute("aria-invalid", "true");
      control.focus();
    } else {
      formError.textContent = error.param ? `${error.param}: ${error.message}` : error.message;
    }
  };

  uploadButton.addEventListener("click", async () => {
    const file = fileInput.files[0];
    replace(preview);
    if (!file) { uploadStatus.textContent = "Choose a JSONL file first."; return; }
    uploadStatus.className = "muted";
    uploadStatus.textContent = `Uploading ${file.name}…`;
    const form = new FormData();
    form.append("purpose", "fine-tune"); // before the file: the server checks each row as it arrives
    form.append("file", file);
    const mb = (n) => (n / 1e6).toFixed(1);
    const answer = await upload("/v1/files", form, (sent, total) => {
      uploadStatus.textContent = sent < total
        ? `Uploading ${file.name}: ${mb(sent)} / ${mb(total)} MB (${Math.floor((100 * sent) / total)}%)`
        : `${file.name}: sent, the server is storing it…`;
    });
    if (answer.ok) {
      replace(uploadStatus, `${answer.data.filename}: ${answer.data.rows} rows, every one valid (`,
        h("span", { class: "mono id" }, answer.data.id), ").");
      trainingFile.append(h("option", { value: answer.data.id }, `${answer.data.filename} (${answer.data.rows} rows, ${answer.data.id})`));
      validationFile.append(h("option", { value: answer.data.id }, `${answer.data.filename} (${answer.data.rows} rows, ${answer.data.id})`));
      trainingFile.value = answer.data.id;
      return;
    }
    uploadStatus.className = "error";
    uploadStatus.textContent = answer.error.message;
    const bad = Number((/ row (\d+)/.exec(answer.error.message) || [])[1]);
    if (!bad) return;
    // The API names the first refused row: show the rows around it, that one marked with its problem.
    const lines = (await file.text()).split("\n");
    const from = Math.max(0, bad - 1 - Math.floor(PREVIEW_ROWS / 2));
    const rows = lines.slice(from, from + PREVIEW_ROWS).map((line, i) => {
      const number = from + i + 1;
      const isBad = number === bad;
      return h("tr", { class: isBad ? "bad-row" : null, "data-row": number }, h("td", { class: "num" }, number),
        h("td", { class: "mono" }, line.length > 160 ? `${line.slice(0, 160)}…` : line),
        h("td", { class: isBad ? "error" : "muted" }, isBad ? answer.error.message.split(`row ${bad}: `).pop()
          : number < bad ? "ok" : "not checked: the check stops at the first refused row"));
    });
    replace(preview, table([{ text: "Row", num: true }, "Content", "Check"], rows, { id: "rows-table" }));
  });

  planButton.addEventListener("click", async () => {
    clearErrors();
    replace(planOut, h("p", { class: "muted" }, "Planning (the planner builds the model on the meta device)…"));
    const cluster = drop({ nodes: num(f.nodes), gpus_per_node: num(f.gpus_per_node), gpu_memory: f.gpu_memory.value.trim(), nic: f.nic.value.trim() });
    const answer = await api("/v1/fine_tuning/plans", { method: "POST", json: { job: body(), cluster } });
    if (!answer.ok) {
      replace(planOut);
      const param = answer.error.param || "";
      return param.startsWith("cluster.") ? showError(answer.error, "cluster.") : showError(answer.error, "job.");
    }
    replace(planOut, planView(answer.data));
  });

  const form = h("form", { id: "job-form", novalidate: true },
    h("fieldset", {}, h("legend", {}, "Training data"),
      h("div", { class: "row" }, h("label", { for: "upload-file" }, "JSONL file", fileInput), uploadButton), uploadStatus, preview,
      h("div", { class: "row" }, field("training_file", "Training file", trainingFile), field("validation_file", "Validation file", validationFile))),
    h("fieldset", {}, h("legend", {}, "Model and method"),
      h("div", { class: "row" }, field("model", "Base model", f.model), modelList, field("method", "Method", f.method),
        field("suffix", "Name suffix", f.suffix))),
    h("fieldset", {}, h("legend", {}, "LoRA"),
      h("div", { class: "row" }, field("lora.target_modules", "Preset", f.target_modules), field("lora.rank", "Rank", f.rank),
        field("lora.alpha", "Alpha", f.alpha))),
    h("fieldset", {}, h("legend", {}, "Training"),
      h("div", { class: "row" }, field("training.max_steps", "Steps", f.max_steps),
        field("training.global_batch_size", "Global batch", f.global_batch_size),
        field("training.micro_batch_size", "Micro-batch", f.micro_batch_size, "a number or auto"),
        field("training.seq_len", "Sequence length", f.seq_len), field("training.learning_rate", "Learning rate", f.learning_rate),
        field("training.eval_every", "Validate every", f.eval_every),
        field("training.checkpoint_every", "Checkpoint every", f.checkpoint_every))),
    h("fieldset", {}, h("legend", {}, "Parallelism"),
      h("div", { class: "row" }, field("parallelism.num_workers", "Workers", f.num_workers),
        field("parallelism.gpus_per_worker", "GPUs per worker", f.gpus_per_worker),
        field("parallelism.zero_stage", "ZeRO stage", f.zero_stage),
        field("parallelism.expert_parallel_size", "Expert parallel size", f.expert_parallel_size))),
    h("fieldset", {}, h("legend", {}, "Will it fit? (the planner)"),
      h("div", { class: "row" }, field("nodes", "Nodes", f.nodes), field("gpus_per_node", "GPUs per node", f.gpus_per_node, "follows Workers × GPUs per worker"),
        field("gpu_memory", "GPU memory", f.gpu_memory), field("nic", "Node NIC", f.nic), planButton), planOut),
    formError, submit);

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors();
    submit.disabled = true;
    const answer = await api("/v1/fine_tuning/jobs", { method: "POST", json: body() });
    submit.disabled = false;
    if (answer.ok) return location.assign(`/console/jobs/${encodeURIComponent(answer.data.id)}`);
    showError(answer.error);
  });
  page("New job", h("div", { class: "card" }, form));
}

function shapeText(fit) {
  const par = fit.parallelism;
  const split = [["CP", par.context_parallel_size], ["PP", par.pipeline_parallel_size]].filter(([, n]) => n > 1).map(([k, n]) => `, ${k}=${n}`).join("");
  return `EP=${par.expert_parallel_size}${split}, ZeRO-${par.zero_stage}`;
}

function layoutText(fit) {
  return `${fit.parallelism.num_workers} GPUs, ${shapeText(fit)}, checkpointing ${fit.activation_checkpointing ? "on" : "off"}, micro-batch ${fit.micro_batch_size}`;
}

// the planner's estimated steps of the fastest layouts that fit (api.plans.PlannedTime), fastest first
function tradeoffView(plan) {
  const note = (fit) => (JSON.stringify(fit) === JSON.stringify(plan.recommended) ? "recommended" : fit.available ? "" : "not for this job");
  return h("div", {},
    h("p", { class: "muted" }, `Estimated steps (${plan.cluster.gpu_tflops} TFLOP/s per GPU at ${Math.round(plan.cluster.efficiency * 100)} %; estimates, see the plan's assumptions).`,
      plan.runner_up ? ` Runner-up ${shapeText(plan.runner_up)}: ${plan.runner_up_slower}.` : ""),
    table(["layout", "GiB per GPU", "step s", "bubble", "tokens/s per GPU", ""],
      plan.tradeoffs.slice(0, 8).map((fit) => h("tr", {},
        h("th", { scope: "row" }, `${shapeText(fit)}${fit.activation_checkpointing ? ", checkpointing" : ""}`),
        h("td", { class: "num" }, gib(fit.total_bytes)), h("td", { class: "num" }, fit.time.step_seconds.toFixed(1)),
        h("td", { class: "num" }, `${Math.round(fit.time.bubble_fraction * 100)} %`),
        h("td", { class: "num" }, Math.round(fit.time.tokens_per_second_per_gpu).toLocaleString()), h("td", {}, note(fit)))),
      { id: "plan-tradeoffs" }));
}

function planView(plan) {
  const layouts = [["as submitted", plan.submitted], ["recommended", plan.recommended], ["fewest GPUs", plan.fewest_gpus]].filter(([, fit]) => fit);
  const frozen = [...new Set(layouts.flatMap(([, fit]) => Object.keys(fit.bytes.frozen_weights)))].sort();
  const rows = [
    ...frozen.map((label) => [`frozen weights (${label})`, (fit) => gib(fit.bytes.frozen_weights[label] || 0)]),
    ...PLAN_ROWS.map(([key, title]) => [title, (fit) => gib(fit.bytes[key])]),
    ["total per GPU", (fit) => gib(fit.total_bytes)], ["fits", (fit) => (fit.fits ? "yes" : "no")],
  ];
  const model = plan.model;
  return h("div", {},
    h("p", { id: "plan-verdict", class: plan.submitted.fits ? "" : "error" },
      plan.submitted.fits ? `Fits: ${gib(plan.submitted.total_bytes)} per GPU of ${gib(plan.cluster.usable_bytes_per_gpu)} usable.`
        : `Does not fit: ${gib(plan.submitted.total_bytes)} per GPU of ${gib(plan.cluster.usable_bytes_per_gpu)} usable.`,
      plan.fewest_gpus ? ` Smallest layout that fits: ${layoutText(plan.fewest_gpus)}.` : " No layout of this cluster fits."),
    h("p", { class: "muted" }, `${model.model_type}, ${model.parameters.toLocaleString()} parameters, ${model.routed_experts} experts (top-${model.experts_per_token}), seq_len ${plan.seq_len.toLocaleString()}`),
    table(["per GPU", ...layouts.map(([name, fit]) => h("span", {}, name, h("br"), h("span", { class: "muted" }, layoutText(fit))))],
      rows.map(([title, value]) => h("tr", {}, h("th", { scope: "row" }, title), layouts.map(([, fit]) => h("td", { class: "num" }, value(fit))))),
      { id: "plan-table" }),
    plan.tradeoffs.length > 0 && tradeoffView(plan));
}
