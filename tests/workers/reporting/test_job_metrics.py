"""A real Prometheus scrapes the exporters of a real EP=2 job on the local Ray head; then every dashboard
panel's PromQL must return data for that job, and the alert rules must load and name scraped metrics."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from moetune.api import storage
from moetune.api.environment import ENV_METRICS_PORT, ENV_METRICS_TARGETS_DIR
from moetune.api.layout import SUMMARY_FILE, report_json_uri
from moetune.api.models.job_create import JobCreate
from moetune.api.models.job_run import JobRunSpec
from moetune.workers.evaluation.generation import prompt_ids
from moetune.workers.evaluation.metrics import token_f1
from moetune.workers.reporting.expert_load import HOT_EXPERTS, LOAD_RATIO_BUCKETS
from moetune.workers.tiny import tiny_rows, write_tiny_checkpoint, write_tiny_dataset
from tests.support import REPO
from tests.support.jobs import job_run, adapter_valid_loss, run_in_process
from tests.support.prometheus import SCRAPE_INTERVAL_S

pytestmark = pytest.mark.ray_job
DASHBOARDS = sorted((REPO / "deploy" / "grafana").glob("*.json"))
CUDA_ONLY = "(CUDA workers only)"  # panel title marker: no data from CPU workers
STEPS = 8
EVAL_ROWS, EVAL_TOKENS = 4, 6


def _answers(model, tokenizer, prompts: list[list[int]]) -> list[str]:
    """transformers' greedy answers, one prompt at a time."""
    with torch.no_grad():
        generated = [model.eval().generate(torch.tensor([ids]), max_new_tokens=EVAL_TOKENS, do_sample=False,
                                           eos_token_id=tokenizer.eos_token_id,
                                           pad_token_id=tokenizer.pad_token_id)[0, len(ids):] for ids in prompts]
    return [tokenizer.decode(g, skip_special_tokens=True) for g in generated]


def _planted_eval_file(base: str, model_dir: Path) -> str:
    """Chat rows whose references are the base model's own answers: step 0 scores 1, and training moves the
    answers away, so the earliest checkpoint is planted as the best one, not the last."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chats = [r["messages"][:-1] for r in tiny_rows(16, seed=5) if "messages" in r][:EVAL_ROWS]
    answers = _answers(AutoModelForCausalLM.from_pretrained(model_dir), tokenizer,
                       [prompt_ids(tokenizer, m) for m in chats])
    rows = "".join(json.dumps({"messages": m, "reference": a}) + "\n" for m, a in zip(chats, answers))
    storage.write_bytes(f"{base}/eval.jsonl", rows.encode())
    return f"{base}/eval.jsonl"


def _run_ep2_job(ray_head, receiver, monkeypatch, bucket: str, tmp_path: Path) -> JobRunSpec:
    base = f"s3://{bucket}"
    storage.upload_dir(write_tiny_checkpoint(str(tmp_path / "model")), f"{base}/model")
    for name, rows, seed in (("train.jsonl", 64, 0), ("valid.jsonl", 8, 1)):
        write_tiny_dataset(str(tmp_path / name), rows, seed=seed)
        storage.write_bytes(f"{base}/{name}", (tmp_path / name).read_bytes())
    evaluation = {"file": _planted_eval_file(base, tmp_path / "model"), "metrics": ["exact_match", "token_f1"],
                  "max_new_tokens": EVAL_TOKENS}
    spec = JobCreate(model=f"{base}/model", training_file=f"{base}/train.jsonl",
                     validation_file=f"{base}/valid.jsonl", lora={"rank": 4, "alpha": 8, "dropout": 0.0},
                     training={"max_steps": STEPS, "eval_every": 2, "global_batch_size": 8, "micro_batch_size": 2,
                               "seq_len": 64, "learning_rate": 1e-3, "checkpoint_every": 2,
                               "select_checkpoint": "best:token_f1"},
                     parallelism={"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 2},
                     evaluation=evaluation)
    run = job_run("ftjob-metrics", spec, 3, f"{base}/out/ftjob-metrics")
    assert run_in_process(run, ray_head, receiver, monkeypatch)
    return run


def _adapter_token_f1(run: JobRunSpec, tmp_path: Path, rows: list[dict]) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    adapter = tmp_path / "adapter"  # downloaded by adapter_valid_loss
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(adapter))
    texts = _answers(model, tokenizer, [prompt_ids(tokenizer, r["messages"]) for r in rows])
    return sum(token_f1(t, r["reference"]) for t, r in zip(texts, rows)) / len(rows)


def _substitute(expr: str, job_id: str, layer: str) -> str:
    """Grafana's variables as Grafana would expand them for this job (4 scrape intervals per rate window)."""
    return (expr.replace("$__rate_interval", f"{4 * SCRAPE_INTERVAL_S}s").replace("$job_id", job_id)
            .replace("$layer", layer))


