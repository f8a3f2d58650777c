"""V's head dim apart from q's and k's (head_dim_v, docs/api.md §2.4), and head dims up to 512 (576 for the kv
cache's q / k, MLA's decode shape): forward and backward against the float64 reference, NaN-poisoned outputs."""

import pytest
import torch

import flashtriton
from flashtriton import configs
from flashtriton.ops import hopper
from flashtriton.scores import score_params
from flashtriton.reference import kvcache_reference
from flashtriton.testing import (Case, assert_checks_ok, check_error, check_lse, compare_varlen_with_reference,
                                 compare_with_reference, cu_seqlens, poisoned_outputs)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_dense(case: Case, head_dim_v: int, sink: bool = False):
    """flash_attn_func with v (B, Sk, Hk, head_dim_v); every output and gradient against the reference."""
    def tensor(*shape):
        return torch.randn(*shape, device=DEVICE).to(case.dtype).requires_grad_()

    q = tensor(case.batch, case.seqlen_q, case.num_heads, case.head_dim)
    k = tensor(case.batch, case.seqlen_k, case.num_heads_k, case.head_dim)
    v = tensor(case.batch, case.seqlen_k, case.num_heads_k, head_dim_v)
    slopes = torch.rand(case.num_heads, device=DEVICE) * 0.3 if case.alibi else None
    learnable_sink = torch.randn(case.num_heads, device=DEVICE).requires_grad_() if sink else None
    leaves = (q, k, v) if learnable_sink is None else (q, k, v, learnable_sink)
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, 0.0, case.softmax_scale, case.causal, case.window_size,
                                                  case.softcap, slopes, return_attn_probs=True,
                                                  learnable_sink=learnable_sink)
        assert out.shape == (*q.shape[:-1], head_dim_v)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, dout)
    assert_checks_ok(compare_with_reference(case, out, lse, q, k, v, slopes, grads, dout,
                                            learnable_sink=learnable_sink))


DIMS = [(32, 16), (16, 48), (40, 24), (64, 128), (72, 8)]
FEATURES = {
    "plain": dict(),
    "causal-gqa": dict(causal=True, num_heads=6, num_heads_k=2),
    "window-softcap": dict(window_size=(13, 4), softcap=3.0),
    "alibi-bf16": dict(alibi=True, causal=True, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("feature", list(FEATURES), ids=list(FEATURES))
@pytest.mark.parametrize("head_dim,head_dim_v", DIMS, ids=[f"d{a}-dv{b}" for a, b in DIMS])
def test_dense_forward_and_backward(head_dim, head_dim_v, feature):
    case = Case(**{**dict(batch=2, seqlen_q=70, seqlen_k=85, num_heads=4, num_heads_k=2, head_dim=head_dim),
                   **FEATURES[feature]})
    run_dense(case, head_dim_v)


def test_with_sinks_and_few_queries():
    """Decode-shaped queries (split keys, packed GQA) and sinks folded into the narrower output."""
    run_dense(Case(batch=1, seqlen_q=3, seqlen_k=400, num_heads=8, num_heads_k=2, head_dim=64, causal=True), 32,
              sink=True)


@pytest.mark.parametrize("head_dim,head_dim_v", [(512, 512), (320, 512), (512, 96)],
                         ids=["d512", "d320-dv512", "d512-dv96"])
def test_head_dims_up_to_512(head_dim, head_dim_v):
    run_dense(Case(batch=1, seqlen_q=40, seqlen_k=72, num_heads=2, num_heads_k=1, head_dim=head_dim, causal=True),
              head_dim_v)


def run_varlen(lengths_q, lengths_k, head_dim: int, head_dim_v: int, dtype=torch.float16, **options):
    """flash_attn_varlen_func with v (Tk, Hk, head_dim_v) (two rows past the last sequence in q); outputs and
    gradients against the reference."""
    cu_q, cu_k = cu_seqlens(lengths_q, DEVICE), cu_seqlens(lengths_k, DEVICE)
    q = torch.randn(sum(lengths_q) + 2, 4, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), 2, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths_k), 2, head_dim_v, device=DEVICE, dtype=dtype, requires_grad=True)
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                         return_attn_probs=True, **options)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.shape == (q.shape[0], 4, head_dim_v)
    assert_checks_ok(compare_varlen_with_reference(out, lse, q, k, v, cu_q, cu_k, max(lengths_k), grads, dout,
                                                   **options))


