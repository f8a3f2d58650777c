"""flashtriton.integrations.sdpa: flashtriton as torch.nn.attention's flash attention impl "flashtriton".

CPU: the aten kernels are plain functions, called here directly on CPU tensors (never activated: activation
replaces CUDA kernels process-wide). Their results pass the tolerance rule against the float64 oracle, and that
oracle equals torch's math SDPA in float64 on the same inputs. GPU (marked gpu): activated, SDPA's FLASH backend
and varlen_attn against the same references, with flashtriton's entry points counted.
"""

import contextlib
import inspect

import pytest
import torch
import torch.nn.functional as F

import flashtriton
from flashtriton.integrations import sdpa
from flashtriton.ops import backend
from flashtriton.reference import attention_reference, attention_reference_varlen
from flashtriton.testing import (Case, assert_checks_ok, compare_varlen_with_reference, compare_with_reference,
                                 cu_seqlens, make_case_inputs, poisoned_outputs)

attention = pytest.importorskip("torch.nn.attention")
HAS_REGISTRY = hasattr(attention, "register_flash_attention_impl")
needs_registry = pytest.mark.skipif(not HAS_REGISTRY, reason="torch without torch.nn.attention's impl registry")
COMPILED_GPU = torch.cuda.is_available() and not backend.KERNELS_INTERPRETED


