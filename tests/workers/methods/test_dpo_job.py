"""One real DPO job: the driver's checks of the preference rows, 2 Ray Train workers with the routed experts split
between them (EP=2, ZeRO-2, expert LoRA), the local S3 server, a validation file and a checkpoint. The reward
margin (the pairs' mean beta-scaled log-ratio of the preferred over the non-preferred answer) is 0 at step 1, where
LoRA B is zero and the policy is the reference, and rises over the steps; so does the reward accuracy.

Sabotage noted: the loss with the wrong sign (+logsigmoid) fails it (step 1's loss is then -log 2)."""

import json

import pytest

from moetune.api import storage
from moetune.api.layout import adapter_uri
from moetune.api.models.job_create import JobCreate
from moetune.workers.tiny import write_tiny_checkpoint
from tests.support.jobs import job_run, run_in_process

pytestmark = pytest.mark.ray_job
STEPS = 6
COLOURS = {"ada": "red", "bob": "blue", "cy": "green", "dee": "gold"}


def _rows(n: int) -> list[dict]:
    """Each name's colour preferred over the next name's colour."""
    names = list(COLOURS)
    rows = []
    for i in range(n):
        name, other = names[i % 4], names[(i + 1) % 4]
        rows.append({"input": {"messages": [{"role": "user", "content": f"what does {name} like?"}]},
                     "preferred_output": [{"role": "assistant", "content": f"{name} likes {COLOURS[name]}."}],
                     "non_preferred_output": [{"role": "assistant", "content": f"{name} likes {COLOURS[other]}."}]})
    return rows


def test_a_dpo_job_raises_the_reward_margin(s3_bucket, tmp_path, ray_head, receiver, monkeypatch):
    base = f"s3://{s3_bucket}"
    storage.upload_dir(write_tiny_checkpoint(str(tmp_path / "model")), f"{base}/model")
    for name, n in (("train", 32), ("valid", 8)):
        storage.write_bytes(f"{base}/{name}.jsonl", "".join(json.dumps(r) + "\n" for r in _rows(n)).encode())
    spec = JobCreate(model=f"{base}/model", training_file=f"{base}/train.jsonl",
                     validation_file=f"{base}/valid.jsonl",
                     method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}},
                     lora={"rank": 8, "alpha": 16, "dropout": 0.0, "train_experts": True},
                     training={"max_steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 64,
                               "learning_rate": 1e-2, "warmup_ratio": 0.0, "eval_every": STEPS,
                               "checkpoint_every": 3},
                     parallelism={"num_workers": 2, "zero_stage": 2, "expert_parallel_size": 2})
    run = job_run("ftjob-dpo", spec, 3, f"{base}/out/ftjob-dpo")
    ok = run_in_process(run, ray_head, receiver, monkeypatch)
    (result,) = receiver.of_kind("result")
    assert ok, result.error
    steps = [r.report.data for r in receiver.reports
             if r.report.kind == "event" and r.report.type == "metrics" and "train_loss" in r.report.data]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    margins = [s["rewards/margins"] for s in steps]
    assert margins[0] == pytest.approx(0.0, abs=1e-6) and steps[0]["train_loss"] == pytest.approx(0.6931, abs=1e-4)
    assert margins[-1] > 0.05 and margins[-1] > max(margins[:3]), margins
    assert steps[-1]["rewards/accuracies"] > 0.5
    assert steps[-1]["rewards/chosen"] - steps[-1]["rewards/rejected"] == pytest.approx(margins[-1], rel=1e-4)
    assert steps[-1]["train_loss"] < steps[0]["train_loss"] and steps[-1]["valid_loss"] < 0.6931
    assert storage.exists(f"{adapter_uri(run.output_uri)}/adapter_model.safetensors")
