"""The planner's kernels as the workers run them (planner.device_ops), on the meta device: for GPU workers KDA saves
what fla 0.6.0's chunk_kda keeps for its backward (the list restated here, per token and head), far less than the
CPU path it stands in for; a plan for CPU workers keeps the CPU path, and only the KDA layers change."""

import torch

import moetune.kernels.kda as kda
from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config
from moetune.workers.families import REGISTRY
from moetune.workers.planner.device_ops import kernels_as_run_on
from moetune.workers.planner.model import model_facts
from moetune.workers.planner.saved import SavedBytes

T, H, K, V = 256, 2, 16, 32


def _saved(device_type: str) -> int:
    shapes = [(1, T, H, K), (1, T, H, K), (1, T, H, V), (1, T, H, K), (1, T, H)]
    q, k, v, g, beta = (torch.empty(shape, device="meta", dtype=torch.float32 if i == 3 else torch.bfloat16)
                        .requires_grad_() for i, shape in enumerate(shapes))
    counter = SavedBytes(torch.nn.Module())
    with kernels_as_run_on(device_type), counter.counting():
        out, _ = kda.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert out.shape == v.shape and out.dtype == q.dtype
    return counter.total


def test_kda_on_gpu_workers_saves_what_fla_keeps():
    per_token_and_head = (2 * K * 2 + 2 * 4  # q and k normalised (bf16) and their fp32 inverse norms
                          + V * 2 + K * 4 + 2  # v, the fp32 gates and β as given
                          + K * 4  # the gates' chunk-local cumulative sum, fp32
                          + 2 * 64 * 2)  # Aqk and Akk, one 64-wide row per token, bf16
    assert _saved("cuda") == T * H * per_token_and_head
    assert _saved("cpu") > 2 * _saved("cuda")


def test_only_the_kda_layers_of_a_gpu_plan_change():
    config = REGISTRY["kimi_linear"].tiny_config()
    job = resolve_run_config(JobCreate(model="file:///unused", training_file="file:///unused",
                                       training={"seq_len": 256}), 0)
    gpu, cpu = (model_facts(config.to_dict(), job, torch.bfloat16, device).activations(1).layers
                for device in ("cuda", "cpu"))
    linear = [kind == "linear_attention" for kind in config.layer_types]
    assert all(g < c for g, c, is_kda in zip(gpu, cpu, linear) if is_kda)
    assert all(g == c for g, c, is_kda in zip(gpu, cpu, linear) if not is_kda)
