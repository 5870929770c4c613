"""Real jobs from the test process: the driver's environment, run_job on the session's Ray head, and what a job
reports recomputed on the plain transformers model: its first train loss, its exported adapter's validation loss."""

from __future__ import annotations

import os
import signal
import time

import torch

from moetune.api import storage
from moetune.api.environment import ENV_CALLBACK_URL, ENV_JOB_TOKEN, ENV_RUN_SPEC
from moetune.api.layout import adapter_uri
from moetune.api.models.job_create import JobCreate
from moetune.api.models.job_run import JobRunSpec
from moetune.api.models.run_config import resolve_run_config
from moetune.workers.data.rows import load_rows
from moetune.workers.data.sampling import step_micro_batches
from moetune.workers.entry.driver import run_job
from moetune.workers.methods.batch import IGNORE
from moetune.workers.methods.sft import collate, tokenize_rows
from moetune.workers.reporting.reporter import Reporter
from moetune.workers.settings import WorkerSettings


def job_run(job_id: str, request: JobCreate, seed: int, output_uri: str) -> JobRunSpec:
    """What the control plane hands a driver for `request`: its run config, resolved as at submission (no plan)."""
    return JobRunSpec(job_id=job_id, config=resolve_run_config(request, seed), output_uri=output_uri)


def driver_env(run: JobRunSpec, receiver) -> dict[str, str]:
    """What the control plane gives a driver: the run spec, and `receiver` (a ReportReceiver) as callback."""
    return {ENV_RUN_SPEC: run.model_dump_json(), ENV_CALLBACK_URL: receiver.url, ENV_JOB_TOKEN: "tok",
            "HF_HUB_OFFLINE": "1"}


def run_in_process(run: JobRunSpec, ray_head, receiver, monkeypatch, worker_env: dict | None = None) -> bool:
    """run_job from this process, connected to the session's Ray head; `worker_env` reaches every Ray worker."""
    import ray

    for name, value in driver_env(run, receiver).items():  # the driver forwards these to its workers
        monkeypatch.setenv(name, value)
    ray.init(address=ray_head.gcs_address, runtime_env={"env_vars": worker_env or {}})
    try:
        settings = WorkerSettings()
        return run_job(run, Reporter(run.job_id, settings.callback_url, settings.job_token), settings)
    finally:
        ray.shutdown()


def kill_a_worker_after(receiver, step: int, ray_head, killed: list) -> None:
    """Once the chief reported `step`, SIGKILLs one of the job's Ray Train worker processes (the newest)."""
    from ray.util.state import list_actors

    def reported(at_least: int) -> bool:
        return any(m["step"] >= at_least for m in receiver.metrics())

    while not reported(1):  # the group is up: look its workers up now, so that the kill itself is immediate
        time.sleep(0.05)
    workers = list_actors(address=ray_head.dashboard_url,
                          filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    while not reported(step):
        time.sleep(0.05)
    pid = max(w.pid for w in workers)
    os.kill(pid, signal.SIGKILL)
    killed.append(pid)


def expected_first_loss(run: JobRunSpec, checkpoint) -> float:
    """Step 1's train loss recomputed on the plain transformers model: token mean over the global batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t, world = run.config.training, run.config.parallelism.data_parallel_size
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    examples, _ = tokenize_rows(tokenizer, load_rows(run.config.training_file, "training_file"), t.seq_len)
    losses, counts = [], []
    with torch.no_grad():
        for rank in range(world):
            for indices in step_micro_batches(len(examples), 0, t.global_batch_size, t.micro_batch_size,
                                              rank, world, run.config.seed):
                batch = collate([examples[i].truncated(t.seq_len_at(1, t.max_steps)) for i in indices],
                                tokenizer.pad_token_id)
                counts.append((batch.labels[:, 1:] != IGNORE).sum().item())
                losses.append(model(**batch.inputs, labels=batch.labels).loss.item() * counts[-1])
    return sum(losses) / sum(counts)


def adapter_valid_loss(run: JobRunSpec, checkpoint: str, tmp_path) -> float:
    """Token-weighted validation loss of the exported adapter on the plain transformers model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = storage.download_dir(adapter_uri(run.output_uri), str(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint), adapter)
    return valid_loss(model, AutoTokenizer.from_pretrained(checkpoint), run.config.validation_file,
                      run.config.training.seq_len)


def valid_loss(model, tokenizer, validation_file: str, seq_len: int) -> float:
    """Token-weighted loss of `model` over the rows of `validation_file`, as the job computes it."""
    model.eval()
    examples, _ = tokenize_rows(tokenizer, load_rows(validation_file, "validation_file"), seq_len)
    total = count = 0.0
    with torch.no_grad():
        for e in examples:
            batch = collate([e], tokenizer.pad_token_id)
            n = (batch.labels[:, 1:] != IGNORE).sum().item()
            total += model(**batch.inputs, labels=batch.labels).loss.item() * n
            count += n
    return total / count
