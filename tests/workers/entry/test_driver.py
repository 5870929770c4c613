"""The driver for real: fail-fast validation, and LoRA jobs on the local Ray head over the S3 server. (A ZeRO-2 job
through Ray's Jobs API is the control plane's job in tests/e2e/test_jobs_end_to_end.py, which checks it as
closely.)"""

import json
import math
import os
import subprocess
import sys
import time

import pytest

from moetune.api import storage
from moetune.api.models.job_create import JobCreate
from moetune.api.models.job_run import JobRunSpec
from moetune.workers.settings import WorkerSettings
from moetune.workers.entry.driver import root_cause, run_job
from moetune.workers.errors import JobError
from moetune.workers.reporting.reporter import Reporter
from tests.support.jobs import job_run, adapter_valid_loss, driver_env, expected_first_loss, run_in_process

TRAINING = {"learning_rate": 3e-3, "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 128}


def _run_spec(base: str, job_id: str, training: dict, zero_stage: int, lora: dict | None = None,
              **spec) -> JobRunSpec:
    create = JobCreate(
        model=f"{base}/models/tiny", training_file=f"{base}/data/train.jsonl",
        validation_file=f"{base}/data/valid.jsonl", lora={"rank": 8, "alpha": 16, "dropout": 0.0, **(lora or {})},
        training={**TRAINING, **training}, parallelism={"num_workers": 2, "zero_stage": zero_stage}, **spec)
    return job_run(job_id, create, 3, f"{base}/out/{job_id}")


# ------------------------------------------------------------------ fail fast


def test_malformed_row_fails_before_any_worker_starts(assets, receiver):
    lines = storage.read_text(f"{assets}/data/train.jsonl").splitlines()
    lines[6] = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 7}]})
    storage.write_bytes(f"{assets}/data/train.jsonl", "\n".join(lines).encode())
    run = _run_spec(assets, "ftjob-badrow", {"max_steps": 2}, zero_stage=2)

    proc = subprocess.run([sys.executable, "-m", "moetune.workers.entry.driver"],
                          env={**os.environ, **driver_env(run, receiver)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    # refused before the driver started any worker (its "Starting N workers" event), not by a timer: the suite's
    # workers share 2 cores, so a wall-time bound only measured the contention
    assert not any(e.message.startswith("Starting ") for e in receiver.of_kind("event")), receiver.reports
    (result,) = receiver.of_kind("result")
    assert result.status == "failed"
    assert (result.error.code, result.error.param) == ("invalid_training_file", "training_file")
    assert result.error.message == (f"training_file {assets}/data/train.jsonl row 7: "
                                    "'messages[1].content' must be a string or a non-empty list of content parts")
    assert "Traceback" not in result.error.message


def test_missing_model_fails_fast(assets, receiver):
    run = _run_spec(assets, "ftjob-nomodel", {"max_steps": 2}, zero_stage=2).model_copy()
    run.config.model = f"{assets}/models/absent"
    assert not run_job(run, Reporter(run.job_id, callback_url=receiver.url, token="t"), WorkerSettings())
    (result,) = receiver.of_kind("result")
    assert (result.error.code, result.error.param) == ("model_not_found", "model")


def test_worker_job_errors_keep_code_and_param():
    import pickle

    from ray.train import WorkerGroupError

    from moetune.workers.errors import DatasetError

    for error in (JobError("c", "m", "p"), DatasetError("training_file", "row 2: bad")):
        copy = pickle.loads(pickle.dumps(error))  # how worker failures reach the driver
        assert (type(copy), copy.code, copy.message, copy.param) == (type(error), error.code, error.message,
                                                                     error.param)

    inner = JobError("invalid_target_modules", "no linear module named 'wq'", "lora.target_modules")
    error = WorkerGroupError("rank 0 failed", {0: inner, 1: RuntimeError("peer gone")})
    cause = root_cause(error)
    assert (cause.code, cause.param, cause.message) == (inner.code, inner.param, inner.message)
    assert root_cause(RuntimeError("boom\nline two")).message == "RuntimeError: line two"


def test_the_coverage_warnings_of_the_seed_recipe_reach_the_control_plane_as_warn_events(receiver):
    """The seed documents' recipe leaves a kimi_linear model's routed experts unadapted: a `warn` event the
    control plane accepts (the driver once sent level "warning", which failed every job whose coverage warns)."""
    from moetune.api.models.lora import LoraSpec
    from moetune.workers.entry.driver import report_coverage
    from moetune.workers.families import REGISTRY
    from moetune.workers.lora.peft_lora import check_targets_on_config

    spec = LoraSpec(target_modules=["q_proj", "v_proj", "gate_proj"])
    coverage = check_targets_on_config(REGISTRY["kimi_linear"].tiny_config().to_dict(), spec)
    report_coverage(Reporter("ftjob-coverage", callback_url=receiver.url, token="t"), coverage, spec)
    summary, *warnings = receiver.of_kind("event")
    assert summary.level == "info" and summary.data["trainable_parameters"] == coverage.trainable
    assert [(e.level, e.data["layer_type"]) for e in warnings] == [("warn", "routed experts")]


# ------------------------------------------------------------------ real jobs on Ray


@pytest.mark.ray_job
def test_zero3_job_resumes_exactly(assets, ray_head, receiver, tiny_checkpoint, tmp_path, monkeypatch):
    """ZeRO-3 as a whole job (ZeRO-1's checkpoints and resume are checked in process: tests/workers/experts), with
    activation checkpointing and a staged context length (32 tokens for steps 1-2, then 128). LoRA on the attention
    preset only: its coverage warnings (no dense MLP, no shared expert adapted) are events, the job goes on."""
    zero_stage = 3
    stages = [{"until_step": 2, "seq_len": 32}, {"seq_len": 128}]
    run = _run_spec(assets, f"ftjob-zero{zero_stage}", {"max_steps": 4, "checkpoint_every": 2,
                                                        "activation_checkpointing": True, "seq_len_schedule": stages},
                    zero_stage=zero_stage, lora={"target_modules": "attention"})
    assert run_in_process(run, ray_head, receiver, monkeypatch)
    warned = [e.data["layer_type"] for e in receiver.of_kind("event") if e.level == "warn" and e.data]
    assert warned == ["dense MLP", "shared experts"]
    messages = [e.message for e in receiver.of_kind("event")]
    assert any(m.startswith("Activation checkpointing: each decoder layer") for m in messages)
    assert [m for m in messages if m.startswith("Context length")] == [
        "Context length 32 tokens from step 1", "Context length 128 tokens from step 3"]
    metrics = receiver.metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    tokens = [b["trained_tokens"] - a["trained_tokens"] for a, b in zip([{"trained_tokens": 0}] + metrics, metrics)]
    assert max(tokens[:2]) <= 8 * 32 < min(tokens[2:])  # 8 rows a step, cut to 32 tokens, then longer
    assert metrics[0]["train_loss"] == pytest.approx(expected_first_loss(run, tiny_checkpoint), abs=1e-4)
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"] and math.isfinite(metrics[-1]["valid_loss"])
    assert adapter_valid_loss(run, tiny_checkpoint, tmp_path) == pytest.approx(metrics[-1]["valid_loss"], abs=1e-3)
    # the exported config names its base by URI (what PEFT, vLLM and `moetune models download` read)
    config = json.loads(storage.read_text(f"{run.output_uri}/adapter/adapter_config.json"))
    assert config["base_model_name_or_path"] == run.config.model

    # Resubmitted without its step-4 checkpoint, the job resumes from step 2 (this stage's optimizer and LoRA
    # state) and repeats steps 3 and 4 exactly.
    storage.write_bytes(f"{run.output_uri}/checkpoints/step-4/checkpoint.json", b"{}")  # no longer complete
    receiver.reports.clear()
    assert run_in_process(run, ray_head, receiver, monkeypatch)
    again = receiver.metrics()
    assert [m["step"] for m in again] == [3, 4]
    assert [m["train_loss"] for m in again] == pytest.approx([m["train_loss"] for m in metrics[2:]], abs=1e-5)
    # Neither run started Ray Data's actor (workers.loop.trainer): the state API lists dead actors too
    from ray.util.state import list_actors

    assert not list_actors(address=ray_head.dashboard_url, filters=[("class_name", "=", "DatasetManager")])


@pytest.mark.ray_job
def test_job_error_inside_a_worker_reaches_the_result(assets, ray_head, receiver, monkeypatch):
    long_prompt = {"messages": [{"role": "user", "content": "x" * 64}, {"role": "assistant", "content": "a"}]}
    storage.write_bytes(f"{assets}/data/train.jsonl", (json.dumps(long_prompt) + "\n").encode() * 8)
    run = _run_spec(assets, "ftjob-noloss", {"max_steps": 2, "seq_len": 16}, zero_stage=2)
    assert not run_in_process(run, ray_head, receiver, monkeypatch)
    (result,) = receiver.of_kind("result")
    assert (result.error.code, result.error.param) == ("invalid_training_file", "training_file")
    assert result.error.message.endswith("no row has a trained token within seq_len=16")


@pytest.mark.ray_job
def test_workers_ray_cannot_place_fail_the_job_after_the_placement_timeout(assets, ray_head, receiver, monkeypatch):
    """More workers than the head has CPUs (a cluster that filled up after the scheduler looked): Ray Train would
    wait, and retry, forever; the job fails once the placement timeout has passed, naming it."""
    monkeypatch.setenv("MOETUNE_PLACEMENT_TIMEOUT_S", "2")
    run = _run_spec(assets, "ftjob-unplaced", {"max_steps": 2, "global_batch_size": 64}, zero_stage=2)
    run.config.parallelism.num_workers = 64
    started = time.monotonic()
    assert not run_in_process(run, ray_head, receiver, monkeypatch)
    (result,) = receiver.of_kind("result")
    assert (result.error.code, result.error.param) == ("unschedulable", "parallelism")
    assert result.error.message.startswith("parallelism: Ray did not place the job's 64 workers within 2 s "
                                           "(setting MOETUNE_PLACEMENT_TIMEOUT_S)")
    assert time.monotonic() - started < 60


def test_a_malformed_evaluation_row_fails_the_checks_with_file_row_and_field(assets):
    """evaluation.file is read with the training rows' chat rules (a tool turn is a turn) before any worker starts."""
    from moetune.workers.entry.checks import validate
    from moetune.workers.errors import DatasetError

    uri = f"{assets}/data/eval.jsonl"
    ask = [{"role": "user", "content": "2+2?"}, {"role": "tool", "content": "4"}]
    storage.write_bytes(uri, (json.dumps({"messages": ask, "reference": "4"}) + "\n"
                              + json.dumps({"messages": ask}) + "\n").encode())
    run = _run_spec(assets, "ftjob-badeval", {"max_steps": 2}, zero_stage=2,
                    evaluation={"file": uri, "metrics": ["exact_match"]})
    with pytest.raises(DatasetError) as failed:
        validate(run, WorkerSettings())
    assert (failed.value.code, failed.value.param) == ("invalid_evaluation_file", "evaluation.file")
    assert failed.value.message == (f"evaluation.file {uri} row 2: no reference: give 'reference' or end the "
                                    "messages with the assistant's answer")
