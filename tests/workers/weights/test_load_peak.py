"""The planner's load figure is what a rank holds at load: two gloo ranks stream a qwen3_moe checkpoint at EP=2
and build the ZeRO-3 engine as a job does (stream_model, trainable_model, build_engine); each rank's peak resident
memory over that stretch is within 10 % of planner.memory.load_breakdown (no CUDA context on a CPU). The planner's
training figure for the same layout counts the non-expert weights ZeRO-3-partitioned, which the loader never is
before DeepSpeed's initialize: the rank holds far more than that figure at load."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from bench.support.harness import launch, spec

EP, WORLD = 2, 2
# non-expert weights (embeddings, attention) of ~135 MB, routed experts of ~100 MB (50 MB per EP rank), fp32
CONFIG = {"vocab_size": 32768, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 1024,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
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
    from moetune.workers.model import trainable_model
    from moetune.workers.experts.placement import job_placement
    from moetune.workers.weights.loader import stream_model

    job = spec(ep=EP, zero=3)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    placement = job_placement(config, job)
    import peft  # noqa: F401 (imported, like DeepSpeed's modules by a first engine, before the baseline)

    build_engine(torch.nn.Linear(4, 4), job, world, total_steps=1, bf16=False)
    torch.manual_seed(1)
    before = _resident_bytes()
    with _PeakResident() as peak:  # the fetcher's bytes in flight bounded to 2 MiB
        streamed = stream_model(f"file://{model_dir}", torch.device("cpu"), torch.float32, placement, cache_dir="",
                                chunk_bytes=2**20, max_inflight_bytes=2 * 2**20)
        model = trainable_model(streamed.model, job, placement)
        engine, _ = build_engine(model, job, world, total_steps=1, bf16=False)
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
    from moetune.workers.planner.memory import Layout, breakdown, load_breakdown, total
    from moetune.workers.planner.model import model_facts

    launch(_load_rank, WORLD, model_dir, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    with open(os.path.join(model_dir, "config.json")) as f:
        facts = model_facts(json.load(f), spec(ep=EP, zero=3), torch.float32)
    layout = Layout(WORLD, EP, 3, False, 1)
    at_load = load_breakdown(facts, layout)
    figure = total(at_load) - at_load["cuda_context"]
    trained = breakdown(facts, layout)["frozen_weights"]
    for r in ranks:
        assert 0.9 * figure <= r["peak"] <= 1.1 * figure, (r, figure)
        assert r["peak"] > 1.3 * sum(trained.values())  # ZeRO-3's partition does not exist yet at load
        assert r["held_after"] < 0.75 * figure  # and once DeepSpeed has partitioned, the rank holds less
