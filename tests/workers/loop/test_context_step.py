"""A supervised job's step at context_parallel_size 2 on gloo ranks (bench.support.context_step): Kimi K3's tiny
model of the released shape, SFT's packed micro-batches, two of them accumulated, cut into two slices each and run
through the CP forward: alone, with expert parallelism, and under ZeRO-3 on four ranks as two data-parallel CP
groups whose two ranks also share the experts (EP=2 x CP=2); Kimi-Linear's and GLM-5-Next's tiny models with
expert parallelism (GLM-5-Next's rows are padded, not packed: its DSA layers keep no packed sequences apart).
The summed loss, the token counts and every LoRA
gradient the optimizer applies equal one process's step over the same examples without CP; so does the validation
loss after the step, each rank scoring its slice of the rows."""

import pytest
import torch

from bench.support.context_step import run_context_step
from bench.support.harness import launch, spec

# case -> its family and run config, by the number of ranks it runs on
CASES = {2: {"cp2": ("kimi_k3", spec(ep=1, zero=2, world=2, cp=2, global_batch=4)),
             "cp2-ep2": ("kimi_k3", spec(ep=2, zero=2, world=2, cp=2, global_batch=4)),
             "kimi_linear-cp2-ep2": ("kimi_linear", spec(ep=2, zero=2, world=2, cp=2, global_batch=4)),
             "glm5_next-cp2-ep2": ("glm5_next", spec(ep=2, zero=2, world=2, cp=2, global_batch=4))},
         4: {"cp2-ep2-dp2-zero3": ("kimi_k3", spec(ep=2, zero=3, world=4, cp=2, global_batch=4))}}
UNSPLIT = spec(ep=1, zero=2, world=1, global_batch=4)


def _runs(rank, world, cases, out_dir):
    for name, family_name, job_json in cases:
        run_context_step(rank, world, family_name, job_json, f"{out_dir}/{name}")


@pytest.mark.timeout(600)
def test_a_context_parallel_step_equals_the_unsplit_step(tmp_path):
    for world, cases in CASES.items():
        launch(_runs, world, [(name, family, job.model_dump_json()) for name, (family, job) in cases.items()],
               str(tmp_path))
    families = {family for cases in CASES.values() for family, _ in cases.values()}
    launch(_runs, 1, [(family, family, UNSPLIT.model_dump_json()) for family in sorted(families)], str(tmp_path))
    for world, cases in CASES.items():
        for name, (family, _) in cases.items():
            want = torch.load(tmp_path / family / "rank0.pt")
            learning = [g for n, g in want["grads"].items() if "lora_B" in n and ".indexer." not in n]
            assert learning and all(g.abs().max() > 0 for g in learning)  # a DSA indexer runs without gradient
            for rank in (torch.load(tmp_path / name / f"rank{r}.pt") for r in range(world)):
                assert (rank["loss_tokens"], rank["tokens"]) == (want["loss_tokens"], want["tokens"]), name
                assert rank["loss_sum"] == pytest.approx(want["loss_sum"], rel=1e-5), name
                assert rank["valid_loss"] == pytest.approx(want["valid_loss"], rel=1e-5), name
                assert rank["grads"].keys() == want["grads"].keys()
                for key, expected in want["grads"].items():
                    assert (rank["grads"][key] - expected).abs().max() <= 5e-5 * expected.abs().max(), (name, key)
