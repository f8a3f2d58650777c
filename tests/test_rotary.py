"""Rotary embeddings (flash_attn.layers.rotary, flash_attn.ops.triton.rotary; docs/api.md §9.2).

Tolerance: the rotation is two fp32 products and a sum per element, rounded once to the output dtype. A
result y passes against the float64 reference y64 when
    |y - y64| <= ulp_dtype(y64) + 2**-22 * (|a cos| + |b sin|),
that is one unit in the last place of the output dtype (rounding takes half of it; an fp32 FMA or a
differently ordered fp32 sum can move the rounded value by one more step), plus 4 fp32 rounding units of
the products, which only matter for fp32 outputs or when the two products nearly cancel. The PyTorch
reference apply_rotary_emb_torch, run in fp32 and rounded to the dtype, is held to the same bound.
"""

import re

import pytest
import torch

from flashtriton.layers.rotary import (RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_func,
                                       apply_rotary_emb_kv_, apply_rotary_emb_qkv_, apply_rotary_emb_torch,
                                       rotate_half)
from flashtriton.ops.triton import rotary as rotary_ops
from flashtriton.ops.triton.rotary import apply_rotary
from flashtriton.testing import poisoned_outputs, strided_like

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def tables(seqlen_ro, rotary_dim, dtype=torch.float32, device=DEVICE):
    """cos, sin (seqlen_ro, rotary_dim / 2) of random angles, rounded to dtype."""
    angles = torch.rand(seqlen_ro, rotary_dim // 2, device=device) * 2 * torch.pi
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_reference64(x, cos, sin, seqlen_offsets=0, cu_seqlens=None, interleaved=False, conjugate=False):
    """(y, bound): the rotation in float64, one sequence at a time, and |a cos| + |b sin| of each rotated feature."""
    x64, cos64, sin64 = (t.detach().double().cpu() for t in (x, cos, sin))
    half = cos.shape[-1]
    first = torch.arange(0, 2 * half, 2) if interleaved else torch.arange(half)
    second = first + 1 if interleaved else first + half
    if cu_seqlens is None:
        spans = [(b, slice(None), x.shape[1]) for b in range(x.shape[0])]
    else:
        cu = cu_seqlens.tolist()
        spans = [(b, slice(cu[b], cu[b + 1]), cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]
    offsets = seqlen_offsets.tolist() if isinstance(seqlen_offsets, torch.Tensor) else [seqlen_offsets] * len(spans)
    y, bound = x64.clone(), torch.zeros_like(x64)
    for b, rows, length in spans:
        seq, y_seq, bound_seq = (t[b] if cu_seqlens is None else t[rows] for t in (x64, y, bound))
        positions = torch.arange(length) + offsets[b]
        valid = (positions >= 0) & (positions < cos.shape[0])
        c = torch.ones(length, half, dtype=torch.float64)
        s = torch.zeros(length, half, dtype=torch.float64)
        c[valid], s[valid] = cos64[positions[valid]], sin64[positions[valid]]
        c, s = c[:, None, :], (-s if conjugate else s)[:, None, :]
        a, bb = seq[..., first], seq[..., second]
        y_seq[..., first], y_seq[..., second] = a * c - bb * s, a * s + bb * c
        bound_seq[..., first] = (a * c).abs() + (bb * s).abs()
        bound_seq[..., second] = (a * s).abs() + (bb * c).abs()
    return y, bound


def ulp(values, dtype):
    """Unit in the last place of `dtype` at |values| (subnormal spacing below the normal range)."""
    info = torch.finfo(dtype)
    mantissa_bits = -int(torch.log2(torch.tensor(info.eps)).item())
    min_exponent = int(torch.log2(torch.tensor(info.tiny)).item())
    _, exponent = torch.frexp(values.abs())
    exponent = torch.where(values == 0, min_exponent, (exponent - 1).clamp(min=min_exponent))
    return torch.pow(2.0, (exponent - mantissa_bits).double())


def assert_rotary_close(actual, expected, bound, dtype=None):
    """|actual - expected| <= 1 ulp of the output dtype + 2**-22 * bound, elementwise (see the module docstring)."""
    actual64, expected64 = actual.detach().double().cpu(), expected.detach().double().cpu()
    tolerance = ulp(torch.maximum(actual64.abs(), expected64.abs()), dtype or actual.dtype) + 2.0 ** -22 * bound
    error = (actual64 - expected64).abs()
    assert torch.isfinite(actual64).all(), "non-finite values in the result"
    worst = (error - tolerance).argmax()
    assert bool((error <= tolerance).all()), (
        f"error {error.flatten()[worst]:.3e} > tolerance {tolerance.flatten()[worst]:.3e} at flat index {int(worst)}")


def random_x(shape, dtype, layout="contiguous"):
    x = torch.randn(shape, device=DEVICE).to(dtype)
    return strided_like(x, layout) if len(shape) == 4 else x


# ---- dense layout against both references ---------------------------------------------------------------------

@pytest.mark.parametrize("rotary_dim", [64, 32, 16], ids=lambda r: f"r{r}")
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_matches_references(dtype, interleaved, rotary_dim):
    x = random_x((2, 33, 3, 64), dtype)
    cos, sin = tables(40, rotary_dim, dtype)
    with poisoned_outputs():
        out = apply_rotary_emb(x, cos, sin, interleaved=interleaved)
    assert out.dtype == dtype and out.shape == x.shape
    expected, bound = rotary_reference64(x, cos, sin, interleaved=interleaved)
    assert_rotary_close(out, expected, bound)
    torch_ref = apply_rotary_emb_torch(x.float(), cos.float(), sin.float(), interleaved).to(dtype)
    assert_rotary_close(out, torch_ref, bound)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


def test_fp32_tables_with_half_input():
    x = random_x((2, 17, 2, 32), torch.float16)
    cos, sin = tables(17, 32, torch.float32)
    out = apply_rotary(x, cos, sin)
    expected, bound = rotary_reference64(x, cos, sin)
    assert_rotary_close(out, expected, bound)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_int_offset(interleaved):
    x = random_x((2, 20, 3, 32), torch.float16)
    cos, sin = tables(27, 24, torch.float16)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=7)
    assert_rotary_close(out, *rotary_reference64(x, cos, sin, 7, interleaved=interleaved))
    torch_ref = apply_rotary_emb_torch(x.float(), cos[7:].float(), sin[7:].float(), interleaved).half()
    assert torch.equal(out[..., 24:], x[..., 24:])
    assert_rotary_close(out, torch_ref, rotary_reference64(x, cos, sin, 7, interleaved=interleaved)[1])


@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_tensor_offsets_past_the_table_are_identity(interleaved, offset_dtype):
    x = random_x((3, 16, 2, 32), torch.bfloat16)
    cos, sin = tables(24, 32, torch.bfloat16)
    offsets = torch.tensor([0, 13, 40], dtype=offset_dtype, device=DEVICE)
    with poisoned_outputs():
        out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    assert_rotary_close(out, *rotary_reference64(x, cos, sin, offsets, interleaved=interleaved))
    assert torch.equal(out[1, 11:], x[1, 11:]), "positions 24.. are past the table: no rotation"
    assert torch.equal(out[2], x[2])
    assert not torch.equal(out[1, :11], x[1, :11])


@pytest.mark.parametrize("conjugate", [False, True], ids=["rotate", "conjugate"])
@pytest.mark.parametrize("offsets", ["int", "tensor"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_varlen(interleaved, offsets, conjugate):
    lengths, tail = [5, 0, 17, 9], 3
    cu_seqlens = torch.tensor([0, 5, 5, 22, 31], dtype=torch.int32, device=DEVICE)
    x = random_x((sum(lengths) + tail, 3, 48), torch.float16)
    cos, sin = tables(30, 32, torch.float16)
    seqlen_offsets = 4 if offsets == "int" else torch.tensor([0, 3, 20, 1], device=DEVICE)
    with poisoned_outputs():
        out = apply_rotary(x, cos, sin, seqlen_offsets, cu_seqlens, max(lengths), interleaved, conjugate=conjugate)
    expected, bound = rotary_reference64(x, cos, sin, seqlen_offsets, cu_seqlens, interleaved, conjugate)
    assert_rotary_close(out, expected, bound)
    assert torch.equal(out[31:], x[31:]), "rows past cu_seqlens[-1] are copied unchanged"


def test_varlen_matches_dense_per_sequence():
    cu_seqlens = torch.tensor([0, 9, 21], dtype=torch.int64, device=DEVICE)
    x = random_x((21, 2, 32), torch.float16)
    cos, sin = tables(12, 32, torch.float16)
    out = apply_rotary_emb(x, cos, sin, cu_seqlens=cu_seqlens, max_seqlen=12)
    for start, end in ((0, 9), (9, 21)):
        assert torch.equal(out[start:end], apply_rotary_emb(x[None, start:end], cos, sin)[0])


def test_varlen_sequence_longer_than_max_seqlen_is_still_rotated():
    cu_seqlens = torch.tensor([0, 40], dtype=torch.int32, device=DEVICE)
    x = random_x((40, 2, 32), torch.float32)
    cos, sin = tables(40, 32)
    out = apply_rotary(x, cos, sin, cu_seqlens=cu_seqlens, max_seqlen=8)
    assert_rotary_close(out, *rotary_reference64(x, cos, sin, 0, cu_seqlens))


# ---- in place, conjugate, layouts -----------------------------------------------------------------------------

@pytest.mark.parametrize("rotary_dim", [32, 16], ids=lambda r: f"r{r}")
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_inplace(interleaved, rotary_dim):
    x = random_x((2, 12, 3, 32), torch.float16)
    cos, sin = tables(12, rotary_dim, torch.float16)
    expected = apply_rotary(x, cos, sin, interleaved=interleaved)
    target = x.clone()
    result = apply_rotary_emb(target, cos, sin, interleaved=interleaved, inplace=True)
    assert result is target
    assert torch.equal(target, expected)


def test_inplace_on_views_and_non_unit_last_stride():
    cos, sin = tables(10, 16, torch.float16)
    base = random_x((2, 13, 4, 24), torch.float16)
    before = base.clone()
    x = base[:, 2:12, 1:, 3:19]
    expected = apply_rotary(x.contiguous(), cos, sin)
    apply_rotary(x, cos, sin, inplace=True)
    assert torch.equal(x, expected)
    outside = torch.ones_like(base, dtype=torch.bool)
    outside[:, 2:12, 1:, 3:19] = False
    assert torch.equal(base[outside], before[outside]), "only the view's elements change"
    y = random_x((2, 10, 16, 3), torch.float16).transpose(-1, -2)  # last-dim stride 3
    expected = apply_rotary(y.contiguous(), cos, sin)
    apply_rotary(y, cos, sin, inplace=True)
    assert torch.equal(y, expected)


def test_conjugate_undoes_the_rotation():
    x = random_x((2, 16, 2, 32), torch.float32)
    cos, sin = tables(16, 32)
    back = apply_rotary(apply_rotary(x, cos, sin), cos, sin, conjugate=True)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", ["bhsd", "sliced"])
def test_strided_inputs(layout):
    x = random_x((2, 19, 3, 48), torch.bfloat16, layout)
    assert not x.is_contiguous() and x.stride(-1) == 1
    wide_cos, wide_sin = tables(25, 64, torch.bfloat16)
    cos, sin = wide_cos[:, 3:19], wide_sin[:, 3:19]
    assert not cos.is_contiguous()
    out = apply_rotary(x, cos, sin, seqlen_offsets=2, interleaved=True)
    assert torch.equal(out, apply_rotary(x.contiguous(), cos.contiguous(), sin.contiguous(), 2, interleaved=True))
    assert_rotary_close(out, *rotary_reference64(x, cos, sin, 2, interleaved=True))


def test_empty_inputs():
    cos, sin = tables(8, 16)
    for shape in ((0, 8, 2, 16), (2, 0, 2, 16)):
        x = torch.randn(shape, device=DEVICE)
        assert apply_rotary(x, cos, sin).shape == shape
    x = torch.randn(3, 2, 16, device=DEVICE)
    out = apply_rotary(x, cos, sin, cu_seqlens=torch.zeros(1, dtype=torch.int32, device=DEVICE), max_seqlen=0)
    assert torch.equal(out, x)


# ---- autograd --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_gradient_matches_torch_autograd(interleaved, inplace):
    leaf = torch.randn(2, 14, 3, 32, device=DEVICE, requires_grad=True)
    cos, sin = tables(20, 24)
    dout = torch.randn(2, 14, 3, 32, device=DEVICE)
    x = leaf * 1.0 if inplace else leaf
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, inplace=inplace, seqlen_offsets=3)
    (grad,) = torch.autograd.grad(out, leaf, dout)
    x64 = leaf.detach().double().requires_grad_()
    ref = apply_rotary_emb_torch(x64, cos[3:17].double(), sin[3:17].double(), interleaved)
    (grad64,) = torch.autograd.grad(ref, x64, dout.double())
    _, bound = rotary_reference64(dout, cos, sin, 3, interleaved=interleaved, conjugate=True)
    assert_rotary_close(grad, grad64, bound)


def test_gradient_varlen_tensor_offsets():
    cu_seqlens = torch.tensor([0, 6, 16], dtype=torch.int32, device=DEVICE)
    offsets = torch.tensor([2, 9], device=DEVICE)
    x = torch.randn(18, 2, 32, device=DEVICE, requires_grad=True)
    cos, sin = tables(12, 32)
    out = apply_rotary_emb_func(x, cos, sin, True, False, offsets, cu_seqlens, 10)
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, x, dout)
    assert_rotary_close(grad, *rotary_reference64(dout, cos, sin, offsets, cu_seqlens, True, conjugate=True))


def _reference_qkv(qkv, cos, sin, cos_k, sin_k, interleaved, num_heads_q=None):
    """The expected result of apply_rotary_emb_qkv_ through apply_rotary_emb_torch in float64."""
    parts = qkv.double().clone()
    if num_heads_q is None:
        q, k = parts[:, :, 0], parts[:, :, 1]
    else:
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        q, k = parts[:, :, :num_heads_q], parts[:, :, num_heads_q:num_heads_q + num_heads_k]
    seqlen = qkv.shape[1]
    q.copy_(apply_rotary_emb_torch(q, cos[:seqlen].double(), sin[:seqlen].double(), interleaved))
    k.copy_(apply_rotary_emb_torch(k, cos_k[:seqlen].double(), sin_k[:seqlen].double(), interleaved))
    return parts


@pytest.mark.parametrize("separate_k", [False, True], ids=["shared", "xpos-k"])
@pytest.mark.parametrize("layout", ["packed5d", "gqa4d"])
def test_qkv_inplace_and_gradient(layout, separate_k):
    num_heads_q = 4 if layout == "gqa4d" else None
    shape = (2, 10, 3, 2, 32) if layout == "packed5d" else (2, 10, 4 + 2 * 2, 32)
    leaf = torch.randn(shape, device=DEVICE, requires_grad=True)
    cos, sin = tables(10, 32)
    cos_k, sin_k = (cos * 0.5, sin * 0.5) if separate_k else (None, None)
    qkv = leaf * 1.0
    result = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved=True, num_heads_q=num_heads_q)
    assert result is qkv
    expected = _reference_qkv(leaf.detach(), cos, sin, cos if cos_k is None else cos_k,
                              sin if sin_k is None else sin_k, True, num_heads_q)
    torch.testing.assert_close(qkv.double(), expected, rtol=0, atol=1e-6)
    v_part = (slice(None), slice(None), 2) if layout == "packed5d" else (slice(None), slice(None), slice(6, 8))
    assert torch.equal(qkv[v_part], leaf[v_part])
    dout = torch.randn(shape, device=DEVICE)
    (grad,) = torch.autograd.grad(qkv, leaf, dout)
    x64 = leaf.detach().double().requires_grad_()
    ref = _reference_qkv(x64, cos, sin, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, True,
                         num_heads_q)
    (grad64,) = torch.autograd.grad(ref, x64, dout.double())
    torch.testing.assert_close(grad.double(), grad64, rtol=0, atol=1e-6)


