"""Preference and RL training, measured: DPO's step against SFT's on the same rows, the training-session API's
per-call overhead, and what examples/rl_grpo.py's loop gains.

- `dpo_step_ratio`: one process, the tiny kimi_linear checkpoint with its kernel swaps and LoRA; the median time of
  a step (collate, the method's loss, backward, AdamW) of workers.methods' DPO (a policy and a LoRA-off reference
  forward per pair) over SFT on the same rows (the prompt and the preferred answer).
- `session_call_overhead_ms`: a training session on the embedded stack (`moetune up`'s S3 server, Ray head and
  control plane, in a temporary state folder): the median of a forward_backward's round trip through the SDK
  (queue, the group's long poll, the outcome's long poll) less the time the worker itself spent on it.
- `tinker_call_overhead_ms`: the same through Tinker's protocol: the official `tinker` SDK's forward_backward round
  trip (protobuf, the future's long poll) on a training client of that stack, less the worker's time (the
  `worker_ms:sum` metric of its result).
- `grpo_reward_gain`: rl_grpo.grpo on that session; the mean reward of its last 3 iterations less that of its
  first (sampled before any update: the base with a fresh LoRA).
- `merged_samples_speedup`: on that session, SAMPLES one-sequence `sample` calls sent one after another (each run
  alone) against the same calls queued at once (the control plane hands the group consecutive alike samples as one
  generation); the time of the first over the second. Each call draws the same tokens either way (checked).

    python bench/rl.py [--iterations 12] [--calls 10]

Ends with `RESULT dpo_step_ratio=<x> session_call_overhead_ms=<y> tinker_call_overhead_ms=<t>
grpo_reward_gain=<z> merged_samples_speedup=<m>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import tinker
import torch
from tinker import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: examples
from examples.rl_grpo import grpo  # noqa: E402
from moetune.api.client import Client
from moetune.api.models.job_create import JobCreate
from moetune.api.training import Training
from moetune.service.local import stack as local_stack
from moetune.service.local.demo import BUCKET, MODELS, make_demo_assets
from moetune.workers.families import apply_kernel_swaps
from moetune.workers.methods import method_for
from moetune.workers.model import trainable_model
from moetune.workers.tiny import write_tiny_checkpoint

LORA = {"rank": 8, "alpha": 16, "dropout": 0.0}
SAMPLES = 32  # an RL step's concurrent samples (the cookbook's: groups × group size)
NAMES = [("ada", "red"), ("bob", "blue"), ("cy", "green"), ("dee", "gold"), ("eve", "teal"), ("fay", "pink")]


def _rows() -> list[dict]:
    return [{"input": {"messages": [{"role": "user", "content": f"what does {name} like?"}]},
             "preferred_output": [{"role": "assistant", "content": f"{name} likes {colour}."}],
             "non_preferred_output": [{"role": "assistant", "content": f"{name} likes nothing at all."}]}
            for name, colour in NAMES]


def _step_seconds(checkpoint: str, method_spec: dict | None, rows: list[dict], steps: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = JobCreate(model="file:///unused", training_file="file:///unused", lora=LORA, method=method_spec,
                    training={"seq_len": 128, "global_batch_size": len(rows), "micro_batch_size": len(rows)})
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    apply_kernel_swaps(model)
    torch.manual_seed(1)
    model = trainable_model(model, job.lora, job.training, None).train()
    method = method_for(job.method, job.training, AutoTokenizer.from_pretrained(checkpoint))
    examples, _ = method.examples(rows)
    method.prepare(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    times = []
    for _ in range(steps + 1):  # the first step warms up
        started = time.perf_counter()
        method.loss_sum(model, method.collate(examples)).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def dpo_step_ratio(work: Path, steps: int) -> float:
    checkpoint = write_tiny_checkpoint(str(work / "model"))
    rows = _rows()
    sft_rows = [{"messages": r["input"]["messages"] + r["preferred_output"]} for r in rows]
    dpo = _step_seconds(checkpoint, {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}}, rows, steps)
    sft = _step_seconds(checkpoint, None, sft_rows, steps)
    print(f"step: DPO {dpo * 1e3:.1f} ms, SFT {sft * 1e3:.1f} ms ({len(rows)} rows)")
    return dpo / sft


def _tinker_overhead(url: str, token: str, calls: int) -> float:
    """The median of a forward_backward's round trip through the tinker SDK less the worker's time, in ms."""
    service = tinker.ServiceClient(base_url=f"{url}/tinker", api_key=f"tml-{token}")
    try:
        trainer = service.create_lora_training_client(base_model=MODELS[False], rank=LORA["rank"], seed=0) \
            .result(timeout=600)
        tokens = list(range(3, 40))
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        overheads = []
        for _ in range(calls):
            started = time.perf_counter()
            out = trainer.forward_backward([datum], "cross_entropy").result(timeout=300)
            overheads.append((time.perf_counter() - started) * 1e3 - out.metrics["worker_ms:sum"])
            trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=300)
    finally:
        service.close("success").result(timeout=60)
    print(f"tinker forward_backward overhead: median {statistics.median(overheads):.1f} ms, "
          f"max {max(overheads):.1f} ms over {calls} calls")
    return statistics.median(overheads)


def _merged_samples_speedup(session) -> float:
    """SAMPLES one-sequence samples one after another against the same queued at once, as a time ratio."""
    def sample(k: int):
        return session.sample([[5, 17, 33, k + 40]], max_tokens=8, temperature=1.0, seed=k)

    def drawn(results: list[dict]) -> list[list[list[int]]]:
        return [[s["tokens"] for s in r["sequences"]] for r in results]

    started = time.perf_counter()
    alone = [sample(k).result(timeout=300) for k in range(SAMPLES)]
    one_by_one = time.perf_counter() - started
    started = time.perf_counter()
    together = [f.result(timeout=300) for f in [sample(k) for k in range(SAMPLES)]]
    at_once = time.perf_counter() - started
    if drawn(together) != drawn(alone):
        raise AssertionError("a merged sample drew other tokens than the same call alone")
    generations = sum(1 / r["merged_calls"] for r in together)  # a generation of k calls: k results of 1/k
    print(f"{SAMPLES} samples: one by one {one_by_one:.2f} s, queued at once {at_once:.2f} s in "
          f"{generations:.0f} generations (the same tokens)")
    return one_by_one / at_once


def session_figures(work: Path, calls: int, iterations: int) -> tuple[float, float, float, float]:
    state = work / "stack"
    stack = local_stack.up(state, base_models={MODELS[False]: f"s3://{BUCKET}/models/{MODELS[False]}"})
    try:
        (work / "assets").mkdir()
        make_demo_assets(work / "assets", stack.s3_endpoint, images=False)
        with Client(stack.url, stack.token) as client:
            session = Training(client).create({"model": MODELS[False], "lora": LORA, "seed": 0})
            try:
                session.wait_ready(timeout=600)
                overheads = []
                for _ in range(calls):
                    started = time.perf_counter()
                    out = session.forward_backward([{"tokens": list(range(3, 40))}]).result(timeout=300)
                    overheads.append((time.perf_counter() - started) * 1e3 - out["worker_ms"])
                    session.optim_step().result(timeout=300)
                print(f"forward_backward overhead: median {statistics.median(overheads):.1f} ms, "
                      f"max {max(overheads):.1f} ms over {calls} calls")
                means = grpo(session, iterations, seed=0)
                speedup = _merged_samples_speedup(session)
            finally:
                session.close()
        tinker_overhead = _tinker_overhead(stack.url, stack.token, calls)
    finally:
        local_stack.down(state)
    return statistics.median(overheads), tinker_overhead, statistics.fmean(means[-3:]) - means[0], speedup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moetune-bench-rl-") as work:
        ratio = dpo_step_ratio(Path(work), args.steps)
        overhead, tinker_overhead, gain, speedup = session_figures(Path(work), args.calls, args.iterations)
    print(f"RESULT dpo_step_ratio={ratio:.2f} session_call_overhead_ms={overhead:.1f} "
          f"tinker_call_overhead_ms={tinker_overhead:.1f} grpo_reward_gain={gain:.3f} "
          f"merged_samples_speedup={speedup:.2f}")


if __name__ == "__main__":
    main()
