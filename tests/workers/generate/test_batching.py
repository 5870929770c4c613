"""Continuous batching: concurrent requests on different adapters and the base share one decode loop, and every
answer equals the same request's answer alone; the base is held once, adapter slots only for what is loaded."""

from __future__ import annotations

import asyncio

import torch
from safetensors.torch import load_file

from moetune.workers.generate import Engine, GenerationRequest, SamplingParams
from moetune.workers.generate.decoding import padding_mask
from tests.workers.generate.test_reference import PROMPTS


def _answer(engine, request):
    async def collect():
        return [e async for e in engine.stream(request)]
    return asyncio.run(collect())


def _together(engine, requests):
    async def all_at_once():
        async def one(request):
            return [e async for e in engine.stream(request)]
        return await asyncio.gather(*(one(r) for r in requests))
    return asyncio.run(all_at_once())


def test_eight_concurrent_requests_on_four_adapters_and_the_base(checkpoints, adapters):
    kinds = ("linear", "experts", "linear-2", "experts-2")
    uris = [adapters["kimi_linear", k] for k in kinds]
    # prompts of different lengths (rows join with different paddings), greedy and seeded sampling, some stop early
    requests = [GenerationRequest(PROMPTS[i % 2][: 15 - i], (uris + [None])[i % 5],
                                  SamplingParams(6 + i, temperature=0.0 if i % 3 else 0.9, seed=i)) for i in range(8)]
    engine = Engine.from_uri(checkpoints["kimi_linear"], max_batch=8)  # 8 adapter slots
    try:
        base_bytes = engine.stats()["base_bytes"]
        slot_bytes = [engine.stats()["adapter_slot_bytes"]]  # with 0 adapters loaded, then 1
        alone = [_answer(engine, requests[0])]
        slot_bytes.append(engine.stats()["adapter_slot_bytes"])
        alone += [_answer(engine, r) for r in requests[1:]]
        assert engine.stats()["peak_batch"] == 1
        together = _together(engine, requests)
        stats = engine.stats()
    finally:
        engine.close()
    assert engine.decode_device == engine.device  # the decode thread made the engine's device its own
    assert together == alone
    assert stats["peak_batch"] == 8  # all eight rows decoded in the same forwards
    assert all(events[-1].finish_reason in ("stop", "length") for events in together)
    assert len({tuple(e.token_id for e in events) for events in together}) == 8
    # the base once: its parameters and buffers did not grow with four adapters; each adapter loaded once
    assert stats["base_loads"] == 1 and stats["base_bytes"] == base_bytes
    assert stats["adapter_loads"] == 4 and stats["adapters_loaded"] == 4
    on_disk = [sum(t.nbytes for t in load_file(f"{uri}/adapter_model.safetensors").values()) for uri in uris]
    assert stats["adapter_bytes"] == sum(on_disk)
    # the slots hold what the loaded adapters hold (fp32 like their files, one rank), not a stack per slot
    assert slot_bytes == [0, on_disk[0]] and stats["adapter_slot_bytes"] == sum(on_disk)
    assert stats["cache_bytes"] == {}  # the batch left: nothing held


def test_decode_mask_masks_each_rows_left_padding():
    pads, width = [0, 3, 1, 5], 7
    row_by_row = torch.ones(len(pads), width, dtype=torch.long)
    for i, pad in enumerate(pads):
        row_by_row[i, :pad] = 0
    assert torch.equal(padding_mask(pads, width, "cpu"), row_by_row)