def test_kv_inplace_and_gradient():
    leaf = torch.randn(2, 9, 2, 3, 32, device=DEVICE, requires_grad=True)
    cos, sin = tables(14, 16)
    kv = leaf * 1.0
    assert apply_rotary_emb_kv_(kv, cos, sin, seqlen_offsets=5) is kv
    expected_k, bound = rotary_reference64(leaf[:, :, 0], cos, sin, 5)
    assert_rotary_close(kv[:, :, 0], expected_k, bound)
    assert torch.equal(kv[:, :, 1], leaf[:, :, 1])
    dout = torch.randn_like(kv)
    (grad,) = torch.autograd.grad(kv, leaf, dout)
    expected_dk, bound = rotary_reference64(dout[:, :, 0], cos, sin, 5, conjugate=True)
    assert_rotary_close(grad[:, :, 0], expected_dk, bound)
    assert torch.equal(grad[:, :, 1], dout[:, :, 1])


# ---- the PyTorch helpers ---------------------------------------------------------------------------------------

def test_rotate_half():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rotate_half(x).tolist() == [-3.0, -4.0, 1.0, 2.0]
    assert rotate_half(x, interleaved=True).tolist() == [-2.0, 1.0, -4.0, 3.0]


def test_torch_reference_with_batched_tables():
    x = torch.randn(2, 6, 2, 16, dtype=torch.float64)
    angles = torch.rand(2, 6, 8, dtype=torch.float64)
    out = apply_rotary_emb_torch(x, angles.cos(), angles.sin(), interleaved=True)
    for b in range(2):
        torch.testing.assert_close(out[b], apply_rotary_emb_torch(x[b:b + 1], angles[b].cos(), angles[b].sin(),
                                                                  interleaved=True)[0])


