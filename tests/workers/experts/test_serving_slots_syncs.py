"""The routed experts' serving slots read nothing back to the host in a decode step (on CUDA each read is a host sync
per MoE layer per token): no bincount, tolist, item or float of a tensor, on the one-adapter path and the mixed one;
and the one-adapter path computes what the mixed path computes for the same rows."""

import torch

from moetune.workers.experts.module import ExpertParallelExperts
from moetune.workers.experts.placement import placement_at
from moetune.workers.experts.serving_slots import RowLoraExperts
from moetune.workers.families import REGISTRY
from moetune.workers.lora.row_slots import RowSelection


def _experts_with_adapter():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = REGISTRY["qwen3_moe"].tiny_config()
    torch.manual_seed(0)
    stock = Qwen3MoeExperts(config)
    for param in stock.parameters():
        torch.nn.init.normal_(param, std=0.2)
    selection = RowSelection()
    experts = RowLoraExperts(ExpertParallelExperts(stock, placement_at(config.to_dict(), 1, 0)), selection, 3,
                             torch.float32, "cpu")
    e, inter, hidden, rank = config.num_experts, config.moe_intermediate_size, config.hidden_size, 4
    shapes = {"gate_up_a": (e, rank, hidden), "gate_up_b": (e, 2 * inter, rank), "down_a": (e, rank, inter),
              "down_b": (e, hidden, rank)}
    experts.factors.put(1, {n: torch.randn(s) * 0.3 for n, s in shapes.items()}, 0.3)  # 0.3: rounded in fp32
    return experts, selection, config


def _counting_reads(monkeypatch) -> list[str]:
    reads = []
    for name in ("tolist", "item", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _f=original, _n=name: reads.append(_n) or _f(t, *a))
    original_bincount = torch.bincount
    monkeypatch.setattr(torch, "bincount", lambda *a, **k: reads.append("bincount") or original_bincount(*a, **k))
    return reads


def test_decode_step_reads_nothing_back_and_the_paths_agree(monkeypatch):
    experts, selection, config = _experts_with_adapter()
    rows, tokens, top_k = 2, 5, config.num_experts_per_tok
    x = torch.randn(rows * tokens, config.hidden_size)
    index = torch.stack([torch.randperm(config.num_experts)[:top_k] for _ in range(rows * tokens)])
    weights = torch.rand(rows * tokens, top_k).softmax(-1)
    per_row = []
    for slot, part in zip((1, 0), (slice(0, tokens), slice(tokens, None))):  # the adapter's row, the base's row
        selection.set([slot], "cpu")
        reads = _counting_reads(monkeypatch)
        per_row.append(experts(x[part], index[part], weights[part]))
        monkeypatch.undo()
        assert reads == [], (slot, reads)
    selection.set([1, 0], "cpu")  # both rows in one forward: the mixed path
    reads = _counting_reads(monkeypatch)
    mixed = experts(x, index, weights)
    monkeypatch.undo()
    assert reads == []
    torch.testing.assert_close(torch.cat(per_row), mixed, rtol=1e-5, atol=1e-6)
    selection.set([0], "cpu")
    assert not torch.allclose(per_row[0], experts(x[:tokens], index[:tokens], weights[:tokens]))  # it adapts