def math_sdpa64(q, k, v, causal, scale=None):
    """torch's math SDPA in float64 on (B, S, H, D) tensors, the causal diagonal aligned bottom-right (aten's flash
    convention); returns (B, S, H, D)."""
    q, k, v = (t.detach().double().transpose(1, 2) for t in (q, k, v))
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    mask = None
    if causal:
        rows = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
        mask = torch.arange(seqlen_k, device=q.device)[None, :] <= rows
    with attention.sdpa_kernel(attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


def assert_oracle_is_math(q, k, v, causal):
    """The float64 oracle of the tolerance checks computes what torch's math SDPA computes."""
    oracle, _ = attention_reference(q.detach().double(), k.detach().double(), v.detach().double(), causal=causal,
                                    compute_dtype=torch.float64)
    math = math_sdpa64(q, k, v, causal)
    torch.testing.assert_close(oracle, math, rtol=1e-10, atol=1e-12)


DENSE_CASES = [
    Case(batch=2, seqlen_q=24, seqlen_k=40, num_heads=2, num_heads_k=2, head_dim=32, layout="bhsd"),
    Case(batch=1, seqlen_q=33, seqlen_k=33, num_heads=4, num_heads_k=2, head_dim=32, causal=True, layout="bhsd"),
]


@pytest.mark.parametrize("case", DENSE_CASES, ids=[c.label() for c in DENSE_CASES])
def test_sdpa_kernels_match_math(case):
    """aten::_scaled_dot_product_flash_attention(+_backward) on (B, H, S, D) tensors, GQA included."""
    q, k, v, _ = make_case_inputs(case)
    dout = torch.randn_like(q)
    bhsd = [t.transpose(1, 2) for t in (q, k, v, dout)]
    with poisoned_outputs():
        result = sdpa.scaled_dot_product_flash_attention(*bhsd[:3], 0.0, case.causal, False)
        out, lse = result[0], result[1]
        assert result[2:6] == (None, None, case.seqlen_q, case.seqlen_k)
        assert result[6].dtype == torch.uint64 and result[6].shape == (2,) and result[7].shape == ()
        assert out.shape == bhsd[0].shape and lse.shape == (case.batch, case.num_heads, case.seqlen_q)
        assert lse.dtype == torch.float32
        grads = sdpa.scaled_dot_product_flash_attention_backward(
            bhsd[3], *bhsd[:3], out, lse, None, None, case.seqlen_q, case.seqlen_k, 0.0, case.causal,
            result[6], result[7])
    assert [g.shape for g in grads] == [t.shape for t in bhsd[:3]]
    grads = [g.transpose(1, 2) for g in grads]
    assert_checks_ok(compare_with_reference(case, out.transpose(1, 2), lse, q, k, v, None, grads, dout))
    assert_oracle_is_math(q, k, v, case.causal)


def test_flash_attention_dense_causal_bottom_right_and_scale():
    """aten::_flash_attention_forward/_backward, dense (B, S, H, D): causal with Sq < Sk aligns bottom-right;
    scale and a (left, right) window pass through."""
    case = Case(batch=1, seqlen_q=17, seqlen_k=45, num_heads=2, num_heads_k=1, head_dim=32, causal=True,
                softmax_scale=0.3, window_size=(20, 0))
    q, k, v, _ = make_case_inputs(case)
    dout = torch.randn_like(q)
    with poisoned_outputs():
        out, lse, rng_state, unused, debug = sdpa.flash_attention_forward(
            q, k, v, None, None, 17, 45, 0.0, True, False, scale=0.3, window_size_left=20, window_size_right=0)
        grads = sdpa.flash_attention_backward(dout, q, k, v, out, lse, None, None, 17, 45, 0.0, True, rng_state,
                                              unused, scale=0.3, window_size_left=20, window_size_right=0)
    assert debug.numel() == 0
    assert_checks_ok(compare_with_reference(case, out, lse, q, k, v, None, grads, dout))
    no_window = Case(batch=1, seqlen_q=17, seqlen_k=45, num_heads=2, num_heads_k=1, head_dim=32, causal=True)
    with poisoned_outputs():
        out, lse, *_ = sdpa.flash_attention_forward(q, k, v, None, None, 17, 45, 0.0, True, False)
    assert_checks_ok(compare_with_reference(no_window, out, lse, q, k, v, None))
    assert_oracle_is_math(q, k, v, True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attention_varlen_matches_math(causal):
    """Varlen through aten::_flash_attention_forward/_backward (cum_seq_q/k, lse (H, Tq)) and the in-place
    forward, GQA, against the oracle; each sequence's oracle equals math SDPA on that sequence."""
    lens_q, lens_k = [5, 0, 19], [9, 4, 19]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = torch.randn(sum(lens_q), 4, 32).half()
    k, v = (torch.randn(sum(lens_k), 2, 32).half() for _ in range(2))
    dout = torch.randn_like(q)
    with poisoned_outputs():
        out, lse, rng_state, unused, _ = sdpa.flash_attention_forward(q, k, v, cu_q, cu_k, 19, 19, 0.0, causal, False)
        grads = sdpa.flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, 19, 19, 0.0, causal, rng_state,
                                              unused)
        out_inplace = torch.full_like(q, float("nan"))
        lse_inplace = sdpa.flash_attention_forward_no_dropout_inplace(out_inplace, q, k, v, cu_q, cu_k, 19, 19, 0.0,
                                                                      causal, False)
    assert lse.shape == (4, sum(lens_q))
    assert torch.equal(out_inplace, out) and torch.equal(lse_inplace, lse)
    assert_checks_ok(compare_varlen_with_reference(out, lse, q, k, v, cu_q, cu_k, 19, grads, dout, causal=causal))
    oracle, _ = attention_reference_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, 19, causal=causal,
                                           compute_dtype=torch.float64)
    for b in range(len(lens_q)):
        rows_q, rows_k = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b]:
            math = math_sdpa64(q[None, rows_q], k[None, rows_k], v[None, rows_k], causal)[0]
            torch.testing.assert_close(oracle[rows_q], math, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("call, message", [
    (lambda q: sdpa.scaled_dot_product_flash_attention(q, q, q, 0.1), "dropout_p must be 0.0, got 0.1"),
    (lambda q: sdpa.scaled_dot_product_flash_attention(q, q, q, 0.0, False, True), "return_debug_mask"),
    (lambda q: sdpa.flash_attention_forward(q, q, q, None, None, 8, 8, 0.0, False, False,
                                            block_table=torch.zeros(1, 1, dtype=torch.int32)), "block_table"),
    (lambda q: sdpa.flash_attention_forward(q, q, q, None, None, 8, 8, 0.0, False, False,
                                            seqused_k=torch.zeros(1, dtype=torch.int32)), "seqused_k"),
    (lambda q: sdpa.scaled_dot_product_flash_attention(q.float(), q.float(), q.float()), "fp16 and bf16"),
], ids=["dropout", "debug-mask", "block-table", "seqused-k", "fp32"])
def test_unsupported_inputs_raise(call, message):
    with pytest.raises(RuntimeError, match=message):
        call(torch.randn(1, 2, 8, 32).half())


@needs_registry
def test_registered_not_activated():
    """`import flashtriton` registers the impl; activation stays the user's choice."""
    assert flashtriton  # imported above, which registers
    assert sdpa.IMPL_NAME in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() != sdpa.IMPL_NAME


def test_operator_schemas_match_kernels():
    """This torch's aten schemas are accepted by the kernels (what activation checks first), and a kernel that
    lacks a schema argument is named as a mismatch."""
    if not all(hasattr(torch.ops.aten, name) for name, entry in sdpa._KERNELS.items() if entry[2]):
        pytest.skip("torch without aten's flash attention operators")
    schemas = sdpa._operator_schemas()
    assert {name for name, entry in sdpa._KERNELS.items() if entry[2]} <= set(schemas)

    def short_kernel(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False):
        return None

    why = sdpa.schema_mismatch(schemas["_scaled_dot_product_flash_attention"], short_kernel, 9)
    assert why is not None and "scale" in why


# GPU: activated through torch's registry

@contextlib.contextmanager
def activated_with_counts(monkeypatch):
    """Activate "flashtriton" and count calls of flashtriton's entry points; restore torch's impl afterwards."""
    counts = dict.fromkeys(("mha_fwd", "mha_bwd", "mha_varlen_fwd", "mha_varlen_bwd"), 0)
    for name in counts:
        original = getattr(backend, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(backend, name, counted)
    attention.activate_flash_attention_impl(sdpa.IMPL_NAME)
    try:
        assert attention.current_flash_attention_impl() == sdpa.IMPL_NAME
        yield counts
    finally:
        attention.restore_flash_attention_impl()


GPU_CASES = [
    Case(batch=2, seqlen_q=128, seqlen_k=128, num_heads=4, num_heads_k=4, head_dim=64, causal=True),
    Case(batch=2, seqlen_q=100, seqlen_k=300, num_heads=8, num_heads_k=2, head_dim=128, dtype=torch.bfloat16),
    Case(batch=1, seqlen_q=257, seqlen_k=257, num_heads=6, num_heads_k=2, head_dim=96, causal=True),
]


@pytest.mark.gpu
@needs_registry
@pytest.mark.skipif(not COMPILED_GPU, reason="needs a CUDA GPU running the compiled Triton kernels")
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.label() for c in GPU_CASES])
def test_gpu_sdpa_flash_backend(case, monkeypatch):
    q, k, v, _ = make_case_inputs(case, device="cuda")
    dout = torch.randn_like(q)
    leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    with activated_with_counts(monkeypatch) as counts, poisoned_outputs():
        with attention.sdpa_kernel(attention.SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=case.causal,
                                                 enable_gqa=case.num_heads != case.num_heads_k)
            out.backward(dout.transpose(1, 2))
            lse = torch.ops.aten._scaled_dot_product_flash_attention(*leaves, 0.0, case.causal)[1]
    assert counts["mha_fwd"] == 2 and counts["mha_bwd"] == 1
    grads = [t.grad.transpose(1, 2) for t in leaves]
    assert_checks_ok(compare_with_reference(case, out.detach().transpose(1, 2), lse, q, k, v, None, grads, dout))
    assert_oracle_is_math(q, k, v, case.causal)


