"""One real job through the driver on the local Ray head: EP=2 with expert LoRA under ZeRO-2."""

import os

import pytest
import torch

from moetune.api.models import JobCreate, JobRunSpec
from moetune.api import storage
from moetune.workers.data.rows import load_rows
from moetune.workers.data.sampling import step_micro_batches
from moetune.workers.lora.expert_layout import b_from_peft
from moetune.workers.methods.batch import IGNORE
from moetune.workers.methods.sft import collate, tokenize_rows
from moetune.workers.tiny import write_tiny_checkpoint, write_tiny_dataset
from tests.support.jobs import run_in_process

pytestmark = pytest.mark.ray_job


def _plain_first_loss(run: JobRunSpec, checkpoint: str) -> float:
    """Step 1's loss on the plain model: expert LoRA starts with B = 0, so it must not change it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t, world = run.spec.training, run.spec.parallelism.num_workers
    tokenizer, model = AutoTokenizer.from_pretrained(checkpoint), AutoModelForCausalLM.from_pretrained(checkpoint)
    examples, _ = tokenize_rows(tokenizer, load_rows(run.spec.training_file, "training_file"), t.seq_len)
    batches = [collate([examples[i] for i in indices], tokenizer.pad_token_id) for rank in range(world)
               for indices in step_micro_batches(len(examples), 0, t.global_batch_size, t.micro_batch_size,
                                                 rank, world, run.seed)]
    counts = [(b.labels[:, 1:] != IGNORE).sum().item() for b in batches]  # the job's loss is a token mean
    with torch.no_grad():
        return sum(model(**b.inputs, labels=b.labels).loss.item() * n for b, n in zip(batches, counts)) / sum(counts)


def test_ep2_expert_lora_job_on_ray(s3_bucket, ray_head, receiver, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = f"s3://{s3_bucket}"
    checkpoint = write_tiny_checkpoint(str(tmp_path / "model"))
    storage.upload_dir(checkpoint, f"{base}/model")
    write_tiny_dataset(str(tmp_path / "train.jsonl"), 64, seed=0)
    storage.write_bytes(f"{base}/train.jsonl", (tmp_path / "train.jsonl").read_bytes())
    spec = JobCreate(model=f"{base}/model", training_file=f"{base}/train.jsonl",
                     lora={"rank": 4, "alpha": 8, "dropout": 0.0, "train_experts": True},
                     training={"max_steps": 4, "checkpoint_every": 2, "learning_rate": 3e-3, "global_batch_size": 4,
                               "micro_batch_size": 2, "seq_len": 64},
                     parallelism={"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 2})
    run = JobRunSpec(job_id="ftjob-ep2", spec=spec, seed=5, output_uri=f"{base}/out/ftjob-ep2")

    ok = run_in_process(run, ray_head, receiver, monkeypatch)
    (result,) = receiver.of_kind("result")
    assert ok, result.error
    assert any("expert parallel 2" in e.message for e in receiver.of_kind("event"))
    metrics = receiver.metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[0]["train_loss"] == pytest.approx(_plain_first_loss(run, checkpoint), abs=1e-4)
    for step in (2, 4):
        shards = storage.join(run.output_uri, "checkpoints", f"step-{step}", "expert_lora")
        assert all(storage.exists(f"{shards}/ep-{r}-of-2.safetensors") for r in range(2))

    adapter = storage.download_dir(result.fine_tuned_model, str(tmp_path / "adapter"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint), adapter)
    trained_b = [b_from_peft(p, 8) for n, p in model.named_parameters() if ".experts." in n and "lora_B" in n]
    # every expert, on both EP ranks, was trained (B starts at 0)
    assert trained_b and all((b.flatten(1).abs().amax(dim=1) > 0).all() for b in trained_b)
    assert os.path.exists(os.path.join(adapter, "adapter_config.json"))
