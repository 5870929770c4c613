"""Adapters from object storage: loaded on first use, least recently used evicted beyond max_adapters (never one a
running request holds), a bad one refused with its cause while the engine keeps serving; prompts beyond the
context refused before anything runs."""

from __future__ import annotations

import asyncio

import pytest
from safetensors.torch import load_file

from moetune.api import storage
from moetune.workers.generate import (
    AdapterLoadError,
    ContextLengthError,
    Engine,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)
from tests.workers.generate.test_batching import _together
from tests.workers.generate.test_reference import PROMPTS, run


def test_adapters_from_storage_lru_and_bad_adapters(checkpoints, adapters, s3_bucket, s3_endpoint):
    base = f"s3://{s3_bucket}"
    storage.upload_dir(checkpoints["kimi_linear"], f"{base}/models/tiny")
    uris = {}
    for kind in ("linear", "experts", "linear-2"):
        uris[kind] = f"{base}/adapters/{kind}"
        storage.upload_dir(adapters["kimi_linear", kind], uris[kind])
    storage.upload_dir(adapters["qwen3_moe", "linear"], f"{base}/adapters/other-model")
    engine = Engine.from_uri(f"{base}/models/tiny", s3_endpoint_url=s3_endpoint, max_adapters=2)
    try:
        first = {kind: run(engine, PROMPTS[1], uri) for kind, uri in uris.items()}  # the third evicts the first
        stats = engine.stats()
        assert stats["adapter_evictions"] == 1 and stats["adapters"] == [uris["experts"], uris["linear-2"]]
        assert run(engine, PROMPTS[1], uris["linear"]) == first["linear"]  # reloaded into a reused slot
        assert engine.stats()["adapters"] == [uris["linear-2"], uris["linear"]]
        # the evicted expert LoRA's memory went with it: the slots hold the two linear adapters' factors
        held = sum(t.nbytes for kind in ("linear-2", "linear")
                   for t in load_file(f"{adapters['kimi_linear', kind]}/adapter_model.safetensors").values())
        assert engine.stats()["adapter_slot_bytes"] == held
        assert engine.stats()["adapter_loads"] == 4

        for uri, cause in ((f"{base}/adapters/missing", "not found"),
                           (f"{base}/adapters/other-model", "an adapter of another model")):
            with pytest.raises(AdapterLoadError, match=cause):
                run(engine, PROMPTS[1], uri)
        assert engine.stats()["adapter_load_failures"] == 2
        assert run(engine, PROMPTS[1], uris["experts"]) == first["experts"]  # still serving

    finally:
        engine.close()
    # one slot, two adapters at once: the second request waits for the first to leave, nothing is evicted under it
    engine = Engine.from_uri(f"{base}/models/tiny", max_adapters=1)
    try:
        requests = [GenerationRequest(PROMPTS[1], uris[k], SamplingParams(10, temperature=0.0))
                    for k in ("linear", "experts")]
        answers = [[e.token_id for e in events if e.token_id is not None] for events in _together(engine, requests)]
        assert answers == [first["linear"], first["experts"]]
        assert engine.stats()["peak_batch"] == 1 and engine.stats()["adapter_evictions"] == 1
    finally:
        engine.close()


def test_requests_beyond_the_context_or_out_of_range_are_refused(checkpoints):
    engine = Engine.from_uri(checkpoints["qwen3_moe"])
    try:
        context = engine.context_length
        too_long = GenerationRequest([65] * (context - 5), None, SamplingParams(10, temperature=0.0))
        with pytest.raises(ContextLengthError, match=f"maximum context length is {context} tokens") as refused:
            asyncio.run(anext(engine.stream(too_long)))
        assert isinstance(refused.value, ValueError) and refused.value.param == "max_tokens"
        with pytest.raises(InvalidRequestError, match="prompt token ids"):
            engine.check(GenerationRequest([engine.vocab_size], None, SamplingParams(1)))
        with pytest.raises(InvalidRequestError, match="max_new_tokens"):
            SamplingParams(0)
        assert engine.stats()["requests"] == 0  # refused before anything ran
        assert run(engine, PROMPTS[1], None, n=3)  # and the engine serves the next request
    finally:
        engine.close()
