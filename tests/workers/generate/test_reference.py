"""Greedy generation through the engine equals plain transformers + PEFT `generate` token for token: the family's
own class loaded from the same checkpoint, PeftModel.from_pretrained with the same adapter."""

from __future__ import annotations

import asyncio

import pytest
import torch

from moetune.workers.generate import Engine, GenerationRequest, SamplingParams
from tests.workers.generate.conftest import FAMILIES

PROMPTS = ([257, 260, 119, 104, 97, 116, 32, 100, 111, 101, 115, 32, 97, 100, 97], [257, 49, 32, 50, 32, 51])
NEW_TOKENS = 10


def run(engine: Engine, prompt: list[int], adapter: str | None, n: int = NEW_TOKENS) -> list[int]:
    async def collect():
        request = GenerationRequest(prompt, adapter, SamplingParams(n, temperature=0.0))
        return [e.token_id async for e in engine.stream(request) if e.token_id is not None]
    return asyncio.run(collect())


def reference(checkpoint: str, adapter: str | None, prompt: list[int], n: int = NEW_TOKENS,
              quantization_config=None) -> list[int]:
    """transformers + PEFT greedy `generate` (a quantized checkpoint: transformers' own dequantized model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                 quantization_config=quantization_config)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    out = model.eval().generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    return out[:out.index(258)] if 258 in out else out  # the engine does not emit the stop token


@pytest.mark.parametrize("family_name", FAMILIES)
def test_greedy_equals_transformers_and_peft(family_name, checkpoints, adapters):
    engine = Engine.from_uri(checkpoints[family_name])
    if family_name == "kimi_linear":  # the engine runs moetune's KDA core (prefill) with transformers' cache
        assert any(getattr(m, "_moetune_kda", False) for m in engine.model.modules())
    try:
        for adapter in (None, adapters[family_name, "linear"], adapters[family_name, "experts"]):
            answers = [run(engine, p, adapter) for p in PROMPTS]
            assert answers == [reference(checkpoints[family_name], adapter, p) for p in PROMPTS], adapter
            assert all(answers), "an empty answer compares nothing"
        base, tuned = run(engine, PROMPTS[0], None), run(engine, PROMPTS[0], adapters[family_name, "experts"])
        assert base != tuned  # the adapter changes the answer: the comparison above is not vacuous
    finally:
        engine.close()
