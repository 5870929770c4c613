"""Context parallelism on CPU gloo ranks: one long sequence of the tiny Kimi K3 (KDA and gated MLA layers, Attention
Residuals, a latent MoE; its kernel swaps and LoRA on every projection, SFT's loss through the output layer), unsplit
on one rank and split over 2 and 4 context-parallel ranks (workers.families.context) at the same total length.

Per rank: the bytes autograd saves for the backward (planner.saved's count: what context parallelism divides; the
whole row's gathered MLA keys and every rank's KDA state summary included) and the time of a forward and backward
(the second of two; the slowest rank's). Then the longest length each CP size fits in one memory budget (the
unsplit rank's saved bytes at --length), on a ladder of steps of √2. Every rank runs one thread; 4 ranks on a 2-core
machine share its cores, so CP=4's step time says little there.

    python bench/context_parallel.py [--length 8192] [--ladder-max 65536]

Last line: RESULT cp2_peak_ratio=… cp4_peak_ratio=… cp4_max_len_ratio=… cp2_step_ratio=… (CP=N over CP=1)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support

LADDER_GRAIN = 4096
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj", "q_proj", "k_proj",
           "v_proj", "f_a_proj", "f_b_proj", "b_proj", "gate_proj", "up_proj", "down_proj"]


def _rank(rank: int, world: int, tokens: int, out_dir: str) -> None:
    import contextlib

    import torch
    from peft import LoraConfig, inject_adapter_in_model

    from bench.support.tiny_models import plain_model
    from moetune.workers.families import REGISTRY
    from moetune.workers.families.context import context_parallel
    from moetune.workers.methods.batch import Batch
    from moetune.workers.methods.context_cut import cut_for_context
    from moetune.workers.methods.sft import SupervisedMethod
    from moetune.workers.planner.saved import SavedBytes

    family = REGISTRY["kimi_k3"]
    model = plain_model(family)
    family.apply_kernel_swaps(model)
    inject_adapter_in_model(LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS), model.language_model)
    method = SupervisedMethod(tokenizer=None, seq_len=tokens)
    method.prepare(model)
    ids = torch.randint(3, 272, (1, tokens), generator=torch.Generator().manual_seed(0))
    batch = Batch({"input_ids": ids}, ids, tokens)
    if world > 1:  # the rank's part as a job's step cuts it (labels one token past the slice)
        batch, layout = cut_for_context(batch, world, rank, pad_id=0)
    seconds = saved = 0.0
    for _ in range(2):  # the first pays for first calls
        counter = SavedBytes(model)
        started = time.perf_counter()
        with context_parallel(model, layout) if world > 1 else contextlib.nullcontext(), counter.counting():
            method.loss_sum(model, batch).backward()
        seconds, saved = time.perf_counter() - started, counter.total
        model.zero_grad(set_to_none=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"saved": saved, "seconds": seconds}, f)


def _step(world: int, tokens: int) -> dict:
    """The slowest rank's step time and the largest rank's saved bytes."""
    from bench.support.harness import launch

    with tempfile.TemporaryDirectory() as out:
        launch(_rank, world, tokens, out)
        ranks = [json.loads(open(os.path.join(out, f"rank{r}.json")).read()) for r in range(world)]
    result = {"saved": max(r["saved"] for r in ranks), "seconds": max(r["seconds"] for r in ranks)}
    print(f"  CP={world} T={tokens:>7,}: saved {result['saved'] / 2**20:8.1f} MiB per rank (largest), step "
          f"{result['seconds']:6.2f} s (slowest rank)", flush=True)
    return result


def _longest(world: int, budget: float, start: int, ladder_max: int, known: dict) -> int:
    """The longest length on a ladder of steps of √2 (multiples of 4,096 tokens) whose largest rank saves at most
    `budget` bytes."""
    best, tokens = 0, start
    while tokens <= ladder_max:
        if (known.get(tokens) or _step(world, tokens))["saved"] > budget:
            break
        best, tokens = tokens, max(tokens + LADDER_GRAIN, round(tokens * 2**0.5 / LADDER_GRAIN) * LADDER_GRAIN)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--ladder-max", type=int, default=65536)
    args = parser.parse_args()
    print(f"tiny Kimi K3, one sequence of {args.length:,} tokens, fp32, one thread per rank", flush=True)
    at = {world: _step(world, args.length) for world in (1, 2, 4)}
    budget = at[1]["saved"]
    print(f"longest length within {budget / 2**20:.1f} MiB (CP=1's saved bytes at {args.length:,}):", flush=True)
    longest = {world: _longest(world, budget, args.length, args.ladder_max, {args.length: at[world]})
               for world in (1, 4)}
    print(f"CP=1 {longest[1]:,} tokens, CP=4 {longest[4]:,} tokens")
    print(f"RESULT cp2_peak_ratio={at[2]['saved'] / budget:.3f} cp4_peak_ratio={at[4]['saved'] / budget:.3f} "
          f"cp4_max_len_ratio={longest[4] / longest[1]:.2f} "
          f"cp2_step_ratio={at[2]['seconds'] / at[1]['seconds']:.3f}")


if __name__ == "__main__":
    main()
