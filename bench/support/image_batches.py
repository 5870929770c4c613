"""The image tests' shared parts (any family that takes images): the tiny multimodal model (spread-out router, same
weights on every call), mixed text and image micro-batches through the job's method, and the EP=2 rank run of those
batches, and the reference they are checked against."""

from __future__ import annotations

import os

import torch

from moetune.api.models.run_config import RunConfig


def image_method(model_dir: str, seq_len: int = 512):
    from transformers import AutoTokenizer

    from moetune.workers.methods import method_for
    from bench.support.harness import spec

    job = spec(ep=1, zero=2)
    job.training.seq_len = seq_len
    return method_for(job.method, job.training, AutoTokenizer.from_pretrained(model_dir), model_dir)


def image_model(model_dir: str):
    """The stock transformers *ForConditionalGeneration of the checkpoint's config (fp32)."""
    from transformers import AutoConfig

    from moetune.workers.families import family_for
    from bench.support.tiny_models import plain_model

    config = AutoConfig.from_pretrained(model_dir)
    return plain_model(family_for(config), config=config)


def image_batch(method, rank: int, text_only: bool = False):
    """A micro-batch of one text-only chat row and two image rows (32- and 64-pixel images), other rows per rank;
    `text_only`: the chat row alone."""
    from moetune.workers.tiny import tiny_image_rows

    chat = {"messages": [{"role": "user", "content": f"say {rank}"}, {"role": "assistant", "content": f"{rank}!"}]}
    examples, _ = method.examples([chat, *([] if text_only else tiny_image_rows(2, seed=10 + rank))])
    return method.collate(examples)


def wide_vision(tiny_config):
    """`tiny_config` with a vision MLP wider than DeepSpeed's ZeRO-3 persistence threshold (1e5 elements), so that
    the tower's weights are gathered by a collective in every forward, as every real tower's are."""
    def config(**overrides):
        made = tiny_config(**overrides)
        made.vision_config.intermediate_size = 4096
        return made

    return config


def with_padding_mask(inputs: dict, pad_id: int) -> dict:
    """The model inputs with the padding mask the family's processor would give (the job's batches carry none):
    what the stock model is run on in the references."""
    return {**inputs, "attention_mask": (inputs["input_ids"] != pad_id).long()}


def run_image_ep(rank: int, world: int, model_dir: str, spec_json: str, out_dir: str,
                 text_only_rank: int | None = None, device=None) -> None:
    """This rank's moetune engine (kernel swaps, EP LoRA model, loss head) on its image batch (text only on
    `text_only_rank`), on `device` (CPU by default): first loss sum and full LoRA gradients."""
    from deepspeed.utils import safe_get_full_grad

    from moetune.workers.engine.deepspeed import build_engine
    from moetune.workers.families import apply_kernel_swaps
    from moetune.workers.model import trainable_model
    from moetune.workers.experts.placement import job_placement

    job = RunConfig.model_validate_json(spec_json)
    method, model = image_method(model_dir), image_model(model_dir).to(device or torch.device("cpu"))
    apply_kernel_swaps(model)
    torch.manual_seed(1)
    placement = job_placement(model.config.to_dict(), job.parallelism, job.lora)
    model = trainable_model(model, job.lora, job.training, placement)
    method.prepare(model)
    if placement.size > 1:
        assert any(type(m).__name__ == "ExpertParallelExperts" for m in model.modules())  # this rank's half
    engine, _ = build_engine(model, job.training, job.parallelism, world, 1, bf16=False)
    loss = method.loss_sum(engine, image_batch(method, rank, text_only=rank == text_only_rank).to(model.device))
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"loss": loss.item(), "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))


def reference(tiny_vl, method, job, ranks, dtype: torch.dtype = torch.float32,
              text_only_rank: int | None = None) -> tuple[float, dict]:
    """Stock transformers + PEFT, same LoRA draw (made in fp32, then the model in `dtype`): the rank-mean of the
    loss sums and its LoRA gradients."""
    from moetune.workers.lora.peft_lora import apply_lora
    from moetune.workers.methods.sft import token_loss_sum

    model = image_model(tiny_vl)
    torch.manual_seed(1)
    peft_model = apply_lora(model, job.lora).to(dtype)
    pad_id = method.tokenizer.pad_token_id

    def inputs(batch) -> dict:
        return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in with_padding_mask(batch.inputs, pad_id).items()}

    loss = sum(token_loss_sum(peft_model(**inputs(b)).logits, b.labels)
               for b in (image_batch(method, r, text_only=r == text_only_rank) for r in ranks)) / len(ranks)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}


def round_off(approx: dict, exact: dict) -> float:
    """The largest gap between two gradient sets as a share of the exact tensor's largest entry."""
    return max(((approx[n].double() - g).abs().max() / g.abs().max()).item()
               for n, g in exact.items() if g is not None and g.abs().max() > 0)


def assert_grads(got: dict, want: dict, atol_per_max: float = 0.0):
    """Every LoRA gradient equal to the reference's: rtol 1e-4, atol 1e-6 or `atol_per_max` of the tensor's largest
    entry where a family's fp32 round-off is larger (see tests/workers/experts/test_image_exactness_ep.py). A
    float64 reference is compared in fp32."""
    assert got.keys() == want.keys() and any("vision" not in n for n in want)
    for name, expected in want.items():
        if expected is None:  # glm5_next's indexer LoRA: its top-k selection passes no gradient, on either side
            # (a DeepSpeed engine reports it as zeros: its gradient buckets hold every trainable parameter)
            assert ".indexer." in name and (got[name] is None or not got[name].any()), name
            continue
        assert expected.abs().max() > 0 or "lora_A" in name, name  # B starts at 0: only B has a first gradient
        atol = max(1e-6, atol_per_max * expected.abs().max().item())
        torch.testing.assert_close(got[name], expected.to(got[name].dtype), rtol=1e-4, atol=atol, msg=name)
