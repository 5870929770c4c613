"""Kimi K3 LoRA train step: moetune against the reference, same tiny-but-wide config, same run (CPU).

The reference is NeMo Automodel 0.7.0's KimiK3ForCausalLM + PEFT in its child process (bench/support/
kimi_k3_reference_child.py: fla's CUDA-only ops swapped for fla's pure-torch ones), on the bf16 checkpoint it writes
in the release's naming. moetune streams the MXFP4 checkpoint written beside it, keeps the routed experts packed
(dequantized tile by tile in the expert GEMMs) and runs its kernel swaps (chunked KDA, packed-sequence MLA). Both
train LoRA (rank 16) on every linear both models hold, in bf16, with AdamW; a step is forward, loss, backward and
optimizer step, the median of REPEATS after one warm-up.

Last line: `RESULT k3_step_speedup=<reference s / moetune s> k3_resident_ratio=<routed experts' bytes kept in MXFP4
/ their bf16 bytes>` (goal <= 0.30).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support

import torch

from moetune.api.models.lora import LoraSpec
from moetune.api.models.training import TrainingSpec
from moetune.workers.experts.placement import placement_at
from moetune.workers.families import apply_kernel_swaps
from moetune.workers.families.kimi_k3.tiny import TINY_TEXT
from moetune.workers.model import trainable_model
from moetune.workers.weights.loader import stream_model
from bench.support.kimi_k3_reference import LORA_TARGETS, run_child

# K3's proportions at 1/14 of its hidden width: latent experts at half the hidden width, 2 shared experts, both
# layer kinds and an Attention-Residual block boundary (the tiny model's layer layout)
WIDE_TEXT = {**TINY_TEXT, "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024,
             "num_attention_heads": 8, "num_key_value_heads": 8, "moe_intermediate_size": 256, "num_experts": 32,
             "num_experts_per_token": 4, "routed_expert_hidden_size": 256, "q_lora_rank": 128, "kv_lora_rank": 64,
             "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
             "linear_attn_config": {**TINY_TEXT["linear_attn_config"], "head_dim": 64, "num_heads": 8}}
BATCH, SEQ, RANK, REPEATS = 2, 256, 16, 2


def moetune_step(checkpoint: str, ids: torch.Tensor) -> tuple[float, int]:
    """(median step seconds, bytes of the routed experts held in MXFP4)."""
    streamed = stream_model(f"file://{checkpoint}", torch.device("cpu"), torch.bfloat16, cache_dir="",
                            base_weights="quantized")
    apply_kernel_swaps(streamed.model)
    lora = LoraSpec(rank=RANK, alpha=2 * RANK, dropout=0.0, target_modules=LORA_TARGETS)
    torch.manual_seed(1)
    model = trainable_model(streamed.model, lora, TrainingSpec(), placement_at(streamed.model.config.to_dict(), 1, 0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    seconds = []
    for _ in range(1 + REPEATS):
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:]), streamed.quantized_bytes


def main() -> None:
    ids = torch.randint(3, WIDE_TEXT["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as workdir:
        run_child(workdir, {"seed": 0, "input_ids": ids.tolist(), "lora_targets": LORA_TARGETS, "lora_rank": RANK,
                            "text_config": WIDE_TEXT, "step_repeats": REPEATS})
        with open(os.path.join(workdir, "step.json")) as f:
            reference = json.load(f)
        ours, packed_bytes = moetune_step(os.path.join(workdir, "mxfp4"), ids)
    speedup, ratio = reference["step_seconds"] / ours, packed_bytes / reference["expert_bytes"]
    print(f"config: hidden {WIDE_TEXT['hidden_size']}, latent {WIDE_TEXT['routed_expert_hidden_size']}, "
          f"{WIDE_TEXT['num_experts']} experts (top {WIDE_TEXT['num_experts_per_token']}), 4 layers; batch {BATCH} x "
          f"seq {SEQ}, LoRA rank {RANK}, bf16, {torch.get_num_threads()} CPU threads")
    print(f"reference (NeMo Automodel + PEFT, bf16 experts): {reference['step_seconds']:.3f} s/step, "
          f"routed experts {reference['expert_bytes'] / 2**20:.1f} MiB")
    print(f"moetune (MXFP4 experts kept packed):             {ours:.3f} s/step, "
          f"routed experts {packed_bytes / 2**20:.1f} MiB")
    print(f"speedup {speedup:.2f}x")
    print(f"RESULT k3_step_speedup={speedup:.2f} k3_resident_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
