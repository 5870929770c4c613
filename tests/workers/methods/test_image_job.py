"""A real job on image rows (qwen3_5_moe, 2 Ray workers, EP=2 with expert LoRA, ZeRO-2): it trains on mixed image
and text rows, its loss drops, each checkpoint keeps one expert-LoRA shard per EP rank, and the exported adapter,
loaded with plain PEFT onto transformers' own Qwen3_5MoeForConditionalGeneration with no adapter key missing, has
every routed expert of both ranks trained and reproduces the job's validation loss on image rows."""

from __future__ import annotations

import json

import pytest
import torch

from moetune.api import storage
from moetune.api.layout import adapter_uri
from moetune.api.models.job_create import JobCreate
from moetune.workers.data.rows import load_rows
from moetune.workers.families import REGISTRY
from moetune.workers.experts.lora_layout import b_from_peft
from moetune.workers.methods.sft import token_loss_sum
from moetune.workers.tiny import tiny_image_rows, tiny_rows, write_tiny_multimodal_checkpoint
from bench.support.image_batches import image_method
from tests.support.jobs import job_run, run_in_process

pytestmark = pytest.mark.ray_job
SEQ_LEN = 128


def _jsonl(uri: str, rows: list[dict]) -> str:
    storage.write_bytes(uri, "".join(json.dumps(r) + "\n" for r in rows).encode())
    return uri


def _image_valid_loss(checkpoint: str, adapter: str, validation_file: str) -> float:
    """Token-weighted validation loss of the adapter on stock transformers + plain PEFT; no adapter key missing."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import Qwen3_5MoeForConditionalGeneration

    base = Qwen3_5MoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    saved = load_file(f"{adapter}/adapter_model.safetensors")
    assert set(get_peft_model_state_dict(model)) == set(saved)  # every LoRA weight PEFT builds comes from the file
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in saved.items())
    experts = base.config.text_config.num_experts
    trained_b = [b_from_peft(p, experts) for n, p in model.named_parameters() if ".experts." in n and "lora_B" in n]
    # every expert, on both EP ranks, was trained (B starts at 0)
    assert trained_b and all((b.flatten(1).abs().amax(dim=1) > 0).all() for b in trained_b)
    method = image_method(checkpoint, SEQ_LEN)
    examples, _ = method.examples(load_rows(validation_file, "validation_file"))
    total = count = 0.0
    with torch.no_grad():
        for e in examples:
            batch = method.collate([e])
            total += token_loss_sum(model(**batch.inputs).logits, batch.labels).item()
            count += e.loss_tokens
    return total / count


def test_job_trains_on_image_rows_and_its_adapter_loads_in_peft(s3_bucket, ray_head, receiver, tmp_path,
                                                                 monkeypatch):
    base = f"s3://{s3_bucket}"
    checkpoint = write_tiny_multimodal_checkpoint(str(tmp_path / "vl"), REGISTRY["qwen3_5_moe"].tiny_config)
    storage.upload_dir(checkpoint, f"{base}/vl")
    chat_rows = [r for r in tiny_rows(8, seed=2) if "messages" in r]  # text-only rows in the same batches
    train = _jsonl(f"{base}/train.jsonl", tiny_image_rows(12, seed=0) + chat_rows)
    valid = _jsonl(f"{base}/valid.jsonl", tiny_image_rows(6, seed=1))
    spec = JobCreate(model=f"{base}/vl", training_file=train, validation_file=valid,
                     lora={"rank": 4, "alpha": 8, "dropout": 0.0, "train_experts": True},
                     training={"max_steps": 4, "checkpoint_every": 2, "learning_rate": 1e-2, "global_batch_size": 8,
                               "micro_batch_size": 4, "seq_len": SEQ_LEN},
                     parallelism={"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 2})
    run = job_run("ftjob-images", spec, 5, f"{base}/out")
    assert run_in_process(run, ray_head, receiver, monkeypatch), receiver.of_kind("result")

    assert any("expert parallel 2" in e.message for e in receiver.of_kind("event"))
    metrics = receiver.metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    for step in (2, 4):
        shards = storage.join(run.output_uri, "checkpoints", f"step-{step}", "expert_lora")
        assert all(storage.exists(f"{shards}/ep-{r}-of-2.safetensors") for r in range(2))
    adapter = storage.download_dir(adapter_uri(run.output_uri), str(tmp_path / "adapter"))
    reproduced = _image_valid_loss(checkpoint, adapter, valid)
    assert reproduced == pytest.approx(metrics[-1]["valid_loss"], abs=1e-3)
