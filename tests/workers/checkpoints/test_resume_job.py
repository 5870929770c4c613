"""One EP=2 expert-LoRA job (ZeRO-2) on the local Ray head, interrupted three times for real:

1. pause: the control plane answers a report with {"control": "pause"}; every rank checkpoints at that step and
   stops; the driver reports `paused`;
2. the next run resumes from the pause checkpoint, never from a newer step directory without a manifest;
3. a Ray Train worker process is SIGKILLed mid-run; Ray Train restarts the group, which resumes from the newest
   complete checkpoint (DeepSpeed state + expert-LoRA shards in S3), repeats at most one checkpoint interval
   of steps with the same losses;
4. storage becomes unreachable (every connection to S3 cut, at a proxy) while a later checkpoint uploads: the save
   fails loudly (a worker failure naming the checkpoint), the half-written step directory is never resumed from,
   and once storage is back the group resumes from the checkpoint before it and finishes with a PEFT-loadable
   adapter.
"""

import json
import os
import threading
import time

import pytest

from moetune.api import storage
from moetune.api.models.job_create import JobCreate
from bench.support.proxy import FaultProxy
from moetune.api.environment import ENV_S3_ENDPOINT_URL
from tests.support.jobs import adapter_valid_loss, job_run, kill_a_worker_after, run_in_process

pytestmark = pytest.mark.ray_job
STEPS, CHECKPOINT_EVERY, PAUSE_AT, KILL_AFTER, OUTAGE_AT = 10, 3, 2, 5, 9


def _asks_pause_at(step: int):
    def control_for(report):
        r = report.report
        return "pause" if r.kind == "event" and r.type == "metrics" and r.data["step"] == step else None

    return control_for


def _messages(receiver) -> list:
    return [e for e in receiver.of_kind("event") if e.type == "message"]


def _restore_after_second_failure(receiver, proxy: FaultProxy) -> None:
    """Storage comes back once the job reported the failure its outage caused (the second of the run)."""
    proxy.outage.wait(300)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sum(e.message.startswith("Worker failure") for e in _messages(receiver)) < 2:
        time.sleep(0.05)
    proxy.restore()


