"""Each family's tiny random model as the EP, LoRA and adapter tests and benchmarks build it, and their
deterministic batches."""

from __future__ import annotations

import torch


def plain_model(family, seed: int = 0, skew_to_first_half: bool = False, config=None):
    """The family's tiny random model with a spread-out router (a zero router routes uniformly).

    Expert biases, where a family has them, are random too. `skew_to_first_half` routes every token to the first
    half of the experts through the router's score correction bias (kimi_linear, deepseek_v3): with EP=2, rank 1's
    experts get no token at all. `config`: another config of the family (the tiny one by default).
    """
    from moetune.workers.families import auto_model_class

    torch.manual_seed(seed)
    config = config or family.tiny_config()
    model = auto_model_class(config).from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for _, block in family.moe_blocks(model):
            router = getattr(block, family.router)
            router.weight.normal_(0.0, 0.5)
            for name, param in getattr(block, family.experts).named_parameters():
                if name.endswith("_bias"):  # biased experts (gpt-oss) initialise them to zero
                    param.normal_(0.0, 0.1)
            if hasattr(router, "tid2eid"):  # hash routing (deepseek_v4): each token id its own distinct experts
                table = torch.rand(router.tid2eid.shape[0], router.num_experts).argsort(-1)[:, :router.top_k]
                router.tid2eid.copy_(table)
            if skew_to_first_half:
                half = router.e_score_correction_bias.numel() // 2
                router.e_score_correction_bias[:half] = 100.0
    return model


def batch(rank: int, step: int, micro: int = 2, seq: int = 12, vocab: int = 256) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab, (micro, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