@pytest.mark.gpu
@needs_registry
@pytest.mark.skipif(not COMPILED_GPU, reason="needs a CUDA GPU running the compiled Triton kernels")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_varlen_attn(causal, monkeypatch):
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    params = inspect.signature(varlen.varlen_attn).parameters
    gqa = "enable_gqa" in params
    lens_q, lens_k = [1, 130, 64, 257], [33, 130, 200, 257]
    cu_q, cu_k = cu_seqlens(lens_q, "cuda"), cu_seqlens(lens_k, "cuda")
    num_heads_k = 2 if gqa else 8
    q = torch.randn(sum(lens_q), 8, 64, device="cuda").half().requires_grad_()
    k, v = (torch.randn(sum(lens_k), num_heads_k, 64, device="cuda").half().requires_grad_() for _ in range(2))
    dout = torch.randn_like(q)
    options = {"enable_gqa": True} if gqa else {}
    if causal:
        options.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
    with activated_with_counts(monkeypatch) as counts, poisoned_outputs():
        out, lse = varlen.varlen_attn(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                      return_aux=varlen.AuxRequest(lse=True), **options)
        out.backward(dout)
    assert counts["mha_varlen_fwd"] == 1 and counts["mha_varlen_bwd"] == 1
    grads = [t.grad for t in (q, k, v)]
    assert_checks_ok(compare_varlen_with_reference(out.detach(), lse, q, k, v, cu_q.cpu(), cu_k.cpu(), max(lens_k),
                                                   grads, dout, causal=causal))
