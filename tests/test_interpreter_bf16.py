"""bf16 through Triton's interpreter: the library's own kernels give the right numbers, with no test-only patch.

Triton 3.6-3.9's interpreter multiplies bf16 tl.dot operands as their uint16 storage. Every tl.dot of the
attention kernels goes through flashtriton.kernels.common.mma, which widens bf16 operands to fp32 where the
kernels are interpreted. The interpreter also converts fp32 to bf16 (and e4m3) by truncation where the GPU
rounds to nearest even; every narrowing conversion of the kernels goes through common.narrow, which rounds first.
These tests run the kernels in bf16 against the float64 reference and check that tests/conftest.py leaves the
interpreter's dot alone, so the library, not the test setup, makes bf16 right.
"""

import pytest
import torch
import triton
import triton.language as tl

import flashtriton
from flashtriton.kernels import common
from flashtriton.ops import backend
from flashtriton.testing import Case, assert_checks_ok, compare_with_reference, make_case_inputs, poisoned_outputs

interpreted_only = pytest.mark.skipif(not backend.KERNELS_INTERPRETED,
                                      reason="kernels are not interpreted (TRITON_INTERPRET=1 was not set at import)")


def test_kernels_and_library_agree_on_interpretation():
    assert bool(common.INTERPRETED) == backend.KERNELS_INTERPRETED


def test_conftest_does_not_patch_the_interpreters_dot():
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot
    where = (create_dot.__module__, create_dot.__qualname__)
    assert where == (interpreter.__name__, "InterpreterBuilder.create_dot"), \
        f"InterpreterBuilder.create_dot is replaced by {'.'.join(where)}"


@triton.jit
def _mma_kernel(A, B, C, Out, Product, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    offs_m, offs_n, offs_k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(A + offs_m[:, None] * K + offs_k[None, :])
    b = tl.load(B + offs_k[:, None] * N + offs_n[None, :])
    c = tl.load(C + offs_m[:, None] * N + offs_n[None, :])
    tl.store(Out + offs_m[:, None] * N + offs_n[None, :], common.mma(a, b, c))
    tl.store(Product + offs_m[:, None] * N + offs_n[None, :], common.mma(a, b))


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mma_sums_exact_products_in_fp32(dtype):
    """mma(a, b, c) = a @ b + c with exact products and fp32 sums: within K fp32 roundings of float64."""
    m, n, k = 16, 32, 64
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    c = torch.randn(m, n)
    out, product = torch.full((m, n), float("nan")), torch.full((m, n), float("nan"))
    _mma_kernel[(1,)](a, b, c, out, product, m, n, k)
    exact = a.double() @ b.double()
    bound = (k + 1) * 2.0 ** -24 * (a.double().abs() @ b.double().abs() + c.double().abs())
    assert ((product.double() - exact).abs() <= bound).all(), float((product.double() - exact).abs().max())
    assert ((out.double() - (exact + c.double())).abs() <= bound).all(), float((out.double() - exact).abs().max())


@triton.jit
def _narrow_kernel(X, Out, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Out + offs, common.narrow(tl.load(X + offs), Out.dtype.element_ty))


@pytest.mark.skipif(not backend.KERNELS_INTERPRETED and not torch.cuda.is_available(),
                    reason="no kernel runs here: neither interpreted nor a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=["bf16", "fp16", "e4m3"])
def test_narrow_rounds_to_nearest_even(dtype):
    """common.narrow gives torch's conversion bit for bit (round to nearest even; the GPU's cvt.rn), interpreted or
    compiled: random values over many binades, ties, signed zeros, infinities and NaN (e4m3: within +-448, where
    torch does not saturate)."""
    device = "cpu" if backend.KERNELS_INTERPRETED else "cuda"
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.float8_e4m3fn:
        grid = torch.arange(-448.0, 448.0, 2.0 ** -4)
        values = torch.cat([torch.rand(2048, generator=generator) * 896 - 448,
                            torch.randn(1024, generator=generator) * 2.0 ** -6, grid[:1024] + 2.0 ** -5])
    else:
        values = torch.cat([torch.randn(3000, generator=generator) * 10.0 ** torch.randint(-4, 5, (3000,),
                                                                                          generator=generator),
                            torch.tensor([1.00390625, 1.01171875, 0.99995, -0.99995, 0.0, -0.0, float("inf"),
                                          -float("inf"), float("nan")])])
    x = torch.cat([values, torch.zeros(4096 - values.numel())]).to(device)
    out = torch.empty(4096, dtype=dtype, device=device)
    _narrow_kernel[(1,)](x, out, 4096)
    expected = x.to(dtype)
    same = (out.view(torch.uint8) == expected.view(torch.uint8)).view(4096, -1).all(-1)
    same |= out.float().isnan() & expected.float().isnan()
    assert same.all(), (x[~same][:4], out[~same][:4], expected[~same][:4])


@interpreted_only
@pytest.mark.parametrize("dq", ["dq-pass", "dq-atomic"])
def test_bf16_forward_and_backward_match_float64(dq, request):
    """Forward and backward in bf16 (every tl.dot of fwd.py and bwd.py) against the float64 reference."""
    if dq == "dq-atomic":
        request.getfixturevalue("force_dq_atomic")
    case = Case(batch=1, seqlen_q=70, seqlen_k=90, num_heads=4, num_heads_k=2, head_dim=40, dtype=torch.bfloat16,
                causal=True, softcap=3.0)
    q, k, v, slopes = make_case_inputs(case, requires_grad=True)
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, 0.0, causal=case.causal, softcap=case.softcap,
                                                  return_attn_probs=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_checks_ok(compare_with_reference(case, out, lse, q, k, v, slopes, grads, dout))
