"""`generate_batch` on an already built model (what a training worker evaluates with): each row equals that
prompt's transformers `generate` alone, though all prompts are prefilled in one left-padded forward; lockstep runs
the same number of forwards whatever the rows do: one prefill, one step per further token. A row ends early on a stop
token, or once the caller's `ends` holds for its tokens (a session's multi-token stop strings)."""

from __future__ import annotations

import pytest
import torch

from moetune.workers.generate import SamplingParams, generate_batch
from tests.workers.generate.conftest import FAMILIES
from tests.workers.generate.test_reference import PROMPTS, reference


@pytest.mark.parametrize("family_name", FAMILIES)
def test_rows_equal_generate_and_lockstep_keeps_the_forward_count(family_name, checkpoints, adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint, adapter = checkpoints[family_name], adapters[family_name, "experts"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32), adapter)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][:9]]  # 15, 6 and 9 tokens: two rows left-padded in the prefill
    want = [reference(checkpoint, adapter, p, n=8) for p in prompts]
    forwards = []
    model.base_model.model.register_forward_hook(lambda *args: forwards.append(1))
    assert generate_batch(model, prompts, SamplingParams(8, temperature=0.0), eos_token_id=258) == want
    assert len(forwards) <= 1 + 8 - 1 and all(want)  # one prefill for the three prompts, a step per further token

    forwards.clear()
    stops = tuple(w[2] for w in want)  # every row stops by its third token
    stopped = [w[:min((w.index(t) for t in stops if t in w))] for w in want]
    params = SamplingParams(8, temperature=0.0, stop_token_ids=stops)
    assert generate_batch(model, prompts, params, eos_token_id=258) == stopped
    assert len(forwards) <= 1 + 2  # finished rows leave; an empty batch stops
    forwards.clear()
    assert generate_batch(model, prompts, params, eos_token_id=258, lockstep=True) == stopped
    assert len(forwards) == 1 + 8 - 1  # lockstep: every forward runs, whatever the rows did

    forwards.clear()  # `ends` (a session's multi-token stop strings) ends a row on what it generated so far
    runs = {tuple(w[2:4]) for w in want}  # every row holds one of these two-token runs by its fourth token

    def ends(tokens):
        return any(tuple(tokens[i : i + 2]) in runs for i in range(len(tokens) - 1))

    ended = [w[: next(n for n in range(2, 9) if ends(w[:n]))] for w in want]
    assert generate_batch(model, prompts, SamplingParams(8, temperature=0.0), eos_token_id=258, ends=ends) == ended
    assert len(forwards) <= 1 + 3
