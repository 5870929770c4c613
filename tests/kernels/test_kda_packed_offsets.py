"""A micro-batch's packed-sequence offsets as fla takes them (kernels.kda.packed_offsets): int64 on the device once,
with the host copy attached, so that fla's identity-keyed caches hit in every layer and its chunk bookkeeping reads
the host copy (`cu_seqlens_cpu`) instead of the device. The meta device stands in for a device that is not the
host: a meta tensor has no values to read back."""

import torch

from moetune.kernels.kda import _fla_offsets, offsets_on_host, packed_offsets


def test_device_offsets_carry_their_host_copy_and_reach_fla_unconverted():
    host = torch.tensor([0, 9, 25, 30], dtype=torch.int32)
    on_device = packed_offsets(host, "meta")
    assert on_device.device.type == "meta" and on_device.dtype == torch.int64
    first, again = _fla_offsets(on_device), _fla_offsets(on_device)  # two layers
    assert first["cu_seqlens"] is on_device and again["cu_seqlens"] is on_device
    assert first["cu_seqlens_cpu"] is again["cu_seqlens_cpu"] is offsets_on_host(on_device)
    assert first["cu_seqlens_cpu"].dtype == torch.int64 and first["cu_seqlens_cpu"].tolist() == [0, 9, 25, 30]
    assert _fla_offsets(None) == {"cu_seqlens": None, "cu_seqlens_cpu": None}


def test_host_offsets_are_their_own_host_copy():
    host = torch.tensor([0, 4, 8])
    assert packed_offsets(host, "cpu") is host  # already int64 on the host: nothing made
    assert offsets_on_host(host) is host
    assert offsets_on_host(torch.zeros(3, dtype=torch.long, device="meta"), read_back=False) is None
