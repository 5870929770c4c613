"""Real jobs on quantized bases (2 Ray workers, EP=2, expert LoRA, ZeRO-2): FP8-block and INT4 pack-quantized
(DeepSeek-V3) and MXFP4 (gpt-oss) checkpoints train with their frozen weights kept quantized, and the exported
adapter, loaded with plain PEFT onto transformers' own dequantized model, reproduces the job's validation loss."""

from __future__ import annotations

import pytest
import torch

from moetune.api import storage
from moetune.api.layout import adapter_uri
from moetune.api.models.job_create import JobCreate
from moetune.workers.families import REGISTRY
from moetune.workers.tiny import write_tiny_dataset, write_tiny_tokenizer
from tests.support.jobs import job_run, run_in_process, valid_loss
from bench.support.tiny_models import plain_model
from bench.support.quantized import FAMILY_OF, quantize_checkpoint

pytestmark = pytest.mark.ray_job


def _checkpoints(tmp_path) -> dict[str, tuple[str, int]]:
    """Each format's tiny checkpoint (bench.support.quantized.FAMILY_OF; with the demo's byte tokenizer), and the
    parameters one of two EP ranks holds (all but the other rank's routed experts)."""
    from transformers import AutoTokenizer

    out = {}
    for family in sorted(set(FAMILY_OF.values())):
        dense = tmp_path / f"dense-{family}"
        write_tiny_tokenizer(str(dense))
        tokenizer = AutoTokenizer.from_pretrained(str(dense))
        fam = REGISTRY[family]
        model = plain_model(fam, config=fam.tiny_config(pad_token_id=tokenizer.pad_token_id,
                                                        bos_token_id=tokenizer.bos_token_id,
                                                        eos_token_id=tokenizer.eos_token_id))
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 0.1)
        model.save_pretrained(str(dense), max_shard_size="100KB")
        routed = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
        for fmt in (f for f, of in FAMILY_OF.items() if of == family):
            out[fmt] = (quantize_checkpoint(str(dense), str(tmp_path / fmt), fmt),
                        sum(p.numel() for p in model.parameters()) - routed // 2)
    return out


def _reference_valid_loss(fmt: str, checkpoint: str, adapter: str, validation_file: str, seq_len: int) -> float:
    """Token-weighted validation loss of the adapter on transformers' dequantized model, loaded with plain PEFT."""
    from peft import PeftModel
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        CompressedTensorsConfig,
        FineGrainedFP8Config,
        Mxfp4Config,
    )

    quantization = {"fp8": FineGrainedFP8Config, "int4": CompressedTensorsConfig, "mxfp4": Mxfp4Config}[fmt]
    base = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=quantization(dequantize=True),
                                                dtype=torch.float32)
    return valid_loss(PeftModel.from_pretrained(base, adapter), AutoTokenizer.from_pretrained(checkpoint),
                      validation_file, seq_len)


def test_jobs_train_on_fp8_int4_and_mxfp4_bases_kept_quantized(s3_bucket, ray_head, receiver, tmp_path, monkeypatch):
    base = f"s3://{s3_bucket}"
    for name, rows, seed in (("train.jsonl", 32, 0), ("valid.jsonl", 8, 1)):
        write_tiny_dataset(str(tmp_path / name), rows, seed=seed)
        storage.write_bytes(f"{base}/{name}", (tmp_path / name).read_bytes())
    for fmt, (checkpoint, rank_parameters) in _checkpoints(tmp_path).items():
        storage.upload_dir(checkpoint, f"{base}/{fmt}")
        spec = JobCreate(model=f"{base}/{fmt}", training_file=f"{base}/train.jsonl",
                         validation_file=f"{base}/valid.jsonl",
                         lora={"rank": 4, "alpha": 8, "dropout": 0.0, "train_experts": True},
                         training={"max_steps": 3, "learning_rate": 3e-3, "global_batch_size": 4,
                                   "micro_batch_size": 2, "seq_len": 64},
                         parallelism={"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 2})
        run = job_run(f"ftjob-{fmt}", spec, 5, f"{base}/out/{fmt}")
        receiver.reports.clear()
        assert run_in_process(run, ray_head, receiver, monkeypatch), receiver.of_kind("result")
        (loaded,) = [e for e in receiver.of_kind("event") if e.message.startswith("Weights streamed")]
        expected = {"fp8": "fp8-block", "int4": "int4-pack-quantized", "mxfp4": "mxfp4"}[fmt]
        assert loaded.data["quantization"] == expected and loaded.data["quantized_bytes"] > 0, loaded.message
        assert f"{expected} base" in loaded.message
        (built,) = [e for e in receiver.of_kind("event") if e.message.startswith("Model loaded")]
        # weights kept quantized count by their dense shapes (the chief's: its half of the experts)
        assert built.data["parameters"] - built.data["trainable_parameters"] == rank_parameters
        (lora,) = [e for e in receiver.of_kind("event") if e.message.startswith("LoRA coverage")]
        rows = {row["layer_type"]: row for row in lora.data["lora_coverage"]}
        assert rows["routed experts"]["adapted_layers"] == rows["routed experts"]["layers"] > 0
        assert not [e.message for e in receiver.of_kind("event") if e.level == "warning"]  # every layer type adapted
        metrics = receiver.metrics()
        assert [m["step"] for m in metrics] == [1, 2, 3] and metrics[-1]["train_loss"] < metrics[0]["train_loss"]
        adapter = storage.download_dir(adapter_uri(run.output_uri), str(tmp_path / f"adapter-{fmt}"))
        reproduced = _reference_valid_loss(fmt, checkpoint, adapter, str(tmp_path / "valid.jsonl"), 64)
        # INT4: transformers keeps the decompressed experts in bf16, moetune computes them exactly in fp32
        assert reproduced == pytest.approx(metrics[-1]["valid_loss"], abs=2e-2 if fmt == "int4" else 1e-3)
