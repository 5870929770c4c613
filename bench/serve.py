"""Serving throughput of moetune's generation engine on a tiny-but-wide kimi_linear (3 KDA layers and an MLA layer,
a MoE MLP with 16 routed experts and a shared one, a 32K vocabulary), on CPU in fp32, in this process.

- single: 8 concurrent requests on one adapter (LoRA on every linear plus expert LoRA, rank 8);
- mixed: the same 8 requests, each on a different adapter (8 adapters in one batch, per-row selection);
- sequential: transformers `generate` + PEFT (PeftModel.from_pretrained on KimiLinearForCausalLM, the same
  checkpoint and adapter), the same prompts one request at a time, greedy;
- time to first token: one request on the idle engine (median of 5).
Decode tokens/s counts every generated token over the wall time of the run (prefills included).

    python bench/serve.py [--new-tokens 48] [--prompt-tokens 32] [--threads 2]

Last line: `RESULT mixed_adapter_ratio=<mixed / single> batched_speedup=<single / sequential> ttft_ms=<ms>`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support

import torch

CONCURRENT = 8
WIDE = {"vocab_size": 32768, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
        "num_hidden_layers": 4, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 4, "linear_num_heads": 4, "linear_head_dim": 64,
        "num_local_experts": 16}


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[257] + torch.randint(0, 256, (length - 1,), generator=g).tolist() for _ in range(n)]


def _engine_run(engine, prompts, adapters, new_tokens) -> tuple[float, int]:
    from moetune.workers.generate import GenerationRequest, SamplingParams

    async def run():
        async def one(prompt, adapter):
            request = GenerationRequest(prompt, adapter, SamplingParams(new_tokens, temperature=0.0))
            return len([e async for e in engine.stream(request) if e.token_id is not None])
        return await asyncio.gather(*(one(p, a) for p, a in zip(prompts, adapters, strict=True)))

    started = time.perf_counter()
    tokens = sum(asyncio.run(run()))
    return tokens / (time.perf_counter() - started), tokens


def _ttft_ms(engine, prompt, adapter) -> float:
    from moetune.workers.generate import GenerationRequest, SamplingParams

    async def first():
        started = time.perf_counter()
        async for _ in engine.stream(GenerationRequest(prompt, adapter, SamplingParams(1, temperature=0.0))):
            return (time.perf_counter() - started) * 1000
    return statistics.median(asyncio.run(first()) for _ in range(5))


def _sequential(checkpoint, adapter, prompts, new_tokens) -> tuple[float, int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32),
                                      adapter).eval()
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False)  # warm-up
    started, tokens = time.perf_counter(), 0
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
            tokens += out.shape[1] - len(prompt)
    return tokens / (time.perf_counter() - started), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from moetune.workers.families import REGISTRY
    from moetune.workers.generate import Engine
    from bench.support.adapters import write_adapter, write_checkpoint

    config = REGISTRY["kimi_linear"].tiny_config(**WIDE)
    prompts = _prompts(CONCURRENT, args.prompt_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint("kimi_linear", os.path.join(tmp, "base"), config=config)
        adapters = [write_adapter("kimi_linear", os.path.join(tmp, f"adapter-{i}"), seed=i, experts=True, rank=8,
                                  config=config) for i in range(CONCURRENT)]
        engine = Engine.from_uri(checkpoint, max_adapters=CONCURRENT, max_batch=CONCURRENT)
        try:
            _engine_run(engine, prompts, adapters, 2)  # warm-up: every adapter loaded
            single, single_tokens = _engine_run(engine, prompts, [adapters[0]] * CONCURRENT, args.new_tokens)
            mixed, mixed_tokens = _engine_run(engine, prompts, adapters, args.new_tokens)
            ttft = _ttft_ms(engine, prompts[0], adapters[0])
            stats = engine.stats()
        finally:
            engine.close()
        sequential, sequential_tokens = _sequential(checkpoint, adapters[0], prompts, args.new_tokens)
    print(f"engine, {CONCURRENT} concurrent, 1 adapter:  {single:8.1f} tokens/s ({single_tokens} tokens)")
    print(f"engine, {CONCURRENT} concurrent, {CONCURRENT} adapters: {mixed:8.1f} tokens/s ({mixed_tokens} tokens)")
    print(f"transformers + PEFT generate, one at a time: {sequential:8.1f} tokens/s ({sequential_tokens} tokens)")
    print(f"time to first token (idle engine, {args.prompt_tokens}-token prompt): {ttft:.1f} ms")
    print(f"engine: peak batch {stats['peak_batch']}, adapter slots {stats['adapter_slot_bytes'] / 2**20:.1f} MiB, "
          f"base {stats['base_bytes'] / 2**20:.1f} MiB held once")
    print(f"RESULT mixed_adapter_ratio={mixed / single:.3f} batched_speedup={single / sequential:.3f} "
          f"ttft_ms={ttft:.1f}")


if __name__ == "__main__":
    main()