def test_varlen_forward_and_backward():
    run_varlen([9, 0, 31], [12, 5, 40], 32, 64, causal=True, window_size=(20, 0))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the Hopper kernels run on a GPU")
@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(150, 30))], ids=["causal", "window"])
def test_mla_varlen_gpu(options):
    """(192, 128) varlen calls on sm_90's forward for narrow V (configs.HOPPER_FWD_NARROW_V: 128-key blocks, O staged
    in Q's first chunk): sequences shorter than a tile, empty ones, and ones across many key blocks; stores by
    pointer at each sequence's end."""
    launches = hopper.fwd_launch_count
    run_varlen([130, 0, 257, 64, 700], [200, 7, 257, 300, 901], 192, 128, dtype=torch.bfloat16, **options)
    on_hopper = (hopper.is_hopper(torch.device(DEVICE)) and hopper.attn_fwd_hopper_kernel is not None
                 and configs.GLUON_ALLOWED)
    assert hopper.fwd_launch_count == launches + int(on_hopper)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_appends_and_attends(num_splits, paged):
    batch, heads, heads_k, dim, dim_v, capacity = 3, 4, 2, 48, 32, 96
    q = torch.randn(batch, 2, heads, dim, device=DEVICE, dtype=torch.float16)
    k_new = torch.randn(batch, 2, heads_k, dim, device=DEVICE, dtype=torch.float16)
    v_new = torch.randn(batch, 2, heads_k, dim_v, device=DEVICE, dtype=torch.float16)
    block_table, rows = None, (batch, capacity)
    if paged:
        page = 16
        block_table = torch.randperm(batch * capacity // page, device=DEVICE).view(batch, -1).to(torch.int32)
        rows = (batch * capacity // page, page)
    k_cache = torch.randn(*rows, heads_k, dim, device=DEVICE, dtype=torch.float16)
    v_cache = torch.randn(*rows, heads_k, dim_v, device=DEVICE, dtype=torch.float16)
    options = dict(cache_seqlens=torch.tensor([0, 40, 94], dtype=torch.int32, device=DEVICE),
                   block_table=block_table, causal=True)
    ref_out, ref_lse, ref_k, ref_v = kvcache_reference(q, k_cache, v_cache, k_new, v_new, **options)
    pt_out = kvcache_reference(q, k_cache, v_cache, k_new, v_new, compute_dtype=None, **options)[0]
    with poisoned_outputs():
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, num_splits=num_splits,
                                                       return_softmax_lse=True, **options)
    assert_checks_ok([check_error("out", out, ref_out, pt_out, factor=3.0), check_lse(lse, ref_lse)])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_mla_decode_shape():
    """MLA (DeepSeek) decoding: one query token, q / k head dim 576 = 512 + 64, V head dim 512, one KV head."""
    batch, heads, capacity = 2, 8, 80
    q = torch.randn(batch, 1, heads, 576, device=DEVICE, dtype=torch.bfloat16)
    k_cache = torch.randn(batch, capacity, 1, 576, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn(batch, capacity, 1, 512, device=DEVICE, dtype=torch.bfloat16)
    cache_seqlens = torch.tensor([33, 80], dtype=torch.int32, device=DEVICE)
    ref_out, ref_lse, _, _ = kvcache_reference(q, k_cache, v_cache, cache_seqlens=cache_seqlens)
    pt_out = kvcache_reference(q, k_cache, v_cache, cache_seqlens=cache_seqlens, compute_dtype=None)[0]
    with poisoned_outputs():
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                                       return_softmax_lse=True)
    assert out.shape == (batch, 1, heads, 512)
    assert_checks_ok([check_error("out", out, ref_out, pt_out, factor=3.0), check_lse(lse, ref_lse)])


@pytest.mark.parametrize("call,match", [
    (lambda: flashtriton.flash_attn_func(*_qkv(64, 513)), "at most 512, got 513 for v"),
    (lambda: flashtriton.flash_attn_func(*_qkv(576, 512)), "at most 512"),
    (lambda: flashtriton.flash_attn_with_kvcache(*_qkv(577, 512)), "at most 576"),
    (lambda: flashtriton.flash_attn_with_kvcache(*_qkv(576, 513)), "at most 512, got 513 for v_cache"),
], ids=["v-513", "dense-qk-576", "kvcache-qk-577", "kvcache-v-513"])
def test_head_dims_above_the_limits_raise(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()


def _qkv(head_dim: int, head_dim_v: int):
    return (torch.zeros(1, 4, 2, head_dim, device=DEVICE, dtype=torch.float16),
            torch.zeros(1, 4, 2, head_dim, device=DEVICE, dtype=torch.float16),
            torch.zeros(1, 4, 2, head_dim_v, device=DEVICE, dtype=torch.float16))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="long sequences and the Hopper kernels run on a GPU")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 128), (128, 64), (64, 128), (256, 128), (96, 192), (512, 512),
                                                 (256, 512)])