def test_pause_resume_worker_loss_and_storage_outage(assets, ray_head, receiver, tiny_checkpoint, tmp_path, monkeypatch):
    spec = JobCreate(model=f"{assets}/models/tiny", training_file=f"{assets}/data/train.jsonl",
                     validation_file=f"{assets}/data/valid.jsonl",
                     lora={"rank": 4, "alpha": 8, "dropout": 0.1, "train_experts": True},
                     training={"max_steps": STEPS, "checkpoint_every": CHECKPOINT_EVERY, "learning_rate": 3e-3,
                               "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 64},
                     parallelism={"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 2})
    run = job_run("ftjob-interrupted", spec, 5, f"{assets}/out/ftjob-interrupted")

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

    # 2. resume, 3. lose a worker on the way, 4. lose storage while a later checkpoint uploads
    receiver.reports.clear()
    receiver.control_for = lambda report: None
    proxy = FaultProxy(os.environ[ENV_S3_ENDPOINT_URL])
    monkeypatch.setenv(ENV_S3_ENDPOINT_URL, proxy.url)  # the driver hands its workers the proxy as their S3
    proxy.cut_from_write(f"/checkpoints/step-{OUTAGE_AT}/")
    killed = []
    threading.Thread(target=kill_a_worker_after, args=(receiver, KILL_AFTER, ray_head, killed), daemon=True).start()
    threading.Thread(target=_restore_after_second_failure, args=(receiver, proxy), daemon=True).start()
    try:
        assert run_in_process(run, ray_head, receiver, monkeypatch)
    finally:
        proxy.close()
    monkeypatch.setenv(ENV_S3_ENDPOINT_URL, proxy.upstream)
    (result,) = receiver.of_kind("result")
    assert result.status == "succeeded", result.error
    assert len(killed) == 1

    events = _messages(receiver)
    (after_pause,) = [e for e in events if e.message.startswith("Resumed from checkpoint")
                      and e.message.endswith("after pause")]
    assert after_pause.message == f"Resumed from checkpoint step-{PAUSE_AT} after pause"
    lost_worker, lost_storage = [e for e in events if e.message.startswith("Worker failure")]
    for n, failure in enumerate((lost_worker, lost_storage), 1):
        assert failure.level == "warn" and failure.message.startswith(f"Worker failure {n} (rank ")
        assert "restarting the worker group from the newest complete checkpoint" in failure.message
    uri = f"{run.output_uri}/checkpoints/step-{OUTAGE_AT}"
    assert (f"CheckpointUploadError: checkpoint step-{OUTAGE_AT} could not be written to {uri} ("
            in lost_storage.message and "it is incomplete and never resumed from" in lost_storage.message)
    resumes = [e for e in events if e.message.endswith("after a worker failure")]
    assert [e.message for e in resumes] == [f"Resumed from checkpoint step-{e.data['step']} after a worker failure"
                                            for e in resumes]
    assert events.index(after_pause) < events.index(lost_worker) < events.index(resumes[0])
    assert events.index(lost_storage) < events.index(resumes[1])
    resumed = [e.data["step"] for e in resumes]
    # the outage cut step-9's upload: the group went back to step-6, the newest checkpoint with its manifest
    assert resumed[0] % CHECKPOINT_EVERY == 0 and resumed[1] == OUTAGE_AT - CHECKPOINT_EVERY
    # The chief may still report the step its peer finished just before dying: a restarted group starts where
    # the step numbers restart at the checkpoint.
    first, second, third = receiver.metric_runs()
    assert [m["step"] for m in first] == list(range(PAUSE_AT + 1, first[-1]["step"] + 1))
    assert 0 <= first[-1]["step"] - resumed[0] <= CHECKPOINT_EVERY
    assert [m["step"] for m in second] == list(range(resumed[0] + 1, OUTAGE_AT + 1))
    assert [m["step"] for m in third] == list(range(resumed[1] + 1, STEPS + 1))

    # Steps after a checkpoint ran twice: same batches and optimizer state, so the same losses.
    repeated = receiver.repeated_steps()
    assert {once["step"] for once, _ in repeated} >= {OUTAGE_AT - CHECKPOINT_EVERY + 1, OUTAGE_AT}
    for once, again in repeated:
        assert again["train_loss"] == pytest.approx(once["train_loss"], abs=1e-5), once["step"]
    print(f"paused at {PAUSE_AT}; killed a worker after step {first[-1]['step']}; resumed from step-{resumed[0]}; "
          f"storage cut at step-{OUTAGE_AT}'s upload, resumed from step-{resumed[1]}")

    # One history across every interruption, and the final adapter loads into PEFT as trained.
    history = [json.loads(line) for line in storage.read_text(f"{run.output_uri}/metrics.jsonl").splitlines()]
    # the history marks the steps that wrote a checkpoint (the pause's too), which the step's report did not know
    marked = {r["step"] for r in history if r.pop("checkpoint", None) == f"step-{r['step']}"}
    assert marked == {PAUSE_AT, *range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY)}
    assert history == (paused_run + [m for m in first if m["step"] <= resumed[0]]
                       + [m for m in second if m["step"] <= resumed[1]] + third)
    assert result.trained_tokens == history[-1]["trained_tokens"]
    assert adapter_valid_loss(run, tiny_checkpoint, tmp_path) == pytest.approx(history[-1]["valid_loss"], abs=1e-3)
    for step in range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY):
        uri = f"{run.output_uri}/checkpoints/step-{step}"
        assert storage.exists(f"{uri}/checkpoint.json")
        assert all(storage.exists(f"{uri}/expert_lora/ep-{r}-of-2.safetensors") for r in range(2))
