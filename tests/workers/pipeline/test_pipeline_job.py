"""A pipelined job on the local Ray head: Kimi-Linear's tiny model in two pipeline stages on two Ray Train workers
(ZeRO-2, expert LoRA, 1F1B, a validation loss every step) with the online micro-batch tuner (no memory budget on
CPU: it grows from 1 to 2, both stages at once, and no further: 1F1B needs two micro-batches of the four rows a
step for its two stages), one worker SIGKILLed after step 3: Ray Train
restarts the group, which resumes from checkpoint step-2 (each stage's own DeepSpeed state and expert shards, the
tuner's size) and repeats step 3 with the same loss. Against the same job unsplit on one worker at a fixed
micro-batch size: every step's train and validation loss agree, and so does the exported adapter (one file, each
stage's share relayed to rank 0). Each step reports each stage's idle share and the activations and gradients it
sent and received."""

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moetune.api import storage
from moetune.api.layout import adapter_uri
from moetune.api.models.job_create import JobCreate
from tests.support.jobs import job_run, kill_a_worker_after, run_in_process

pytestmark = pytest.mark.ray_job
STEPS, KILL_AFTER = 4, 3


def _job(assets: str, job_id: str, stages: int, micro_batch_size):
    spec = JobCreate(model=f"{assets}/models/tiny", training_file=f"{assets}/data/train.jsonl",
                     validation_file=f"{assets}/data/valid.jsonl",
                     lora={"rank": 4, "alpha": 8, "dropout": 0.0, "train_experts": True},
                     training={"max_steps": STEPS, "checkpoint_every": 2, "eval_every": 1, "learning_rate": 3e-3,
                               "global_batch_size": 4, "micro_batch_size": micro_batch_size, "seq_len": 64,
                               "alignment_check": False},
                     parallelism={"num_workers": stages, "pipeline_parallel_size": stages, "zero_stage": 2})
    return job_run(job_id, spec, 5, f"{assets}/out/{job_id}")


def _adapter(run, tmp_path, name: str) -> dict:
    local = storage.download_dir(adapter_uri(run.output_uri), str(tmp_path / name))
    return load_file(f"{local}/adapter_model.safetensors")


def test_a_pipelined_job_resumes_after_a_lost_worker_and_trains_as_the_unsplit_one(assets, tiny_checkpoint, ray_head,
                                                                                    receiver, tmp_path, monkeypatch):
    pipelined = _job(assets, "ftjob-pp2", 2, "auto")
    killed = []
    threading.Thread(target=kill_a_worker_after, args=(receiver, KILL_AFTER, ray_head, killed), daemon=True).start()
    assert run_in_process(pipelined, ray_head, receiver, monkeypatch)
    (result,) = receiver.of_kind("result")
    assert result.status == "succeeded", result.error
    assert len(killed) == 1
    resumes = [e for e in receiver.of_kind("event") if e.type == "message"
               and e.message.startswith("Resumed from checkpoint step-2 after a worker failure")]
    assert len(resumes) == 1
    first, second = receiver.metric_runs()
    assert [m["step"] for m in second] == [3, 4] and first[-1]["step"] >= KILL_AFTER
    for once, again in receiver.repeated_steps():
        assert again["train_loss"] == pytest.approx(once["train_loss"], abs=1e-5), once["step"]
    staged = first[:2] + second
    tuned = [e.data for e in receiver.of_kind("event") if e.type == "message" and e.data
             and e.data.get("reason") == "grow"]
    assert [(d["step"], d["micro_batch_size"]) for d in tuned] == [(2, 2)]
    assert tuned[0]["measured_bytes_per_token"] > 0
    assert any(e.message.startswith("Micro-batch size 2 restored from the checkpoint")
               for e in receiver.of_kind("event") if e.type == "message")
    hidden = json.loads((Path(tiny_checkpoint) / "config.json").read_text())["hidden_size"]
    for m in staged:
        assert len(m["pipeline_idle_share"]) == 2 and all(0 <= share < 1 for share in m["pipeline_idle_share"])
        # each stage sends what the other receives: the step's 4 rows of 64 tokens' fp32 hidden states forward,
        # their gradients back
        assert m["pipeline_sent_mb"] == m["pipeline_received_mb"][::-1] == [4 * 64 * hidden * 4 / 1e6] * 2

    receiver.reports.clear()
    unsplit = _job(assets, "ftjob-pp1", 1, 2)
    assert run_in_process(unsplit, ray_head, receiver, monkeypatch)
    reference = receiver.metrics()
    for got, want in zip(staged, reference, strict=True):
        for key in ("train_loss", "valid_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (key, got["step"])
    adapters = _adapter(pipelined, tmp_path, "pp2"), _adapter(unsplit, tmp_path, "pp1")
    assert adapters[0].keys() == adapters[1].keys() and any(".experts." in key for key in adapters[1])
    for key, want in adapters[1].items():
        assert (adapters[0][key] - want).abs().max() <= 1e-4, key
    assert any(not torch.equal(tensor, torch.zeros_like(tensor)) for key, tensor in adapters[0].items()
               if "lora_B" in key)
