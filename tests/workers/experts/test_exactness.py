"""EP engine vs the plain single-process transformers + PEFT reference on the same batches (fp32, gloo).

All two-rank engine runs share one start of two processes (conftest.ep_runs); each test checks one case
against the reference computed here. Tolerances: first loss 1e-5 and later losses 1e-4 absolute, gradients 1e-4
relative.
"""

import pytest
import torch

from moetune.workers.families import REGISTRY
from tests.workers.experts.cases import RELEASED_CASES, SAVED_CASES, TRAIN_CASES
from bench.support.harness import launch, reference, run_cases, spec, wide_config


def test_ep2_of_4_ranks_replicates_experts(tmp_path):
    """EP=2 on 4 ranks: ranks 0,2 and 1,3 hold the same experts; their expert-LoRA gradients are reduced only
    within that replica pair and every rank still matches the reference. Under ZeRO-3 the pair also
    partitions its experts' frozen weights between them (1/4 of the bytes each)."""
    jobs = {zero: spec(ep=2, zero=zero, steps=3, train_experts=True, world=4, micro=1) for zero in (2, 3)}
    launch(run_cases, 4, [(f"zero{z}", "train", "qwen3_moe", job.model_dump_json(), False) for z, job in jobs.items()],
           str(tmp_path))
    for zero, job in jobs.items():
        ranks = [torch.load(tmp_path / f"zero{zero}" / f"rank{r}.pt") for r in range(4)]
        ref = reference("qwen3_moe", job, world=4, micro=1)
        _assert_matches(ranks, ref, ep=2)
        share = 2 if zero == 2 else 4
        assert [r["expert_bytes"] for r in ranks] == [ref["expert_bytes"] // share] * 4


def _assert_matches(ranks, ref, ep):
    """Same rank-mean loss at every step; every LoRA gradient equal to the reference's (expert LoRA: this
    rank's slice of the experts)."""
    mean_losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(ref["losses"]))]
    assert mean_losses[0] == pytest.approx(ref["losses"][0], abs=1e-5)
    assert mean_losses == pytest.approx(ref["losses"], abs=1e-4)
    assert ranks[0]["grads"].keys() == ref["grads"].keys()
    for name, expected in ref["grads"].items():
        # B starts at 0, so A gets no gradient on step 1; every B must
        assert expected.abs().max() > 0 or "_a" in name or "lora_A" in name or ".indexer." in name, name
        for rank, r in enumerate(ranks):
            if ".experts." in name:
                n_local = expected.shape[0] // ep
                expected_here = expected[(rank % ep) * n_local:(rank % ep + 1) * n_local]
            else:
                expected_here = expected
            torch.testing.assert_close(r["grads"][name], expected_here, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_engine_matches_plain_transformers_peft(ep_runs, case):
    family, job, skew = TRAIN_CASES[case]
    (_, ranks), ep = ep_runs(case), job.parallelism.expert_parallel_size
    ref = reference(family, job, world=2, skew=skew)
    _assert_matches(ranks, ref, ep)
    if job.lora.train_experts:
        assert any(".experts.lora_gate_up_b" in n for n in ref["grads"])
    if ep == 2:  # each rank stores exactly half of the routed experts' bytes
        assert [r["expert_bytes"] for r in ranks] == [ref["expert_bytes"] // 2] * 2
        text = REGISTRY[family].tiny_config().get_text_config()
        width = getattr(text, "moe_latent_size", None) or getattr(text, "routed_expert_hidden_size", None) or \
            text.hidden_size
        # tokens cross the all-to-all in fp32 at the experts' width: the latent size of nemotron_h and kimi_k3
        # (half their hidden; a full-width exchange fails here), not the hidden width their routers read
        assert all(r["a2a_row_bytes"] == {4 * width} for r in ranks), (ranks[0]["a2a_row_bytes"], width)
        for r in ranks:  # the expert-load metrics count each token assignment once, also when a layer is rerun
            assert r["load_first_step"] == float(r["routed"].sum()) > 0
    elif not job.lora.train_experts:  # EP=1 without expert LoRA keeps the plain experts module
        assert [r["expert_bytes"] for r in ranks] == [0, 0]
    else:
        assert [r["expert_bytes"] for r in ranks] == [ref["expert_bytes"]] * 2
    if skew:  # rank 1's experts got no token, and nothing hung
        for r in ranks:
            assert r["routed"][:4].sum() > 0 and r["routed"][4:].sum() == 0


@pytest.mark.parametrize("case", list(SAVED_CASES))
def test_zero3_frees_gathered_experts_after_their_forward(ep_runs, case):
    """ZeRO-3 frees a layer's gathered frozen experts once its forward is done and gathers them again for its
    backward: what autograd saved holds none of their storage by the end of the forward (it keeps the expert
    Parameters themselves, empty by then, not views of the gathered weights), and the backward's loss and
    gradients still equal the reference."""
    family, job = SAVED_CASES[case]
    _, ranks = ep_runs(case)
    for r in ranks:
        assert r["released"] and r["saved_expert_tensors"] > 0
        assert r["saved_expert_bytes_after_forward"] == 0
    _assert_matches(ranks, reference(family, job, world=2, config=wide_config(family)), ep=2)


@pytest.mark.parametrize("case", list(RELEASED_CASES))
def test_released_quantized_base_matches_its_dequantized_reference(ep_runs, case):
    """The checkpoint in its released format, each rank's half of the routed experts streamed and kept packed
    (MXFP4: 4-bit codes and one e8m0 scale per 32 weights, 17/128 of fp32's bytes), trains as the one-process
    reference on the same checkpoint dequantized: same losses at every step, same first-step gradients."""
    out, ranks = ep_runs(case)
    job = RELEASED_CASES[case][1]
    ref = reference(str(out / "base"), job, world=2)
    _assert_matches(ranks, ref, ep=2)
    assert [r["expert_bytes"] for r in ranks] == [ref["expert_bytes"] * 17 // 128 // 2] * 2
    assert any(".experts.lora_" in n for n in ref["grads"]) == job.lora.train_experts
