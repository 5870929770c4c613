"""What a job leaves under its output URI (JobRunSpec.output_uri, i.e. <output_uri>/<job id>):

    adapter/                      the trained LoRA adapter (the job's fine_tuned_model)
    metrics.jsonl                 one line of metrics per logged step (the job's result file)
    summary.json                  written last on success: step, losses, trained_tokens
    report/report.json, .html     the adaptation report (api.report), written by the driver on success
    checkpoints/step-<N>/         one checkpoint; complete (offered for resume and download) only once its
        checkpoint.json           manifest, written last after every rank's files, is there

The workers write this layout; the control plane reads it (the summary when the driver's result report was
lost, the manifest before it lists a checkpoint).
"""

from __future__ import annotations

import re
from typing import Any

from moetune.api.models.job_run import ResultReport
from moetune.api.storage import join

ADAPTER_DIR = "adapter"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINTS_DIR = "checkpoints"
REPORT_DIR = "report"
CHECKPOINT_MANIFEST = "checkpoint.json"
STEP_DIR_GLOB = "step-*"  # matches every checkpoint directory name (and possibly others: check with step_of)
_STEP_DIR = re.compile(r"step-(\d+)")


def adapter_uri(output_uri: str) -> str:
    return join(output_uri, ADAPTER_DIR)


def metrics_uri(output_uri: str) -> str:
    return join(output_uri, METRICS_FILE)


def summary_uri(output_uri: str) -> str:
    return join(output_uri, SUMMARY_FILE)


def report_json_uri(output_uri: str) -> str:
    return join(output_uri, REPORT_DIR, "report.json")


def report_html_uri(output_uri: str) -> str:
    return join(output_uri, REPORT_DIR, "report.html")


def checkpoints_uri(output_uri: str) -> str:
    return join(output_uri, CHECKPOINTS_DIR)


def step_dir(step: int) -> str:
    """The directory name of the checkpoint at `step`: `step-<N>`."""
    return f"step-{step}"


def step_of(dirname: str) -> int | None:
    """The step of a checkpoint directory name (`step-<N>`), None for any other name."""
    match = _STEP_DIR.fullmatch(dirname)
    return int(match.group(1)) if match else None


def checkpoint_uri(output_uri: str, step: int) -> str:
    return join(output_uri, CHECKPOINTS_DIR, step_dir(step))


def manifest_uri(checkpoint: str) -> str:
    """The manifest of the checkpoint whose URI is `checkpoint` (as checkpoint_uri() spells it)."""
    return join(checkpoint, CHECKPOINT_MANIFEST)


def result_from_summary(output_uri: str, summary: dict[str, Any]) -> ResultReport:
    """The success result of a job whose summary.json holds `summary` (the driver sends it; the control plane
    rebuilds it when that report was lost)."""
    return ResultReport(status="succeeded", fine_tuned_model=adapter_uri(output_uri),
                        result_files=[metrics_uri(output_uri)], trained_tokens=summary.get("trained_tokens"))