# ---- RotaryEmbedding -------------------------------------------------------------------------------------------

def rope_tables(dim, positions, base=10000.0):
    """cos, sin (len(positions), dim / 2) in float64 from the definition, on the test device."""
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=DEVICE) / dim)
    angles = torch.as_tensor(list(positions), dtype=torch.float64, device=DEVICE)[:, None] * inv_freq
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_rotary_embedding_qkv_and_cache_growth(interleaved):
    rotary = RotaryEmbedding(16, interleaved=interleaved, device=DEVICE)
    qkv = torch.randn(2, 8, 3, 2, 32, device=DEVICE)
    expected = qkv.double().clone()
    cos, sin = rope_tables(16, range(5, 13))
    for i in (0, 1):
        expected[:, :, i] = apply_rotary_emb_torch(expected[:, :, i], cos, sin, interleaved)
    assert rotary(qkv, seqlen_offset=5) is qkv
    assert rotary._seq_len_cached == 13 and rotary._cos_cached.dtype == torch.float32
    torch.testing.assert_close(qkv.double(), expected, rtol=0, atol=1e-5)
    rotary(torch.randn(1, 4, 3, 2, 32, device=DEVICE))
    assert rotary._seq_len_cached == 13, "the cache never shrinks"
    rotary(torch.randn(1, 4, 3, 2, 32, device=DEVICE), max_seqlen=30)
    assert rotary._seq_len_cached == 30
    rotary(torch.randn(1, 4, 3, 2, 32, device=DEVICE, dtype=torch.float16))
    assert rotary._cos_cached.dtype == torch.float16 and rotary._cos_cached.shape == (30, 8)


