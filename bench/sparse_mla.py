"""Sparse MLA attention over the shared latent (absorbed, families/mla.py) vs over per-head keys (transformers'
expanded form, the fallback the same swap takes), on this CPU: a two-layer DeepSeek-V3.2 whose attention is the
seed model's shape scaled down (16 heads, 128-wide latent, 32 + 16 query/key dims, 32 value dims; top-256 of
T=2048), forward + backward of the LM loss with LoRA on every attention projection, median of a few runs.
Also the bytes autograd saves for the backward in each form (the model's other layers are the same in both): the
latent form keeps the absorbed queries and the latent-wide output (r + rope and r per head) where the expanded one
keeps per-head keys and values (nope + rope and v per head), more per token at every MLA shape (by the same count,
about 1.25x at glm5_next's and 1.9x at deepseek_v32's attention layers; the planner measures the form jobs run).

On a CPU the absorbed form costs more than it saves: its PyTorch path already gathers each block of queries' key
union once for all of them and all heads, so the latent removes no gather, while the scores and values run over
r + rope = 144 dims per head instead of 48 + 32. On a GPU the per-(query, head) gather is the cost the latent
removes (bench/gpu_check.py times the kernels).

    python bench/sparse_mla.py
Last line: RESULT absorbed_step_speedup=<expanded / absorbed time> saved_bytes_ratio=<expanded / absorbed>
"""

from __future__ import annotations

import statistics
import time
from unittest import mock

import torch

from moetune.workers.families import REGISTRY, apply_kernel_swaps, auto_model_class, mla
from moetune.workers.planner.saved import SavedBytes

SEQ, TOPK, REPS = 2048, 256, 3
ATTENTION = {"num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 64, "kv_lora_rank": 128,
             "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "index_topk": TOPK,
             "num_hidden_layers": 2, "first_k_dense_replace": 2, "hidden_size": 256, "intermediate_size": 256}


def _model():
    from peft import LoraConfig, get_peft_model

    config = REGISTRY["deepseek_v32"].tiny_config(**ATTENTION)
    torch.manual_seed(0)
    model = auto_model_class(config).from_config(config, dtype=torch.float32)
    apply_kernel_swaps(model)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_b_proj", "kv_b_proj", "o_proj"], lora_dropout=0.0)
    return get_peft_model(model, lora).train()


def _saved_by_layers(model, ids) -> int:
    """Bytes autograd saves for the backward over one forward (the planner's count: every storage once, no
    parameters): the attention forms differ in what they keep, the rest of the model is the same."""
    counter = SavedBytes(model)
    with counter.counting():
        model(input_ids=ids, labels=ids)
    return counter.total


def _step_seconds(model, ids) -> float:
    times = []
    for _ in range(REPS + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    model = _model()
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(1))
    absorbed = _step_seconds(model, ids)
    absorbed_saved = _saved_by_layers(model, ids)
    with mock.patch.object(mla, "_absorption", lambda module: None):  # the swap's expanded fallback
        expanded = _step_seconds(model, ids)
        expanded_saved = _saved_by_layers(model, ids)
    print(f"T={SEQ} top-{TOPK}, {ATTENTION['num_attention_heads']} heads, fwd+bwd of the LM loss, "
          f"median of {REPS}:")
    for name, seconds, saved in (("over per-head keys (expanded)", expanded, expanded_saved),
                                 ("over the shared latent", absorbed, absorbed_saved)):
        print(f"  {name:30s} {seconds * 1e3:8.1f} ms   saved for backward {saved / 2**20:6.1f} MiB")
    print(f"RESULT absorbed_step_speedup={expanded / absorbed:.3f} "
          f"saved_bytes_ratio={expanded_saved / absorbed_saved:.3f}")


if __name__ == "__main__":
    main()
