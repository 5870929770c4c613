"""Real jobs: HTTP -> control plane -> Ray Jobs -> Ray Train workers -> DeepSpeed -> adapter in S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import jsonschema
import openai
import pytest
import s3fs
import yaml
from ray.job_submission import JobStatus as RayJobStatus
from ray.job_submission import JobSubmissionClient

from moetune.api.models.job_create import JobCreate
from moetune.api.models.responses import JobStatus
from tests.support import REPO
from tests.support.control_plane import TOKENS

pytestmark = pytest.mark.ray_job
REPORT_SCHEMA = REPO / "docs" / "adaptation_report.schema.json"


def _spec(assets, **training) -> JobCreate:
    return JobCreate(
        model=assets["model"],
        training_file=assets["training_file"],
        validation_file=assets["validation_file"],
        seed=3,
        lora={"rank": 8, "alpha": 16},
        training={"max_steps": 12, "learning_rate": 3e-3, "global_batch_size": 4, "micro_batch_size": 1,
                  "seq_len": 96, **training},
        parallelism={"num_workers": 2, "zero_stage": 2},
    )


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _openai(control_plane: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{control_plane}/v1", api_key=TOKENS["tenant-a"], max_retries=0)


def _loss_on_rows(model, tokenizer, rows: list[dict]) -> float:
    import torch

    texts = [r["text"] for r in rows if "text" in r][:8]
    batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=96)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        return model(**batch, labels=labels).loss.item()


def test_job_trains_streams_events_and_exports_a_loadable_adapter(client_a, control_plane, tiny_assets, tmp_path):
    """Also the whole ZeRO-2 job through Ray's Jobs API as tests/workers/entry checks a job run in its process:
    step 1's loss recomputed on the plain model, the checkpoints' contents, the result, the adapter's valid loss.
    Its two workers split every sequence (context_parallel_size 2: Kimi-Linear's KDA state and MLA keys cross the
    cut), so a context-parallel job runs here from submission to the exported adapter."""
    from moetune.api import storage
    from tests.support.jobs import adapter_valid_loss, expected_first_loss, job_run

    spec = _spec(tiny_assets, eval_every=6, checkpoint_every=4, keep_checkpoints=2)
    spec = spec.model_copy(update={"parallelism": spec.parallelism.model_copy(update={"context_parallel_size": 2})})
    job = client_a.jobs.create(spec)
    assert job.status in (JobStatus.validating_files, JobStatus.queued)

    events = list(client_a.jobs.stream_events(job.id))  # the live SSE stream ends when the job does
    job = client_a.jobs.retrieve(job.id)
    assert job.status == JobStatus.succeeded, (job.error, [e.message for e in events][-10:])

    assert any(e.message.startswith("Loading model") for e in events)
    assert any(e.message.startswith("Training started: 12 steps on 2 workers") for e in events)
    assert any(e.message.startswith("Custom kernels swapped in: apply_kda_kernels") for e in events)
    metrics = [e.data for e in events if e.type == "metrics" and e.data and e.data.get("train_loss") is not None]
    assert [m["step"] for m in metrics] == list(range(1, 13))
    first, last = metrics[0]["train_loss"], metrics[-1]["train_loss"]
    print(f"train loss {first:.3f} -> {last:.3f}; valid loss {metrics[5]['valid_loss']:.3f} -> "
          f"{metrics[-1]['valid_loss']:.3f}")
    run = job_run(job.id, spec, job.seed, job.output_uri)
    assert first == pytest.approx(expected_first_loss(run, tiny_assets["local_model"]), abs=1e-4)
    assert last < 4.0 < 5.0 < first  # from the untrained model's loss, learnt (5.86 -> 3.55 when written)
    assert metrics[5]["valid_loss"] > metrics[-1]["valid_loss"]  # evaluated at steps 6 and 12
    assert all(m["learning_rate"] > 0 and m["tokens_per_second"] > 0 for m in metrics)
    assert job.trained_tokens == metrics[-1]["trained_tokens"] > 0
    assert job.progress.step == 12
    assert job.result_files == [f"{job.output_uri}/metrics.jsonl"]
    assert len(storage.read_text(job.result_files[0]).splitlines()) == 12

    # Checkpoints at steps 4, 8 and 12; keep_checkpoints=2 retired step 4 from the list and from storage.
    checkpoints = client_a.jobs.checkpoints(job.id).data
    assert sorted(c.step_number for c in checkpoints) == [8, 12]
    assert any(e.message.startswith("Checkpoint saved at step 12") and e.message.endswith("retired step-4")
               for e in events)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["MOETUNE_S3_ENDPOINT_URL"]})
    for ckpt in checkpoints:
        assert ckpt.fine_tuned_model_checkpoint == f"{job.output_uri}/checkpoints/step-{ckpt.step_number}"
        assert fs.ls(ckpt.fine_tuned_model_checkpoint), ckpt.fine_tuned_model_checkpoint
        assert storage.exists(f"{ckpt.fine_tuned_model_checkpoint}/adapter/adapter_model.safetensors")
        assert storage.exists(f"{ckpt.fine_tuned_model_checkpoint}/deepspeed/latest")
    # The official openai SDK reads the same job: events newest first over its pages, checkpoints newest first.
    oa = _openai(control_plane)
    assert [e.id for e in oa.fine_tuning.jobs.list_events(job.id, limit=40)] == [e.id for e in reversed(events)]
    assert [c.step_number for c in oa.fine_tuning.jobs.checkpoints.list(job.id)] == [12, 8]
    step4 = checkpoints[0].fine_tuned_model_checkpoint.removeprefix("s3://").rsplit("/", 1)[0] + "/step-4"
    fs.invalidate_cache()
    assert not fs.exists(step4)

    # The adapter loads onto the plain transformers model and changes what it predicts.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert job.fine_tuned_model_uri == f"{job.output_uri}/adapter" and job.fine_tuned_model.endswith(f":{job.id}")
    adapter_dir = tmp_path / "adapter"
    fs.get(job.fine_tuned_model_uri.removeprefix("s3://") + "/", str(adapter_dir), recursive=True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter_dir.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["local_model"])
    rows = [json.loads(line) for line in Path(tiny_assets["local_train"]).read_text().splitlines()]
    base_loss = _loss_on_rows(AutoModelForCausalLM.from_pretrained(tiny_assets["local_model"]), tokenizer, rows)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_assets["local_model"]), adapter_dir)
    assert _loss_on_rows(tuned, tokenizer, rows) < base_loss - 0.1
    # and reproduces the job's last validation loss there
    assert adapter_valid_loss(run, str(tiny_assets["local_model"]), tmp_path / "reloaded") == pytest.approx(
        metrics[-1]["valid_loss"], abs=1e-3)

    # The precision alignment ran before step 1 and passed; its table is in the adaptation report, which is
    # served as JSON (valid against the published schema) and as a page with its plots.
    (aligned,) = [e for e in events if e.message.startswith("Precision alignment")]
    assert aligned.level == "info" and "kda" in [r["op"] for r in aligned.data["alignment"]], aligned.message
    report = client_a.jobs.report(job.id)
    jsonschema.validate(report.model_dump(mode="json"), json.loads(REPORT_SCHEMA.read_text()))
    assert [r.model_dump(exclude_none=True) for r in report.alignment] == aligned.data["alignment"]
    assert [(s.step, s.train_loss) for s in report.steps] == [(m["step"], m["train_loss"]) for m in metrics]
    assert [(c.name, c.kept) for c in report.checkpoints] == [("step-4", False), ("step-8", True), ("step-12", True)]
    assert report.last_valid_loss == metrics[-1]["valid_loss"] and len(report.memory.peak_mb_per_rank) == 2
    assert report.reproduce.job["seed"] == 3 and report.versions["transformers"] and report.versions["torch"]
    assert 0 < report.throughput.eval_share < 1 and report.throughput.tokens_per_second > 0
    assert 0 < report.throughput.context_share < 1  # the slowest rank's share of training in CP exchanges
    page = client_a.jobs.report_html(job.id)
    assert all(f'id="plot-{name}"><svg' in page for name in ("loss", "throughput", "memory")), page[:300]


def test_openai_sdk_uploads_creates_and_cancels_a_running_job(client_a, control_plane, tiny_assets, ray_head):
    """OpenAI's flow, unmodified: files.create -> fine_tuning.jobs.create(training_file="file-...") -> events ->
    cancel; moetune's own sections travel in extra_body."""
    oa = _openai(control_plane)
    train = oa.files.create(file=("train.jsonl", Path(tiny_assets["local_train"]).read_bytes()), purpose="fine-tune")
    spec = _spec(tiny_assets, max_steps=2000).model_dump(mode="json", exclude_none=True)
    job = oa.fine_tuning.jobs.create(
        model=spec["model"], training_file=train.id, seed=spec["seed"],
        method={"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 4}}},
        extra_body={section: spec[section] for section in ("lora", "training", "parallelism")})
    _wait_for(lambda: any(e.type == "metrics" for e in oa.fine_tuning.jobs.list_events(job.id, limit=100).data),
              240, "the first training step")

    cancelled = oa.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == JobStatus.cancelled

    ray_jobs = JobSubmissionClient(ray_head.dashboard_url)
    _wait_for(lambda: ray_jobs.get_job_status(f"moetune-{job.id}-1") == RayJobStatus.STOPPED, 90,
              "Ray to stop the job")
    time.sleep(2)  # late reports from dying workers must not resurrect the job
    assert client_a.jobs.retrieve(job.id).status == JobStatus.cancelled
    assert oa.fine_tuning.jobs.list_events(job.id, limit=1).data[0].message == "Job cancelled"  # no steps after it


def test_malformed_row_fails_the_job_with_the_row_number(client_a, tiny_assets, s3_bucket):
    rows = ['{"text": "fine"}', '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
            "{not json", '{"text": "x"}']
    boto3.client("s3", endpoint_url=os.environ["MOETUNE_S3_ENDPOINT_URL"]).put_object(
        Bucket=s3_bucket, Key="bad.jsonl", Body="\n".join(rows).encode())
    spec = _spec(tiny_assets).model_copy(update={"training_file": f"s3://{s3_bucket}/bad.jsonl",
                                                 "validation_file": None})
    job = client_a.jobs.wait(client_a.jobs.create(spec).id, timeout=180, poll_interval=0.2)

    assert job.status == JobStatus.failed
    assert job.error.param == "training_file"
    assert "row 3" in job.error.message and "bad.jsonl" in job.error.message
    assert "Traceback" not in job.error.message


def test_cli_submits_lists_and_cancels(control_plane, tiny_assets, tmp_path):
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(_spec(tiny_assets, max_steps=2000).model_dump(mode="json", exclude_none=True)))
    moetune = [str(Path(sys.executable).with_name("moetune")), "--url", control_plane, "--token", "tok-b"]

    def run(*args):
        return subprocess.run([*moetune, *args], capture_output=True, text=True, timeout=60)

    submitted = run("submit", str(spec_file))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[1]
    assert job_id.startswith("ftjob-")
    assert job_id in run("jobs", "list").stdout
    assert json.loads(run("jobs", "get", job_id).stdout)["id"] == job_id
    assert "cancelled" in run("jobs", "cancel", job_id).stdout
    assert "Job cancelled" in run("jobs", "events", job_id).stdout

    missing = run("jobs", "get", "ftjob-doesnotexist")
    assert missing.returncode != 0 and "404" in missing.stderr and "Traceback" not in missing.stderr
