"""The adaptation report, built by the driver when the job has succeeded: from the run spec, the LoRA coverage the
driver checked, the workers' summary.json (with the alignment table) and metrics.jsonl (each step's figures), and
the checkpoints in storage. The driver builds it (not the control plane) because everything it needs is in the job's
output already, the versions are those of the training stack itself, and the plotting library stays out of the
control plane; the page (report_page) and the JSON go next to the adapter, `<output>/report/`."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import time

from moetune.api import storage
from moetune.api.layout import metrics_uri, report_html_uri, report_json_uri, step_dir
from moetune.api.models.job_run import JobRunSpec
from moetune.api.report import EVAL_PREFIX, AdaptationReport
from moetune.workers.reporting.report_page import render_page
from moetune.workers.settings import WorkerSettings

_PACKAGES = ("moetune", "torch", "transformers", "deepspeed", "peft", "triton")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The image's commit, else that of a source checkout moetune runs from, else None."""
    if commit := WorkerSettings().git_commit:
        return commit
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        done = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def versions(gpus_per_worker: int) -> dict[str, str | None]:
    found = {name: _version(name) for name in _PACKAGES}
    found["kernel_backend"] = "triton (CUDA)" if gpus_per_worker > 0 else "torch (CPU)"
    found["git_commit"] = _git_commit()
    return found


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _evaluation(run: JobRunSpec, summary: dict, history: list[dict]) -> dict | None:
    if run.config.evaluation is None:
        return None
    metrics = list(run.config.evaluation.metrics)
    evaluated = [r for r in history if f"{EVAL_PREFIX}{metrics[0]}" in r]
    base = summary.get("base_evaluation")
    return {"metrics": metrics, "steps": [r["step"] for r in evaluated],
            "base": {k.removeprefix(EVAL_PREFIX): v for k, v in base.items()} if base else None,
            "scores": {m: [r[f"{EVAL_PREFIX}{m}"] for r in evaluated] for m in metrics}}


def build_report(run: JobRunSpec, lora_coverage: list[dict], summary: dict, history: list[dict],
                 kept_steps: set[int]) -> AdaptationReport:
    train = [r.get("train_seconds", 0.0) for r in history]
    evaluation = [r.get("eval_seconds", 0.0) for r in history]
    alltoall = [r.get("alltoall_share", 0.0) * r.get("train_seconds", 0.0) for r in history]
    context = [r["context_share"] * r.get("train_seconds", 0.0) for r in history if "context_share" in r]
    staged = [r for r in history if r.get("pipeline_idle_seconds")]
    stages = range(len(staged[0]["pipeline_idle_seconds"])) if staged else range(0)
    staged_seconds = max(sum(r.get("train_seconds", 0.0) for r in staged), 1e-9)
    peaks = [r["memory_peak_mb"] for r in history if r.get("memory_peak_mb")]
    with_load = [r for r in history if r.get("expert_imbalance")]
    layers = list(with_load[0]["expert_imbalance"]) if with_load else []
    valid = [r["valid_loss"] for r in history if r.get("valid_loss") is not None]
    return AdaptationReport.model_validate({
        "job_id": run.job_id, "model": run.config.model, "created_at": time.time(),
        "versions": versions(run.config.parallelism.gpus_per_worker),
        "alignment": summary.get("alignment"), "lora_coverage": lora_coverage, "steps": history,
        "throughput": {"tokens_per_second": _mean([r["tokens_per_second"] for r in history]),
                       "step_seconds": _mean(train),
                       "eval_share": sum(evaluation) / max(sum(train) + sum(evaluation), 1e-9),
                       "alltoall_share": sum(alltoall) / max(sum(train), 1e-9),
                       "context_share": sum(context) / max(sum(train), 1e-9) if context else None,
                       "pipeline_idle_share": [sum(r["pipeline_idle_seconds"][s] for r in staged) / staged_seconds
                                               for s in stages] if staged else None,
                       "pipeline_sent_mb": [_mean([r["pipeline_sent_mb"][s] for r in staged]) for s in stages]
                                           if staged else None},
        "memory": {"peak_mb_per_rank": [max(p[rank] for p in peaks) for rank in range(len(peaks[0]))] if peaks
                   else [], "budget_mb": history[-1].get("memory_budget_mb")},
        "expert_imbalance": {"layers": layers, "steps": [r["step"] for r in with_load],
                             "ratio": [[r["expert_imbalance"][layer] for r in with_load] for layer in layers]}
                            if layers else None,
        "checkpoints": [{"step": r["step"], "name": r["checkpoint"], "kept": r["step"] in kept_steps,
                         "train_loss": r["train_loss"], "valid_loss": r.get("valid_loss")}
                        for r in history if r.get("checkpoint") == step_dir(r["step"])],
        "evaluation": _evaluation(run, summary, history),
        "selected_step": summary.get("selected_step"),
        "resumes": [r["resumed_from_step"] for r in history if r.get("resumed_from_step")],
        "first_train_loss": history[0]["train_loss"], "last_train_loss": history[-1]["train_loss"],
        "last_valid_loss": valid[-1] if valid else None,
        "reproduce": {"job": run.config.request_body(), "seed": run.config.seed},
    })


def write_report(run: JobRunSpec, lora_coverage: list[dict], summary: dict, kept_steps: set[int]) -> AdaptationReport:
    """Builds the report of a finished job from its output (`kept_steps`: its complete checkpoints) and writes
    report.json and report.html there."""
    lines = storage.read_text(metrics_uri(run.output_uri)).splitlines()
    history = [json.loads(line) for line in lines if line.strip()]
    report = build_report(run, lora_coverage, summary, history, kept_steps)
    storage.write_bytes(report_json_uri(run.output_uri), report.model_dump_json(indent=1).encode())
    storage.write_bytes(report_html_uri(run.output_uri), render_page(report).encode())
    return report
