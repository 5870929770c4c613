"""A session's `sample` under ZeRO-3 gathers the partitioned weights once per call (workers.engine.generation),
not once per decoded token, and refuses a model whose whole weights would not fit (workers.sessions.sampling).

One real ZeRO-3 engine on gloo (one rank) over the tiny model with LoRA. Its parameters are marked non-persistent:
the tiny ones fall under DeepSpeed's persistence threshold (1e5 elements) and would stay whole anyway, where K3's
matrices do not. Counted: each time DeepSpeed frees (re-partitions) a gathered weight; every free means one gather
for the next use.

Sabotage noted: whole_for_generation as `gathered(engine.module.parameters())` (GatheredParameters alone) frees
every weight in every decode step and fails the count."""

import math
import os

import pytest
import torch

from bench.support.harness import launch, spec
from moetune.workers.sessions.sampling import WHOLE_WEIGHTS_SHARE, whole_weights_refusal

NEW_TOKENS = 6


def run_rank(rank: int, world: int, checkpoint: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    from moetune.workers.engine.deepspeed import build_engine, partitioned
    from moetune.workers.engine.generation import partitioned_bytes, whole_for_generation
    from moetune.workers.generate import SamplingParams, generate_batch
    from moetune.workers.model import trainable_model

    job = spec(ep=1, zero=3, world=world, micro=1)
    model = trainable_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32), job.lora,
                            job.training, None)
    engine, _ = build_engine(model, job.training, job.parallelism, world, total_steps=1, bf16=False)
    params = [p for p in engine.module.parameters() if partitioned(p)]
    freed = []
    for p in params:
        p.ds_persist = False  # as a weight over DeepSpeed's persistence threshold

        def counted(*args, partition=p.partition, **kwargs):
            freed.append(1)
            return partition(*args, **kwargs)
        p.partition = counted
    prompts, greedy = [[5, 17, 33], [9, 8]], SamplingParams(NEW_TOKENS, temperature=0.0)
    result = {"params": len(params), "bytes": partitioned_bytes(engine.module),
              "whole_bytes": 4 * sum(math.prod(p.ds_shape) for p in params)}  # fp32

    def sample():
        freed.clear()
        tokens = generate_batch(engine.module, prompts, greedy, lockstep=True, eos_token_id=None)
        return tokens, len(freed)

    result["plain"] = sample()
    with whole_for_generation(engine):
        result["whole"] = sample()
    result["after"] = sample()  # ZeRO-3's hooks are back: the engine gathers per forward again
    loss = engine(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.float().pow(2).mean()
    engine.backward(loss)  # and trains
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def test_sample_under_zero3_gathers_the_weights_once_per_call(tiny_checkpoint, tmp_path):
    launch(run_rank, 1, tiny_checkpoint, str(tmp_path))
    r = torch.load(tmp_path / "rank0.pt")
    assert r["params"] > 10 and r["bytes"] == r["whole_bytes"] > 0
    plain_tokens, plain_freed = r["plain"]
    whole_tokens, whole_freed = r["whole"]
    assert whole_tokens == plain_tokens and len(plain_tokens[0]) == NEW_TOKENS
    assert plain_freed >= NEW_TOKENS * r["params"]  # unaided: every weight gathered and freed in every forward
    assert whole_freed == 0  # gathered once on entry, none freed until the call ends
    assert r["after"][0] == plain_tokens and r["after"][1] >= NEW_TOKENS * r["params"]


def test_a_model_whose_whole_weights_do_not_fit_is_refused_with_its_numbers():
    h100 = 80 * 10**9
    k3_dense = 57 * 10**9 * 2  # bf16
    message = whole_weights_refusal(k3_dense, h100)
    assert "114.0 GB" in message and f"{WHOLE_WEIGHTS_SHARE * h100 / 1e9:.1f} GB of 80.0 GB" in message
    assert whole_weights_refusal(int(WHOLE_WEIGHTS_SHARE * h100), h100) is None
    assert whole_weights_refusal(3 * 10**9, h100) is None
