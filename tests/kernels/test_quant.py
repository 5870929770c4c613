"""Quantized base weights against the public formats, decoded here independently (FP8 block scales, INT4
pack-quantized nibbles read as bytes, MXFP4 e2m1 decoded bit by bit), against transformers / compressed-tensors where
importable; and the tiled quantized linear against x @ dequant(W)^T, forward and dX, never building the dense W."""

from __future__ import annotations

import functools

import pytest
import torch

from moetune.kernels.quant import (
    Fp8BlockWeight,
    Int4PackedWeight,
    Mxfp4Weight,
    quantize_fp8_block,
    quantize_int4,
    quantize_mxfp4,
    quantized_linear,
)
from moetune.kernels.testing import rmse_ratio
from tests.support.allocations import Allocations

EXPERTS, OUT, IN = 3, 70, 96  # FP8 blocks of 16x40 leave partial edge blocks in both dims; 70 rows: a padded zp word


# ------------------------------------------------------------------ independent decoders of the public formats
def _fp8_reference(q: Fp8BlockWeight) -> torch.Tensor:
    (b0, b1), (rows, cols) = q.block, q.weight.shape[-2:]
    scale = q.weight_scale_inv.repeat_interleave(b0, -2)[..., :rows, :].repeat_interleave(b1, -1)[..., :cols]
    return q.weight.float() * scale


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., k] -> [..., 8k] stored nibbles: byte c // 2 of the row holds element c, low nibble if c is even."""
    b = words.contiguous().view(torch.uint8).long()
    out = torch.empty(*b.shape[:-1], 2 * b.shape[-1], dtype=torch.long)
    out[..., 0::2], out[..., 1::2] = b % 16, b // 16
    return out


