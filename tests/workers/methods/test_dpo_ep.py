"""DPO with the routed experts split over two ranks (tests/workers/experts/cases.py DPO_CASES: qwen3_moe, EP=2,
ZeRO-3, expert LoRA), each rank its own two pairs through the DeepSpeed engine built as a job builds it (the
method's output layer installed first): both forwards, LoRA off then on, cross the experts' all-to-all on both
ranks, in one step of the job's step runner. The same DPO code in one process, on the same model with every expert
local (EP=1, no engine) over all four pairs in one micro-batch, gives the same mean loss, every LoRA gradient
(expert LoRA: each rank's slice) and the same rewards; and its reference log-probabilities are the base model's
(every LoRA B zero). LoRA B starts random, so the reference is not the policy. Resume: after the optimizer's step 1
the state is saved (workers.checkpoints.save), and an engine built afresh that loads it takes steps 2 and 3 with
exactly the losses of the engine that went on.

Sabotage noted: the experts' LoRA left on in the reference (lora_off without its expert part) fails the base check;
the step's loss scale without the data-parallel factor (1 / pairs instead of world / pairs) fails the gradients;
the fresh engine not loading the state fails the resume (step 2's loss 3.21 against 2.12)."""

from types import SimpleNamespace

import pytest
import torch

from moetune.api.models.run_config import RunConfig
from bench.support.harness import launch, spec
from tests.workers.experts.cases import DPO_CASES

BETA, PAIRS_PER_RANK = 0.5, 2
PAD = SimpleNamespace(pad_token_id=0)  # the collate's padding id (the pairs are token ids, no tokenizer)


def _pairs(rank: int) -> list:
    from tests.workers.methods.test_dpo import random_pairs

    return random_pairs(100 + rank, PAIRS_PER_RANK)


def _model(family_name: str, job: RunConfig):
    """The job's model (LoRA B random, the method's output layer in) before the engine wraps it, and the method."""
    from moetune.workers.experts.placement import job_placement
    from moetune.workers.families import REGISTRY
    from moetune.workers.methods.dpo import DpoMethod
    from moetune.workers.model import trainable_model
    from bench.support.tiny_models import plain_model
    from tests.workers.methods.test_dpo import random_lora_b

    model = plain_model(REGISTRY[family_name])
    torch.manual_seed(1)
    placement = job_placement(model.config.to_dict(), job.parallelism, job.lora)
    model = trainable_model(model, job.lora, job.training, placement)
    random_lora_b(model)
    method = DpoMethod(PAD, seq_len=64, beta=BETA)
    method.prepare(model)
    return model, method


def run_dpo(rank: int, world: int, family_name: str, spec_json: str, out_dir: str) -> None:
    """Rank `rank` of the EP=2 run, one step of the job's step runner (the optimizer held back, so that the step's
    gradients can be read), then (rank 0) the one-process run of the same pairs."""
    import os

    from deepspeed.utils import safe_get_full_grad

    from moetune.workers.checkpoints.save import load_checkpoint, save_checkpoint
    from moetune.workers.engine.deepspeed import build_engine
    from moetune.workers.loop.collectives import Collectives
    from moetune.workers.loop.step import RankPlace, StepRunner
    from moetune.workers.methods.dpo import lora_off
    from tests.workers.methods.test_dpo import random_lora_b

    job = RunConfig.model_validate_json(spec_json)
    cpu = torch.device("cpu")
    model, method = _model(family_name, job)
    engine, _ = build_engine(model, job.training, job.parallelism, world, job.training.max_steps, bf16=False)
    engine.step = lambda: None  # the optimizer is not under test: the gradients stay
    runner = StepRunner(engine, method, job, RankPlace(rank, world, 0, cpu, collective_forward=True),
                        Collectives(cpu), lambda *args, **kwargs: None, total_steps=1)
    pairs = [p for r in range(world) for p in _pairs(r)]
    loss_sum, count, _ = runner.run(1, pairs)
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    result = {"loss": loss_sum / count, "figures": runner.figures, "grads": grads}

    # resume: the optimizer takes step 1, the state is saved, and an engine built afresh that loads it takes steps
    # 2 and 3 with the losses of the engine that went on
    del engine.step  # DeepSpeed's own step again: the optimizer's, at step 1's accumulation boundary
    engine.step()
    state = os.path.join(out_dir, "state")
    save_checkpoint(engine, state, is_writer=rank == 0)
    result["went_on"] = [runner.run(step, pairs)[0] for step in (2, 3)]
    fresh, fresh_method = _model(family_name, job)
    resumed, _ = build_engine(fresh, job.training, job.parallelism, world, job.training.max_steps, bf16=False)
    load_checkpoint(resumed, state)
    again = StepRunner(resumed, fresh_method, job, RankPlace(rank, world, 0, cpu, collective_forward=True),
                       Collectives(cpu), lambda *args, **kwargs: None, total_steps=1)
    result["resumed"] = [again.run(step, pairs)[0] for step in (2, 3)]

    one = spec(ep=1, zero=job.parallelism.zero_stage, train_experts=True)  # every expert on each rank
    single, method = _model(family_name, one)  # on both ranks: the expert groups are made collectively
    if rank == 0:
        batch = method.collate(pairs)
        loss = method.loss_sum(single, batch)
        (loss / len(pairs)).backward()
        result["one_process"] = {"loss": loss.item() / len(pairs), "figures": method.figures(method.figure_sums()),
                                 "grads": {n: p.grad.clone() for n, p in single.named_parameters()
                                           if p.requires_grad}}
        with torch.no_grad():  # the reference is the base: every LoRA off, PEFT's and the experts' own
            with lora_off(single):
                result["lora_off"] = method.log_probs(single, batch)
            random_lora_b(single, scale=0.0)
            result["base"] = method.log_probs(single, batch)
    os.makedirs(out_dir, exist_ok=True)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("case", list(DPO_CASES))
def test_dpo_ep2_equals_one_process(case, tmp_path):
    family, job = DPO_CASES[case]
    assert job.parallelism.expert_parallel_size == 2 and job.lora.train_experts
    launch(run_dpo, 2, family, job.model_dump_json(), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:  # resumed from the state saved after step 1: LoRA (the experts' shards too) and Adam restored
        assert r["resumed"] == r["went_on"]  # exact
    want = ranks[0]["one_process"]
    torch.testing.assert_close(ranks[0]["lora_off"], ranks[0]["base"], rtol=1e-6, atol=1e-5)
    assert abs(want["loss"] - 0.6931) > 0.01  # the policy is not the reference
    for r in ranks:  # the global batch's mean loss and rewards, on every rank
        assert r["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert r["figures"].keys() == want["figures"].keys()
        for name, value in r["figures"].items():
            assert value == pytest.approx(want["figures"][name], rel=1e-4, abs=1e-6), name
    assert ranks[0]["grads"].keys() == want["grads"].keys()
    assert any(".experts.lora_gate_up_b" in n for n in want["grads"])
    for name, expected in want["grads"].items():
        assert expected.abs().max() > 0, name
        for rank, r in enumerate(ranks):
            if ".experts." in name:  # this rank's half of the experts
                half = expected.shape[0] // 2
                expected_here = expected[rank * half:(rank + 1) * half]
            else:
                expected_here = expected
            scale = float(expected_here.abs().max())
            torch.testing.assert_close(r["grads"][name], expected_here, rtol=1e-4, atol=1e-5 * scale, msg=name)