def _label_values(prometheus, definition: str, job_id: str, window: tuple[float, float]) -> list[str]:
    metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", _substitute(definition, job_id, ".*")).groups()
    series = prometheus.get("series", **{"match[]": metric}, start=window[0], end=window[1])
    return sorted({s[label] for s in series if label in s})


def test_every_dashboard_panel_has_data_from_a_real_ep2_job(prometheus, s3_bucket, ray_head, receiver, tmp_path,
                                                           monkeypatch):
    monkeypatch.setenv(ENV_METRICS_PORT, "0")  # any free port: other jobs may run on this machine
    monkeypatch.setenv(ENV_METRICS_TARGETS_DIR, str(prometheus.targets_dir))
    started = time.time()
    run = _run_ep2_job(ray_head, receiver, monkeypatch, s3_bucket, tmp_path)
    time.sleep(2 * SCRAPE_INTERVAL_S)  # let the last scrapes land
    window = (started, time.time())
    assert not list(prometheus.targets_dir.glob("*.json")), "workers must withdraw their file_sd targets"
    job = run.job_id

    # Labels: every worker series carries job_id, node and rank; both ranks were scraped.
    ranks = _label_values(prometheus, f'label_values(moetune_process_resident_memory_bytes{{job_id="{job}"}}, rank)',
                          job, window)
    assert ranks == ["0", "1"]
    layers = _label_values(prometheus, f'label_values(moetune_moe_load_cv{{job_id="{job}"}}, layer)', job, window)
    assert layers, "no MoE layer reported expert load"

    def last(expr: str) -> list[float]:
        return [float(s["values"][-1][1]) for s in prometheus.query_range(expr, *window)]

    # All-to-all really happened on both ranks, in both directions of every layer.
    assert len(last(f'moetune_alltoall_sent_bytes_total{{job_id="{job}"}} > 0')) == 2 * len(layers)
    assert len(last(f'moetune_alltoall_seconds_total{{job_id="{job}"}} > 0')) == 2 * len(layers)
    # One histogram observation per expert per step; at most HOT_EXPERTS hot experts per layer at any time.
    num_experts = json.loads((tmp_path / "model" / "config.json").read_text())["num_experts"]
    counts = last(f'moetune_moe_expert_load_ratio_count{{job_id="{job}"}}')
    assert len(counts) == len(layers) and all(c > 0 and c % num_experts == 0 for c in counts)
    assert max(last(f'count by (layer) (moetune_moe_hot_expert_load_ratio{{job_id="{job}"}})')) == HOT_EXPERTS
    # Bounded cardinality: the expert-load series do not grow with the number of experts.
    per_layer = last(f'count by (layer) ({{job_id="{job}", __name__=~"moetune_moe_.*"}})')
    assert max(per_layer) == len(LOAD_RATIO_BUCKETS) + 6 + HOT_EXPERTS
    # Workers wait for a scrape of their counters' zeros before the first step and of their final values
    # before they stop serving, so even a job shorter than a scrape interval is counted whole.
    (steps,) = prometheus.query_range(f'moetune_train_step{{job_id="{job}"}}', *window)
    seen = [float(v) for _, v in steps["values"]]
    assert seen == sorted(seen) and seen[-1] == STEPS
    summary = json.loads(storage.read_text(storage.join(run.output_uri, SUMMARY_FILE)))
    (tokens,) = prometheus.query_range(f'moetune_train_tokens_total{{job_id="{job}"}}', *window)
    assert [float(tokens["values"][i][1]) for i in (0, -1)] == [0, summary["trained_tokens"]]
    assert last(f'moetune_train_grad_accum_steps{{job_id="{job}"}}') == [2.0, 2.0]

    # Every panel's every query returns data for this job (CUDA-only panels: none from CPU workers).
    checked = 0
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for variable in dashboard["templating"]["list"]:
            if variable["type"] == "query":
                assert _label_values(prometheus, variable["definition"], job, window), (path.name, variable["name"])
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = _substitute(target["expr"], job, layers[0])
                result = prometheus.query_range(expr, *window)
                if CUDA_ONLY in panel["title"] and not torch.cuda.is_available():
                    assert "moetune_gpu_" in expr and not result, (path.name, panel["title"])
                else:
                    assert result, f"{path.name}: panel {panel['title']!r} has no data for {expr}"
                    checked += 1
    assert checked >= 20

    # The adaptation report (valid against the published schema) holds this job's figures: expert-load imbalance
    # of every MoE layer at every step, both ranks' memory, the all-to-all share, the alignment of the swapped
    # operators (expert compute under EP=2 too) and the generation-based evaluation.
    report = json.loads(storage.read_text(report_json_uri(run.output_uri)))
    jsonschema.validate(report, json.loads((REPO / "docs" / "adaptation_report.schema.json").read_text()))
    assert report["expert_imbalance"]["layers"] == layers and report["expert_imbalance"]["steps"] == [*range(1, 9)]
    assert len(report["memory"]["peak_mb_per_rank"]) == 2 and 0 < report["throughput"]["alltoall_share"] < 1
    assert {"kda", "experts"} <= {r["op"] for r in report["alignment"]} and all(r["ok"] for r in report["alignment"])
    assert len(last(f'moetune_eval_score{{job_id="{job}"}}')) == 2

    # Evaluation at step 0 is the base model's: its answers are the references, so training can only move away
    # from them and the best checkpoint (the earliest of equal scores) is planted before the last step. The
    # exported adapter is that checkpoint's: on the transformers model (PEFT) it has that step's validation loss
    # (not the last step's) and answers with that step's scores.
    evaluation = report["evaluation"]
    assert evaluation["base"] == {"exact_match": 1.0, "token_f1": 1.0} and evaluation["steps"] == [2, 4, 6, 8]
    f1 = dict(zip(evaluation["steps"], evaluation["scores"]["token_f1"]))
    best = max(f1, key=f1.get)
    assert report["selected_step"] == best != STEPS, f1
    listed = {c.report.step_number: c.report.metrics for c in receiver.reports if c.report.kind == "checkpoint"}
    assert {step: m.model_extra["eval_token_f1"] for step, m in listed.items()} == f1
    valid = {s["step"]: s["valid_loss"] for s in report["steps"] if s.get("valid_loss") is not None}
    assert abs(valid[best] - valid[STEPS]) > 1e-2, valid  # the two states are told apart
    assert adapter_valid_loss(run, str(tmp_path / "model"), tmp_path) == pytest.approx(valid[best], abs=1e-3)
    rows = [json.loads(line) for line in storage.read_text(run.config.evaluation.file).splitlines()]
    assert _adapter_token_f1(run, tmp_path, rows) == pytest.approx(f1[best])

    # The shipped alert rules loaded and evaluated without error; the training group's only name metrics the
    # workers export (the control plane's group is checked against its own /metrics in tests/service).
    groups = prometheus.get("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert rules and all(r["health"] == "ok" for r in rules), rules
    scraped = set(prometheus.get("label/__name__/values"))
    for rule in next(g for g in groups if g["name"] == "moetune-training")["rules"]:
        for name in set(re.findall(r"moetune_[a-z_]+", rule["query"])):
            assert name in scraped or name.startswith("moetune_gpu_"), (rule["name"], name)
