"""One training step of a checkpoint exactly as a job's rank assembles it: `build_model("train")` (under ZeRO-3 the
load partitioner puts each frozen weight into its partition as it streams), the method's loss head, the engine,
the MoE metrics hooks, forward, backward, optimizer step, the metrics' step end. The CPU suite runs it with
moetune's implicit allocations sent to the meta device (bench.support.host_tensors); bench/gpu_check.py runs it on
CUDA, where a tensor left on the host fails for real."""

from __future__ import annotations

import contextlib
import json
import os

import torch

from moetune.api.models.run_config import RunConfig


def packed_batch(method, rank: int, vocab: int):
    """Two sequences of different lengths per rank (packed where the family packs), loss on every token."""
    from moetune.workers.methods.sft import Example

    g = torch.Generator().manual_seed(rank)
    examples = [Example(ids, ids) for ids in (torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 14))]
    return method.collate(examples)


def builder_step(rank: int, world: int, model_dir: str, spec_json: str, out_dir: str, device=None) -> dict:
    """Runs the step on `device` (CPU by default, and then under implicit_device_elsewhere). Saves and returns the
    loss, the names of tensors found on the meta device afterwards, and the figures of the step."""
    from prometheus_client import CollectorRegistry

    from moetune.workers.engine.deepspeed import build_engine
    from moetune.workers.methods.sft import SupervisedMethod
    from moetune.workers.model import TRAIN, WeightsSource, build_model
    from moetune.workers.reporting.moe import MoEMetrics
    from bench.support.host_tensors import implicit_device_elsewhere, meta_tensors

    job = RunConfig.model_validate_json(spec_json)
    device = device or torch.device("cpu")
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    method = SupervisedMethod(None, seq_len=64)
    torch.manual_seed(1)
    def on_device():  # on a GPU the host is elsewhere already
        return implicit_device_elsewhere() if device.type == "cpu" else contextlib.nullcontext()

    with on_device():
        built = build_model(TRAIN, config, job, device=device, weights=WeightsSource(f"file://{model_dir}", ""))
        method.prepare(built.model)
        engine, _ = build_engine(built.model, job.training, job.parallelism, world, 1, bf16=device.type == "cuda")
        moe = MoEMetrics(engine.module, CollectorRegistry(), {"job_id": "builder-step"}, export_load=rank == 0)
    # the data is made on the host, as the loop makes it, and moved
    batch = packed_batch(method, rank, built.model.config.get_text_config().vocab_size).to(device)
    with on_device():
        loss = method.loss_sum(engine, batch)
        engine.backward(loss)
        engine.step()
        figures = moe.step_end()
    result = {"loss": loss.item(), "on_meta": meta_tensors(engine.module, expert_load=moe.load.totals),
              "layers": len(moe.load.layers), "figures": figures}
    os.makedirs(out_dir, exist_ok=True)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    return result
