"""Packed micro-batches read no boundary back from the device per layer: every KDA layer of a tiny kimi_linear,
and its recompute under gradient checkpointing, hands the CUDA kernel (fla) the very int64 offsets tensor the
micro-batch took to the device and one host copy of it (fla's caches are keyed by identity: an int32 -> int64
conversion per layer missed them, and fla read the device to rebuild its chunk indices), and packed attention takes
the sequence boundaries from that host copy."""

import torch

import moetune.kernels.kda as kda
from moetune.kernels.kda import packed_offsets
from moetune.workers.families import REGISTRY, apply_kernel_swaps
from moetune.workers.families.segments import _segments_attention
from moetune.workers.methods.batch import IGNORE, PACKED_OFFSETS
from moetune.workers.methods.sft import Example, SupervisedMethod
from moetune.workers.recompute import enable_activation_checkpointing
from bench.support.tiny_models import plain_model


def _examples() -> list[Example]:
    g = torch.Generator().manual_seed(0)
    return [Example(ids, [IGNORE] + ids[1:]) for n in (9, 16, 5)
            for ids in [torch.randint(0, 256, (n,), generator=g).tolist()]]


def test_every_kda_layer_and_its_recompute_hand_fla_the_micro_batch_offsets(monkeypatch):
    model = plain_model(REGISTRY["kimi_linear"])
    layers = apply_kernel_swaps(model)["apply_kda_kernels"]
    assert layers >= 2
    assert enable_activation_checkpointing(model) >= layers
    model.train()
    method = SupervisedMethod(tokenizer=None, seq_len=64)
    method.prepare(model)
    batch = method.collate(_examples()).to("cpu")
    handed, stock = [], kda.kda_kernel

    def recording(device):
        impl = stock(device)

        def run(*args, cu_seqlens=None, **kwargs):
            handed.append(kda._fla_offsets(cu_seqlens))  # what the fla path would pass
            return impl(*args, cu_seqlens=cu_seqlens, **kwargs)

        return run

    monkeypatch.setattr(kda, "kda_kernel", recording)
    method.loss_sum(model, batch).backward()
    assert len(handed) == 2 * layers  # forward and recompute
    offsets = batch.inputs[PACKED_OFFSETS]
    assert all(h["cu_seqlens"] is offsets for h in handed)
    assert offsets.dtype == torch.int64 and offsets.tolist() == [0, 9, 25, 30]
    assert all(h["cu_seqlens_cpu"] is handed[0]["cu_seqlens_cpu"] for h in handed)


def test_packed_attention_takes_the_boundaries_from_the_host_copy():
    """Offsets on the meta device (no values there to read) with their host copy: the same output as with the
    offsets on the host."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 30, 8) for _ in range(3))
    module = torch.nn.Module()
    host = torch.tensor([0, 9, 25, 30])
    want, _ = _segments_attention(module, q, k, v, None, cu_seq_lens_q=host)
    got, _ = _segments_attention(module, q, k, v, None, cu_seq_lens_q=packed_offsets(host, "meta"))
    assert torch.equal(got, want)