def test_long_sequences_gpu(head_dim, head_dim_v, causal):
    """GPU tiles (wgmma, descriptors up to 256 wide, pointer loads above). On sm_90 the Gluon forward takes V's own
    head dim up to 256 (q / k and v / out tiles of their own widths) and both head dims in 257-512 (the wide tiles
    of kernels/hopper/fwd_d512.py); the Gluon backward takes it where q / k run the
    dK / dV only tiles (192, 256) and V's are 128 wide ((192, 128), (256, 128): MLA-style), and leaves the others
    to the Triton kernels."""
    launches = hopper.fwd_launch_count, hopper.bwd_launch_count
    run_dense(Case(batch=2, seqlen_q=700, seqlen_k=900, num_heads=4, num_heads_k=2, head_dim=head_dim,
                   dtype=torch.bfloat16, causal=causal), head_dim_v)
    gluon_forward = hopper.gluon_runs("fwd", torch.empty(1, 1, 1, head_dim, device=DEVICE, dtype=torch.bfloat16),
                                      score_params(head_dim ** -0.5, causal, -1, -1, 0.0, 900), 700, 900, True, True,
                                      head_dim_v=head_dim_v)
    assert gluon_forward == (hopper.is_hopper(torch.device(DEVICE))
                             and (max(head_dim, head_dim_v) <= 256 or hopper.wide_forward(head_dim, head_dim_v))
                             and hopper.attn_fwd_hopper_kernel is not None and configs.GLUON_ALLOWED)
    assert hopper.fwd_launch_count == launches[0] + int(gluon_forward)
    gluon_backward = hopper.gluon_runs("bwd", torch.empty(1, 1, 1, head_dim, device=DEVICE, dtype=torch.bfloat16),
                                       score_params(head_dim ** -0.5, causal, -1, -1, 0.0, 900), 700, 900, True, True,
                                       head_dim_v=head_dim_v)
    assert gluon_backward == (hopper.is_hopper(torch.device(DEVICE)) and (head_dim, head_dim_v) in ((192, 128),
                                                                                                  (256, 128))
                              and hopper.attn_bwd_hopper_kernel is not None and configs.GLUON_ALLOWED)
    assert hopper.bwd_launch_count == launches[1] + int(gluon_backward)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the Hopper kernels run on a GPU")
@pytest.mark.parametrize("options", [dict(window_size=(100, 0), causal=True), dict(window_size=(40, 200)),
                                     dict(seqlen_q=17, seqlen_k=333), dict(num_heads=4, num_heads_k=1, causal=True)],
                         ids=["causal-window", "two-sided-window", "sq17-sk333", "mqa-causal"])
def test_mla_backward_features_gpu(options):
    """(192, 128) through the dK / dV only kernel's own V tiles and the Gluon dQ kernel on sm_90 (the Triton kernels
    elsewhere): windows on both sides, few query rows, MQA."""
    case = Case(**{**dict(batch=2, seqlen_q=300, seqlen_k=500, num_heads=4, num_heads_k=2, head_dim=192,
                          dtype=torch.bfloat16), **options})
    launches = hopper.bwd_launch_count, hopper.bwd_dq_launch_count
    run_dense(case, 128)
    on_hopper = (hopper.is_hopper(torch.device(DEVICE)) and hopper.attn_bwd_hopper_kernel is not None
                 and configs.GLUON_ALLOWED)
    assert (hopper.bwd_launch_count > launches[0], hopper.bwd_dq_launch_count > launches[1]) == (on_hopper, on_hopper)
