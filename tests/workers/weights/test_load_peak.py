"""The planner's load figure is what a rank holds at load: two gloo ranks stream a qwen3_moe checkpoint under ZeRO-3
at EP=1 with expert LoRA (the routed experts partitioned over both ranks, as over the ranks holding the same experts
at any EP) and build the engine as a job does (stream_model with the job's partitioner, trainable_model,
build_engine); each rank's peak resident memory over that stretch is within 10 % of
planner.memory.load_breakdown (no CUDA context on a CPU): the partitions, plus what the worst batch of parameters
holds whole beyond them. No rank ever holds its whole share of the frozen weights, which the loader did before it
partitioned as it loaded (then each rank peaked at 262 MB, 1.8 times this figure)."""

from __future__ import annotations

import ctypes
import json
import os
import threading

import pytest
import torch

from bench.support.harness import launch, spec

EP, WORLD = 1, 2
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
# fp32: non-expert weights (embeddings, attention) of ~46 MB, routed experts of ~201 MB (4 layers of a 33.6 MB
# gate_up and a 16.8 MB down), so the largest parameter (one gate_up, a batch of its own) is small beside the whole
CONFIG = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 1024,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
          "num_experts": 8, "num_experts_per_tok": 2}


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakResident:
    """The largest resident set seen while active, sampled every millisecond by a thread."""

    def __enter__(self):
        self.peak, self._stop = _resident_bytes(), threading.Event()

        def sample():
            while not self._stop.wait(0.001):
                self.peak = max(self.peak, _resident_bytes())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _resident_bytes())


def _load_rank(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    from moetune.workers.engine.deepspeed import build_engine
    from moetune.workers.model import load_partitioner, trainable_model
    from moetune.workers.experts.placement import job_placement
    from moetune.workers.weights.loader import stream_model

    job = spec(ep=EP, zero=3, train_experts=True)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    placement = job_placement(config, job.parallelism, job.lora)
    import peft  # noqa: F401 (imported, like DeepSpeed's modules by a first engine, before the baseline)

    build_engine(torch.nn.Linear(4, 4), job.training, job.parallelism, world, total_steps=1, bf16=False)
    # tensors of 1 MiB and more in pages of their own, which freeing gives back: otherwise glibc raises its mmap
    # threshold as they are freed and keeps later ones in its heap, and the resident set no longer falls with the
    # bytes allocated (what the CUDA allocator's peak counts on a GPU)
    ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 2**20)
    torch.manual_seed(1)
    before = _resident_bytes()
    with _PeakResident() as peak:  # the fetcher's bytes in flight bounded to 2 MiB
        streamed = stream_model(f"file://{model_dir}", torch.device("cpu"), torch.float32, placement, cache_dir="",
                                partition=load_partitioner(job.training, job.parallelism, torch.device("cpu")), chunk_bytes=2**20,
                                max_inflight_bytes=2 * 2**20)
        model = trainable_model(streamed.model, job.lora, job.training, placement)
        engine, _ = build_engine(model, job.training, job.parallelism, world, total_steps=1, bf16=False)
    held = sum(getattr(p, "ds_tensor", p).nbytes for p in engine.module.parameters())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak": peak.peak - before, "held_after": held}, f)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    path = str(tmp_path_factory.mktemp("qwen3-moe"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3MoeConfig(**CONFIG), dtype=torch.float32).save_pretrained(path)
    return path


def test_peak_at_load_under_zero3_is_the_planners_load_figure(model_dir, tmp_path):
    from moetune.workers.planner.memory import breakdown, load_breakdown, total
    from tests.support.layouts import layout
    from moetune.workers.planner.model import model_facts

    launch(_load_rank, WORLD, model_dir, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    with open(os.path.join(model_dir, "config.json")) as f:
        facts = model_facts(json.load(f), spec(ep=EP, zero=3, train_experts=True), torch.float32, "cpu")
    planned = layout(WORLD, EP, 3, False, 1)
    at_load = load_breakdown(facts, planned)
    figure = total(at_load) - at_load["cuda_context"]
    partitions = sum(breakdown(facts, planned)["frozen_weights"].values())
    for r in ranks:
        assert 0.9 * figure <= r["peak"] <= 1.1 * figure, (r, figure)
        assert r["peak"] < 0.75 * facts.load_bytes(EP)  # never the whole share
        assert r["held_after"] <= 1.05 * (partitions + at_load["lora_parameters"])  # the partitions stay
