"""A quantized base is served with its frozen weights kept quantized (FP8-block linears and routed experts) and
generates what transformers' own dequantized model + PEFT generates with the same adapter, alone and in a batch
that mixes the adapter and the base."""

from __future__ import annotations

from moetune.kernels.moe.linear import QuantizedLinear
from moetune.kernels.quant import held_names
from moetune.workers.generate import Engine, GenerationRequest, SamplingParams
from bench.support.adapters import write_adapter, write_checkpoint
from bench.support.quantized import quantize_checkpoint
from tests.workers.generate.test_batching import _together
from tests.workers.generate.test_reference import PROMPTS, reference, run


def test_fp8_base_stays_quantized_and_matches_transformers_dequantized(tmp_path):
    from transformers import FineGrainedFP8Config

    checkpoint = quantize_checkpoint(write_checkpoint("deepseek_v3", tmp_path / "dense"), str(tmp_path / "fp8"), "fp8")
    adapter = write_adapter("deepseek_v3", tmp_path / "adapter", seed=5, experts=True)
    engine = Engine.from_uri(checkpoint)
    try:
        assert any(isinstance(m, QuantizedLinear) for m in engine.model.modules())
        assert all(held_names(experts.experts) for experts in engine.base.experts.values())
        answers = [run(engine, p, adapter, n=8) for p in PROMPTS]
        mixed = _together(engine, [GenerationRequest(p, a, SamplingParams(8, temperature=0.0))
                                   for p, a in ((PROMPTS[0], adapter), (PROMPTS[1], None))])
        base_alone = run(engine, PROMPTS[1], None, n=8)
    finally:
        engine.close()
    dequantized = FineGrainedFP8Config(dequantize=True)
    assert answers == [reference(checkpoint, adapter, p, n=8, quantization_config=dequantized) for p in PROMPTS]
    assert [[e.token_id for e in events if e.token_id is not None] for events in mixed] == [answers[0], base_alone]
