"""One EP=2 expert-LoRA job (ZeRO-2) on the local Ray head, interrupted twice for real:

1. pause: the control plane answers a report with {"control": "pause"}; every rank checkpoints at that step and
   stops; the driver reports `paused`;
2. the next run resumes from the pause checkpoint, never from a newer step directory without a manifest;
3. a Ray Train worker process is SIGKILLed mid-run; Ray Train restarts the group, which resumes from the newest
   complete checkpoint (DeepSpeed state + expert-LoRA shards in S3), repeats at most one checkpoint interval
   of steps with the same losses, and finishes with a PEFT-loadable adapter.
"""

import json
import os
import signal
import threading
import time

import pytest

from moetune.api import storage
from moetune.api.models.job_create import JobCreate
from moetune.api.models.job_run import JobRunSpec
from tests.support.jobs import adapter_valid_loss, run_in_process

pytestmark = pytest.mark.ray_job
STEPS, CHECKPOINT_EVERY, PAUSE_AT, KILL_AFTER = 10, 3, 2, 5


def _asks_pause_at(step: int):
    def control_for(report):
        r = report.report
        return "pause" if r.kind == "event" and r.type == "metrics" and r.data["step"] == step else None

    return control_for


def _kill_a_worker_after(receiver, step: int, ray_head, killed: list) -> None:
    """Once the chief reported `step`, SIGKILLs one of the job's Ray Train worker processes."""
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


def _messages(receiver) -> list:
    return [e for e in receiver.of_kind("event") if e.type == "message"]


def test_pause_resume_and_worker_loss(assets, ray_head, receiver, tiny_checkpoint, tmp_path, monkeypatch):
    spec = JobCreate(model=f"{assets}/models/tiny", training_file=f"{assets}/data/train.jsonl",
                     validation_file=f"{assets}/data/valid.jsonl",
                     lora={"rank": 4, "alpha": 8, "dropout": 0.1, "train_experts": True},
                     training={"max_steps": STEPS, "checkpoint_every": CHECKPOINT_EVERY, "learning_rate": 3e-3,
                               "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 64},
                     parallelism={"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 2})
    run = JobRunSpec(job_id="ftjob-interrupted", spec=spec, seed=5, output_uri=f"{assets}/out/ftjob-interrupted")

    # 1. pause
    receiver.control_for = _asks_pause_at(PAUSE_AT)
    assert run_in_process(run, ray_head, receiver, monkeypatch)
    (result,) = receiver.of_kind("result")
    assert result.status == "paused" and result.fine_tuned_model is None
    paused_run = receiver.metrics()
    assert [m["step"] for m in paused_run] == list(range(1, PAUSE_AT + 1))
    (checkpoint,) = receiver.of_kind("checkpoint")
    assert checkpoint.step_number == PAUSE_AT
    assert any(e.message.startswith(f"Paused at step {PAUSE_AT}") for e in _messages(receiver))
    state = json.loads(storage.read_text(f"{checkpoint.uri}/trainer_state.json"))
    assert state["paused"] and [r["step"] for r in state["history"]] == list(range(1, PAUSE_AT + 1))
    assert not storage.exists(f"{run.output_uri}/adapter")

    # A newer step directory whose manifest never came (its writer died mid-upload).
    partial = f"{run.output_uri}/checkpoints/step-{CHECKPOINT_EVERY}"
    storage.write_bytes(f"{partial}/deepspeed/latest", b"global_step999")
    storage.write_bytes(f"{partial}/trainer_state.json", b"{}")

    # 2. resume, and 3. lose a worker on the way
    receiver.reports.clear()
    receiver.control_for = lambda report: None
    killed = []
    threading.Thread(target=_kill_a_worker_after, args=(receiver, KILL_AFTER, ray_head, killed), daemon=True).start()
    assert run_in_process(run, ray_head, receiver, monkeypatch)
    (result,) = receiver.of_kind("result")
    assert result.status == "succeeded", result.error
    assert len(killed) == 1

    events = _messages(receiver)
    (after_pause,) = [e for e in events if e.message.startswith("Resumed from checkpoint")
                      and e.message.endswith("after pause")]
    assert after_pause.message == f"Resumed from checkpoint step-{PAUSE_AT} after pause"
    (failure,) = [e for e in events if e.message.startswith("Worker failure")]
    assert failure.level == "warn" and failure.message.startswith("Worker failure 1 (rank ")
    assert "restarting the worker group from the newest complete checkpoint" in failure.message
    (after_failure,) = [e for e in events if e.message.endswith("after a worker failure")]
    resumed = after_failure.data["step"]
    assert after_failure.message == f"Resumed from checkpoint step-{resumed} after a worker failure"
    assert events.index(after_pause) < events.index(failure) < events.index(after_failure)
    # The chief may still report the step its peer finished just before dying: the second group starts where
    # the step numbers restart at the checkpoint.
    metrics = receiver.metrics()
    split = max(i for i, m in enumerate(metrics) if m["step"] == resumed + 1)
    before_kill, after_kill = metrics[:split], metrics[split:]
    last_before_kill = before_kill[-1]["step"]
    assert [m["step"] for m in before_kill] == list(range(PAUSE_AT + 1, last_before_kill + 1))
    assert [m["step"] for m in after_kill] == list(range(resumed + 1, STEPS + 1))
    assert resumed % CHECKPOINT_EVERY == 0 and 0 <= last_before_kill - resumed <= CHECKPOINT_EVERY

    # Steps after the checkpoint ran twice: same batches and optimizer state, so the same losses.
    for first, again in zip([m for m in before_kill if m["step"] > resumed], after_kill):
        assert again["train_loss"] == pytest.approx(first["train_loss"], abs=1e-5)
    print(f"paused at {PAUSE_AT}; killed a worker after step {last_before_kill}; resumed from step-{resumed}")

    # One history across both interruptions, and the final adapter loads into PEFT as trained.
    history = [json.loads(line) for line in storage.read_text(f"{run.output_uri}/metrics.jsonl").splitlines()]
    # the history marks the steps that wrote a checkpoint (the pause's too), which the step's report did not know
    marked = {r["step"] for r in history if r.pop("checkpoint", None) == f"step-{r['step']}"}
    assert marked == {PAUSE_AT, *range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY)}
    assert history == paused_run + [m for m in before_kill if m["step"] <= resumed] + after_kill
    assert result.trained_tokens == history[-1]["trained_tokens"]
    assert adapter_valid_loss(run, tiny_checkpoint, tmp_path) == pytest.approx(history[-1]["valid_loss"], abs=1e-3)
    for step in range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY):
        uri = f"{run.output_uri}/checkpoints/step-{step}"
        assert storage.exists(f"{uri}/checkpoint.json")
        assert all(storage.exists(f"{uri}/expert_lora/ep-{r}-of-2.safetensors") for r in range(2))