def _int4_reference(q: Int4PackedWeight) -> torch.Tensor:
    values = _nibbles(q.weight_packed) - 8
    rows, groups = q.weight_scale.shape[-2:]
    if q.weight_zero_point is not None:
        zp = (_nibbles(q.weight_zero_point.transpose(-1, -2)) - 8).transpose(-1, -2)[..., :rows, :]
        values = values - zp.repeat_interleave(values.shape[-1] // groups, -1)
    scale = q.weight_scale.repeat_interleave(values.shape[-1] // groups, -1)
    # the exact product (a 4-bit code times a bf16 scale fits fp32); cast to bf16 it is compressed-tensors'
    # _dequantize, the product in bf16 rounded once
    return values.double() * scale.double()


def _mxfp4_reference(q: Mxfp4Weight) -> torch.Tensor:
    b = q.blocks.long()
    codes = torch.stack((b % 16, b // 16), -1).flatten(-2)  # [..., out, G, 32], even element first
    sign, exponent, mantissa = codes // 8, (codes // 2) % 4, codes % 2
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa))
    value = (1 - 2 * sign) * magnitude * 2.0 ** (q.scales.double()[..., None] - 127)
    return value.flatten(-2).float()


FORMATS = {
    "fp8": (functools.partial(quantize_fp8_block, block=(16, 40)), _fp8_reference, 0.05),
    "int4": (quantize_int4, _int4_reference, 0.15),
    "int4-asymmetric": (functools.partial(quantize_int4, symmetric=False), _int4_reference, 0.15),
    "mxfp4": (quantize_mxfp4, _mxfp4_reference, 0.2),
}


def _weight(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-3, 1, shape[-1], 2)


# ------------------------------------------------------------------ formats
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_the_public_formula_and_close_to_the_weight(fmt):
    quantize, reference, error = FORMATS[fmt]
    w = _weight(EXPERTS, OUT, IN)
    q = quantize(w)
    assert tuple(q.shape) == (EXPERTS, OUT, IN)
    assert q.nbytes == sum(t.numel() * t.element_size() for t in q.tensors().values()) < w.numel() * 2
    want = reference(q)
    assert torch.equal(q.dequantize(), want.float())
    assert torch.equal(q.dequantize(dtype=torch.bfloat16), want.to(torch.bfloat16))
    assert (q.dequantize() - w).norm() / w.norm() < error


def test_the_stored_tensors_have_the_checkpoint_names_dtypes_and_bits():
    fp8 = quantize_fp8_block(torch.tensor([[896.0, -1.0], [0.5, 0.0]]), block=(2, 2))  # amax 896: scale 2
    assert {n: t.dtype for n, t in fp8.tensors().items()} == {"weight": torch.float8_e4m3fn,
                                                              "weight_scale_inv": torch.float32}
    assert fp8.weight_scale_inv.tolist() == [[2.0]] and fp8.weight.float().tolist() == [[448, -0.5], [0.25, 0]]

    row = torch.cat([torch.tensor([-7.5]), torch.arange(-7.0, 8.0), torch.zeros(16)])  # amax 7.5: scale 1, q -8..7
    int4 = quantize_int4(row[None])
    assert {n: t.dtype for n, t in int4.tensors().items()} == {"weight_packed": torch.int32,
                                                               "weight_scale": torch.bfloat16}
    assert int4.weight_scale.tolist() == [[1.0]]
    assert [w & 0xFFFFFFFF for w in int4.weight_packed[0].tolist()] == [0x76543210, 0xFEDCBA98, 0x88888888,
                                                                        0x88888888]  # what pack_to_int32 writes
    zp = quantize_int4(_weight(9, 32), symmetric=False).weight_zero_point
    assert zp.dtype == torch.int32 and zp.shape == (2, 1)  # packed along the output dim, padded to 16 rows

    group = torch.zeros(32)
    group[:6] = torch.tensor([1.0, -0.5, 6.0, 0.25, 0.75, -5.0])  # 0.25, 0.75 and 5 are ties: even codes win
    mx = quantize_mxfp4(group[None])
    assert {n: t.dtype for n, t in mx.tensors().items()} == {"blocks": torch.uint8, "scales": torch.uint8}
    assert mx.scales.tolist() == [[127]] and mx.blocks[0, 0, :4].tolist() == [0x92, 0x07, 0xE2, 0x00]


def test_mxfp4_matches_transformers():
    from transformers.integrations import mxfp4

    q = quantize_mxfp4(_weight(EXPERTS, OUT, IN))
    for dtype in (torch.float32, torch.bfloat16):
        want = mxfp4.convert_moe_packed_tensors(q.blocks, q.scales, dtype=dtype)  # [E, in, out], its parameter
        assert torch.equal(q.dequantize(dtype=dtype), want.transpose(-1, -2))


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_matches_compressed_tensors(symmetric):
    # compressed-tensors is pinned in the test extra: its own compressor is the reference
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = QuantizationScheme(targets=["Linear"], weights={"num_bits": 4, "type": "int", "strategy": "group",
                                                             "group_size": 32, "symmetric": symmetric})
    w = _weight(OUT, IN).to(torch.bfloat16)
    groups = w.view(OUT, -1, 32)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(w.dtype),
                                                    "weight_zero_point": zp}, scheme)
    mine = quantize_int4(w, symmetric=symmetric)
    assert set(mine.tensors()) == set(packed) - {"weight_shape"}
    for name, t in mine.tensors().items():
        assert t.dtype == packed[name].dtype and torch.equal(t, packed[name]), name
    assert torch.equal(mine.dequantize(dtype=torch.bfloat16),
                       PackedQuantizationCompressor.decompress(packed, scheme)["weight"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_expert_is_a_view_of_its_slice(fmt):
    q = FORMATS[fmt][0](_weight(EXPERTS, OUT, IN))
    full = q.dequantize()
    for e in range(EXPERTS):
        one = q.expert(e)
        assert tuple(one.shape) == (OUT, IN) and torch.equal(one.dequantize(), full[e])
        for name, t in one.tensors().items():
            assert t.data_ptr() == q.tensors()[name][e].data_ptr()
    with pytest.raises(ValueError, match="3D"):
        q.expert(0).expert(0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_slices(fmt):
    q = FORMATS[fmt][0](_weight(EXPERTS, OUT, IN))
    full = q.dequantize()
    ranges = [(16, 48), (32, OUT), (64, OUT)] if fmt == "fp8" else [(3, 17), (0, 1), (61, OUT), (9, 9)]
    for start, stop in ranges:
        assert torch.equal(q.dequantize(slice(start, stop)), full[..., start:stop, :]), (start, stop)
        assert torch.equal(q.expert(1).dequantize(slice(start, stop)), full[1, start:stop])
    with pytest.raises(ValueError, match="contiguous"):
        q.dequantize(slice(0, 32, 2))


def test_misaligned_fp8_rows_and_tiles_are_refused():
    q = quantize_fp8_block(_weight(OUT, IN), block=(16, 40))
    for rows in (slice(8, 32), slice(16, 40)):
        with pytest.raises(ValueError, match="aligned to 16 rows"):
            q.dequantize(rows)
    with pytest.raises(ValueError, match="tile_rows=24 is not a multiple"):
        quantized_linear(torch.randn(2, IN), q, tile_rows=24)
    with pytest.raises(ValueError, match="does not match"):
        Fp8BlockWeight(q.weight, q.weight_scale_inv, block=(32, 40))


@pytest.mark.parametrize("fmt", FORMATS)
def test_module_buffers_carry_the_weight(fmt):
    q = FORMATS[fmt][0](_weight(EXPERTS, OUT, IN))
    module = torch.nn.Module()
    for name, t in q.tensors().items():
        module.register_buffer(name, t)
    assert set(module.state_dict()) == set(q.tensors())
    rebuilt = q.with_tensors(**dict(module.named_buffers()))
    assert type(rebuilt) is type(q) and torch.equal(rebuilt.dequantize(), q.dequantize())
    moved = q.to("meta")
    assert moved.shape == q.shape and all(t.is_meta for t in moved.tensors().values())
    assert {n: t.dtype for n, t in moved.tensors().items()} == {n: t.dtype for n, t in q.tensors().items()}


# ------------------------------------------------------------------ the tiled linear
@pytest.mark.parametrize("tile_rows", [32, None])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_linear_is_x_times_the_dequantized_weight(fmt, tile_rows):
    q = FORMATS[fmt][0](_weight(EXPERTS, OUT, IN)).expert(1)  # tiles of 32: 32 + 32 + 6 rows
    w = q.dequantize()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, IN, generator=gen, requires_grad=True)
    grad = torch.randn(2, 5, OUT, generator=gen)
    got = quantized_linear(x, q, tile_rows)
    (got_dx,) = torch.autograd.grad(got, x, grad)
    want = x @ w.T
    (want_dx,) = torch.autograd.grad(want, x, grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_linear_in_bf16(fmt):
    q = FORMATS[fmt][0](_weight(OUT, IN))
    w = q.dequantize(dtype=torch.bfloat16).float()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, IN, generator=gen).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(7, OUT, generator=gen).to(torch.bfloat16)
    got = quantized_linear(x, q, tile_rows=16)
    (got_dx,) = torch.autograd.grad(got, x, grad)
    assert got.dtype == got_dx.dtype == torch.bfloat16
    assert rmse_ratio(got, x.float() @ w.T) < 0.01
    assert rmse_ratio(got_dx, grad.float() @ w) < 0.01


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_linear_backward_in_bf16_rounds_once(fmt):
    """dX in bf16 is the fp32 product dY·W (W rounded to bf16, as the forward uses it) rounded once, whatever the
    tiles: their partials are summed in fp32 from exact products, never rounded to bf16 tile by tile."""
    q = FORMATS[fmt][0](_weight(OUT, IN))
    w = q.dequantize(dtype=torch.bfloat16).float()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, IN, generator=gen).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(7, OUT, generator=gen).to(torch.bfloat16)
    (got,) = torch.autograd.grad(quantized_linear(x, q, tile_rows=16), x, grad)  # 16 + 16 + 16 + 16 + 6 rows
    assert torch.equal(got, (grad.float() @ w).to(torch.bfloat16))


def test_default_tiles_are_sized_from_memory():
    from moetune.kernels.quant.linear import TILE_BYTES, _tile_rows

    q = quantize_fp8_block(torch.zeros(4096, 7168))
    assert _tile_rows(q, tokens=8192) == 1024  # fp32 rows of 7168 and dY columns of 8192 in TILE_BYTES
    assert 1024 * 4 * (7168 + 8192) <= TILE_BYTES < 1152 * 4 * (7168 + 8192)
    assert _tile_rows(q, tokens=1) == 2304 and _tile_rows(q, tokens=10**7) == 128  # one FP8 block at least


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_linear_holds_one_tile_of_dense_weight_at_most(fmt):
    out, cols, tile = 256, 128, 64
    w = _weight(out, cols)
    q = quantize_fp8_block(w, block=(32, 32)) if fmt == "fp8" else FORMATS[fmt][0](w)  # blocks that tile exactly
    x = torch.randn(4, cols, requires_grad=True)
    saved = []
    with Allocations() as seen, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        quantized_linear(x, q, tile_rows=tile).backward(torch.ones(4, out))
    assert seen.matmuls == 2 * out // tile  # forward and backward both ran under the recorder, tile by tile
    assert seen.largest <= tile * cols < out * cols, seen.largest
    assert saved == []  # nothing kept for the backward: the tiles are dequantized again
    with Allocations() as dense:
        q.dequantize()
    assert dense.largest == out * cols  # the recorder does see a whole dense weight
