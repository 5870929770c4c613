"""One optimizer step of a supervised job through the step runner as a job's rank runs it (SFT's packed
micro-batches, its loss head, gradient accumulation over two micro-batches), with context parallelism or without:
the summed loss and token counts, every trainable parameter's gradient at the accumulation boundary, and then the
validation loss on five of the examples."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from moetune.api.models.run_config import RunConfig

SEQ_LEN, VOCAB = 40, 272


def train_set() -> list:
    """Eight text examples of 9 to 37 tokens (every one trains on every token, as a `{"text": ...}` row)."""
    from moetune.workers.methods.sft import Example

    generator = torch.Generator().manual_seed(5)
    lengths = torch.randint(9, 38, (8,), generator=generator).tolist()
    rows = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    return [Example(ids, list(ids)) for ids in rows]


def run_context_step(rank: int, world: int, family_name: str, spec_json: str, out_dir: str) -> None:
    from deepspeed.utils import safe_get_full_grad

    from bench.support.harness import make_engine
    from moetune.workers.loop.collectives import Collectives
    from moetune.workers.loop.context_split import ContextSplit
    from moetune.workers.loop.step import RankPlace, StepRunner
    from moetune.workers.methods.sft import SupervisedMethod

    job = RunConfig.model_validate_json(spec_json)
    cpu = torch.device("cpu")
    method = SupervisedMethod(SimpleNamespace(pad_token_id=0), SEQ_LEN)
    engine = make_engine(rank, world, family_name, job, method=method)
    par = job.parallelism
    context = ContextSplit(engine.module, par, rank, 0) if par.context_parallel_size > 1 else None
    place = RankPlace(rank, world, job.seed, cpu, collective_forward=par.collective_forward, context=context)
    runner = StepRunner(engine, method, job, place, Collectives(cpu), lambda *a, **k: None, 1)
    grads, stepped = {}, engine.step

    def step():  # the gradients the optimizer is about to apply
        if engine.is_gradient_accumulation_boundary():
            grads.update({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()
                          if p.requires_grad})
        stepped()

    engine.step = step
    loss_sum, loss_tokens, tokens = runner.run(1, train_set())
    valid_loss = runner.validation_loss(train_set()[:5])
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"loss_sum": loss_sum, "loss_tokens": loss_tokens, "tokens": tokens, "grads": grads,
                "valid_loss": valid_loss}, os.path.join(out_dir, f"rank{rank}.pt"))
