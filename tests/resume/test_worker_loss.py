"""Worker loss for real: SIGKILL one Ray Train worker mid-run; Ray Train restarts the group, which resumes from the
newest complete checkpoint (DeepSpeed state + expert-LoRA shards in S3) and finishes the job."""

import os
import signal
import threading
import time

import pytest

from api.models import JobCreate, JobRunSpec
from tests.workers.test_driver import _adapter_valid_loss, _run_in_process
from workers import storage

CHECKPOINT_EVERY, STEPS, KILL_AFTER = 4, 12, 6


def _kill_a_worker_after(receiver, step: int, ray_head, killed: list) -> None:
    """Once the chief reported `step`, SIGKILLs one of the job's Ray Train worker processes."""
    from ray.util.state import list_actors

    while not any(m["step"] >= step for m in receiver.metrics()):
        time.sleep(0.05)
    workers = list_actors(address=ray_head.dashboard_url,
                          filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    pid = max(w.pid for w in workers)
    killed.append((max(m["step"] for m in receiver.metrics()), pid))
    os.kill(pid, signal.SIGKILL)


def test_killed_worker_resumes_from_last_checkpoint(job_files, ray_head, receiver, tiny_model, tmp_path, monkeypatch):
    spec = JobCreate(model=f"{job_files}/models/tiny", training_file=f"{job_files}/data/train.jsonl",
                     validation_file=f"{job_files}/data/valid.jsonl",
                     lora={"rank": 4, "alpha": 8, "dropout": 0.0, "train_experts": True},
                     training={"max_steps": STEPS, "checkpoint_every": CHECKPOINT_EVERY, "learning_rate": 3e-3,
                               "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 64},
                     parallelism={"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 2})
    run = JobRunSpec(job_id="ftjob-killed", spec=spec, seed=5, output_uri=f"{job_files}/out/ftjob-killed")
    killed = []
    killer = threading.Thread(target=_kill_a_worker_after, args=(receiver, KILL_AFTER, ray_head, killed), daemon=True)
    killer.start()
    ok = _run_in_process(run, ray_head, receiver, monkeypatch)
    (result,) = receiver.of_kind("result")
    assert ok and result.status == "succeeded", result.error
    (last_before_kill, pid), = killed

    events = [e for e in receiver.of_kind("event") if e.type == "message"]
    (failure,) = [e for e in events if e.message.startswith("Worker failure 1 ")]
    assert failure.level == "warn" and "restarting the worker group" in failure.message
    (resumed,) = [e for e in events if e.message.startswith("Resumed from checkpoint")]
    resumed_step = resumed.data["step"]
    assert resumed.message == f"Resumed from checkpoint step-{resumed_step} after a worker failure"
    assert events.index(failure) < events.index(resumed)
    assert resumed_step % CHECKPOINT_EVERY == 0 and 0 < last_before_kill - resumed_step <= CHECKPOINT_EVERY

    # The steps after the checkpoint ran twice: same batches, same optimizer state, so the same losses.
    steps = [m["step"] for m in receiver.metrics()]
    repeated = list(range(resumed_step + 1, last_before_kill + 1))
    assert steps == list(range(1, last_before_kill + 1)) + list(range(resumed_step + 1, STEPS + 1))
    first_run, second_run = receiver.metrics()[:last_before_kill], receiver.metrics()[last_before_kill:]
    for step in repeated:
        assert second_run[step - resumed_step - 1]["train_loss"] == pytest.approx(
            first_run[step - 1]["train_loss"], abs=1e-5)
    print(f"killed pid {pid} after step {last_before_kill}; resumed from step-{resumed_step}; "
          f"{len(repeated)} steps repeated")

    # Job history is whole across the restart, and the final adapter loads into PEFT as trained.
    metrics_file = storage.read_text(f"{run.output_uri}/metrics.jsonl").splitlines()
    assert len(metrics_file) == STEPS
    final = receiver.metrics()[-1]
    assert final["trained_tokens"] == result.trained_tokens
    assert _adapter_valid_loss(run, tiny_model, tmp_path) == pytest.approx(final["valid_loss"], abs=1e-3)
    for step in range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY):
        uri = f"{run.output_uri}/checkpoints/step-{step}"
        assert storage.exists(f"{uri}/checkpoint.json")
        assert all(storage.exists(f"{uri}/expert_lora/ep-{r}-of-2.safetensors") for r in range(2))