def test_rotary_embedding_q_and_kv_with_tensor_offsets():
    rotary = RotaryEmbedding(32, base=500.0, device=DEVICE)
    q = torch.randn(2, 6, 4, 32, device=DEVICE)
    kv = torch.randn(2, 6, 2, 2, 32, device=DEVICE)
    q_ref, kv_ref = q.double().clone(), kv.double().clone()
    offsets = torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)
    for b, offset in enumerate((0, 10)):
        cos, sin = rope_tables(32, range(offset, offset + 6), base=500.0)
        q_ref[b:b + 1] = apply_rotary_emb_torch(q_ref[b:b + 1], cos, sin)
        kv_ref[b:b + 1, :, 0] = apply_rotary_emb_torch(kv_ref[b:b + 1, :, 0], cos, sin)
    q_out, kv_out = rotary(q, kv, seqlen_offset=offsets, max_seqlen=16)
    assert q_out is q and kv_out is kv and rotary._seq_len_cached == 16
    torch.testing.assert_close(q.double(), q_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(kv.double(), kv_ref, rtol=0, atol=1e-5)


def test_rotary_embedding_num_heads_q():
    rotary = RotaryEmbedding(32, device=DEVICE)
    qkv = torch.randn(1, 5, 6 + 2 * 3, 32, device=DEVICE)
    packed = qkv[:, :, :6].clone(), qkv[:, :, 6:9].clone(), qkv[:, :, 9:].clone()
    rotary(qkv, num_heads_q=6)
    cos, sin = rope_tables(32, range(5))
    torch.testing.assert_close(qkv[:, :, :6].double(), apply_rotary_emb_torch(packed[0].double(), cos, sin),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(qkv[:, :, 6:9].double(), apply_rotary_emb_torch(packed[1].double(), cos, sin),
                               rtol=0, atol=1e-5)
    assert torch.equal(qkv[:, :, 9:], packed[2])


def test_xpos_scales_scores_by_relative_position():
    dim, scale_base, seqlen = 16, 64.0, 12
    rotary = RotaryEmbedding(dim, scale_base=scale_base, device=DEVICE)
    qkv = torch.randn(1, seqlen, 3, 1, dim, device=DEVICE)
    q0, k0 = qkv[0, :, 0, 0].double().clone(), qkv[0, :, 1, 0].double().clone()
    rotary(qkv)
    scores = qkv[0, :, 0, 0].double() @ qkv[0, :, 1, 0].double().T
    zeta = (torch.arange(0, dim, 2, dtype=torch.float64, device=DEVICE) + 0.4 * dim) / (1.4 * dim)
    cos, sin = rope_tables(dim, range(seqlen))
    q_rot = apply_rotary_emb_torch(q0[None, :, None], cos, sin)[0, :, 0]
    k_rot = apply_rotary_emb_torch(k0[None, :, None], cos, sin)[0, :, 0]
    positions = torch.arange(seqlen, dtype=torch.float64, device=DEVICE)
    relative = positions[:, None] - positions[None, :]
    # score(i, j) = sum_m zeta_m^((i - j) / scale_base) * (pair m of q_i) . (pair m of k_j)
    pairs_q, pairs_k = q_rot.view(seqlen, 2, dim // 2), k_rot.view(seqlen, 2, dim // 2)
    per_pair = torch.einsum("ipm,jpm->ijm", pairs_q, pairs_k)
    expected = (per_pair * zeta ** (relative[..., None] / scale_base)).sum(-1)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert rotary._cos_k_cached is not None and not torch.equal(rotary._cos_k_cached, rotary._cos_cached)


def test_rotary_embedding_rebuilds_from_fp32_after_half_cast():
    rotary = RotaryEmbedding(16, device=DEVICE).half()
    assert rotary.inv_freq.dtype == torch.float16
    rotary(torch.randn(1, 40, 3, 1, 16, device=DEVICE, dtype=torch.float16))
    cos, _ = rope_tables(16, range(40))
    torch.testing.assert_close(rotary._cos_cached.double(), cos.half().double(), rtol=0, atol=0)


# ---- argument checks and launch configuration ------------------------------------------------------------------

def _bad_calls():
    x = torch.randn(2, 8, 2, 32, device=DEVICE)
    cos, sin = tables(8, 32)
    wide_cos, wide_sin = tables(8, 48)
    return {
        "rotary_dim > headdim": (lambda: apply_rotary(x, wide_cos, wide_sin), "rotary_dim must be <= headdim"),
        "headdim > 256": (lambda: apply_rotary(torch.randn(1, 2, 1, 264, device=DEVICE), *tables(2, 32)),
                          "headdim <= 256"),
        "table too short": (lambda: apply_rotary(x, cos[:6], sin[:6]), "seqlen_ro must be >= seqlen"),
        "int offset past table": (lambda: apply_rotary(x, cos, sin, seqlen_offsets=1), "seqlen_ro"),
        "varlen without max_seqlen": (
            lambda: apply_rotary(x[0], cos, sin, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)),
            "max_seqlen must be passed"),
        "offsets shape": (lambda: apply_rotary(x, cos, sin, seqlen_offsets=torch.zeros(3, dtype=torch.int32,
                                                                                        device=DEVICE)), "(batch,)"),
        "offsets dtype": (lambda: apply_rotary(x, cos, sin, seqlen_offsets=torch.zeros(2, device=DEVICE)),
                          "int32 or int64"),
        "sin shape": (lambda: apply_rotary(x, cos, sin[:, :8]), "sin must have the shape of cos"),
        "qkv without num_heads_q": (lambda: apply_rotary_emb_qkv_(torch.randn(1, 8, 6, 32, device=DEVICE), cos, sin),
                                    "num_heads_q"),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_asserts(name):
    call, message = _bad_calls()[name]
    with pytest.raises(AssertionError, match=re.escape(message)):
        call()


def test_block_sizes_do_not_depend_on_seqlen():
    for rotary_dim, head_dim, heads in ((128, 128, 32), (64, 128, 3), (16, 16, 1), (256, 256, 8)):
        block_k, block_tail, block_s, block_h = rotary_ops.block_sizes(rotary_dim, head_dim, heads, True)
        for block in (block_k, block_tail, block_s, block_h):
            assert block & (block - 1) == 0
        assert block_k >= rotary_dim // 2 and block_tail >= head_dim - rotary_dim
        assert block_s * block_h * block_k <= rotary_ops.TILE_ELEMENTS


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compilation counting needs compiled kernels")
def test_new_lengths_and_offsets_do_not_recompile():
    from flashtriton.kernel_inspect import compiled_kernels
    from flashtriton.kernels.rotary import rotary_kernel

    cos, sin = tables(4096, 64, torch.float16)
    for seqlen, offset in ((128, 0), (113, 7)):
        apply_rotary(torch.randn(2, seqlen, 4, 64, device=DEVICE, dtype=torch.float16), cos, sin, offset)
    before = len(compiled_kernels(rotary_kernel))
    for seqlen, offset in ((1, 3), (1000, 17), (2049, 2000), (333, 1)):
        apply_rotary(torch.randn(2, seqlen, 4, 64, device=DEVICE, dtype=torch.float16), cos, sin, offset)
    assert len(compiled_kernels(rotary_kernel)) == before


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the grid-axis limit only applies to compiled launches")
def test_batch_beyond_the_65535_grid_axis_limit():
    x = random_x((70_000, 1, 2, 32), torch.float16)
    cos, sin = tables(8, 32, torch.float16)
    offsets = torch.randint(0, 8, (70_000,), device=DEVICE)
    out = apply_rotary(x, cos, sin, offsets)
    assert_rotary_close(out, *rotary_reference64(x, cos, sin, offsets))
