"""Learnable attention sinks (docs/api.md §4.11): `learnable_sink=` on every public function, against the float64
reference whose softmax holds the sink as one more logit; dsink included. Outputs NaN-poisoned, fresh inputs."""

from dataclasses import replace

import pytest
import torch

import flashtriton
from flashtriton import flash_attn_interface as fai
from flashtriton.ops import backend
from flashtriton.reference import attention_reference, kvcache_reference
from flashtriton.testing import (Case, assert_checks_ok, assert_compiled_matches_eager, check_error, check_lse,
                                 compare_varlen_with_reference, compare_with_reference, cu_seqlens, make_case_inputs,
                                 poisoned_outputs)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_sink(num_heads: int, dtype=torch.float32, requires_grad: bool = True) -> torch.Tensor:
    """Sinks of both signs and sizes around the scores' (N(0, 1) inputs: scaled scores are about N(0, 1))."""
    sink = (torch.randn(num_heads, device=DEVICE) * 2.0).to(dtype)
    return sink.requires_grad_(requires_grad)


def run_dense(case: Case, sink_dtype=torch.float32, entry: str = "func"):
    q, k, v, slopes = make_case_inputs(case, DEVICE, requires_grad=True)
    sink = make_sink(case.num_heads, sink_dtype)
    options = dict(softmax_scale=case.softmax_scale, causal=case.causal, window_size=case.window_size,
                   softcap=case.softcap, alibi_slopes=slopes, return_attn_probs=True, learnable_sink=sink)
    with poisoned_outputs():
        if entry == "func":
            out, lse, _ = flashtriton.flash_attn_func(q, k, v, **options)
        elif entry == "kvpacked":
            out, lse, _ = flashtriton.flash_attn_kvpacked_func(q, torch.stack((k, v), dim=2), **options)
        else:
            out, lse, _ = flashtriton.flash_attn_qkvpacked_func(torch.stack((q, k, v), dim=2), **options)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    return compare_with_reference(case, out, lse, q, k, v, slopes, grads, dout, learnable_sink=sink)


DENSE = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal-more-queries-than-keys": dict(causal=True, seqlen_q=90, seqlen_k=40),  # rows without a key
    "window": dict(window_size=(17, 5)),
    "softcap-alibi": dict(softcap=3.0, alibi=True, causal=True),
    "gqa-bf16": dict(num_heads=6, num_heads_k=2, dtype=torch.bfloat16),
    "decode-split": dict(seqlen_q=1, seqlen_k=333, num_heads=4, num_heads_k=1),
}


@pytest.mark.parametrize("name", list(DENSE), ids=list(DENSE))
def test_dense_matches_reference_with_dsink(name):
    case = replace(Case(seqlen_q=70, seqlen_k=90, head_dim=32), **DENSE[name])
    assert_checks_ok(run_dense(case))


@pytest.mark.parametrize("sink_dtype", [torch.bfloat16, torch.float16], ids=["bf16-sink", "fp16-sink"])
def test_half_precision_sinks(sink_dtype):
    assert_checks_ok(run_dense(Case(seqlen_q=50, seqlen_k=50, head_dim=32, causal=True), sink_dtype))


@pytest.mark.parametrize("entry", ["kvpacked", "qkvpacked"])
def test_packed_entries_carry_the_sink(entry):
    assert_checks_ok(run_dense(Case(seqlen_q=48, seqlen_k=48, head_dim=32, causal=True), entry=entry))


def test_rows_without_keys_give_zero_and_the_sink():
    """Causal with more queries than keys: the first rows see nothing; out 0, lse = sink, and no gradient flows
    from them (their sink probability is 1, their output has no value to differentiate)."""
    q = torch.randn(1, 20, 2, 16, device=DEVICE, dtype=torch.float16)
    k = torch.randn(1, 8, 2, 16, device=DEVICE, dtype=torch.float16)
    sink = torch.tensor([0.5, -1.5], device=DEVICE)
    out, lse, _ = flashtriton.flash_attn_func(q, k, k, causal=True, return_attn_probs=True, learnable_sink=sink)
    empty = slice(0, 12)  # row i sees keys j <= i - 12
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.equal(lse[0, :, empty], sink[:, None].expand(2, 12))


def test_strided_sink_is_read_by_head():
    """A strided view as learnable_sink (every other entry of a parameter) gives what its contiguous copy gives."""
    q, k, v = (torch.randn(1, 40, 2, 32, device=DEVICE, dtype=torch.float16) for _ in range(3))
    every_other = (torch.randn(4, device=DEVICE) * 2.0)[::2]
    strided = flashtriton.flash_attn_func(q, k, v, causal=True, learnable_sink=every_other)
    contiguous = flashtriton.flash_attn_func(q, k, v, causal=True, learnable_sink=every_other.contiguous())
    assert torch.equal(strided, contiguous)


def test_varlen_matches_reference_with_dsink():
    lengths_q, lengths_k = [5, 0, 17, 33], [9, 4, 17, 20]
    cu_q, cu_k = cu_seqlens(lengths_q, DEVICE), cu_seqlens(lengths_k, DEVICE)
    tail = 3  # rows of no sequence: out 0, lse = sink
    q = torch.randn(sum(lengths_q) + tail, 4, 32, device=DEVICE, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), 2, 32, device=DEVICE, dtype=torch.float16, requires_grad=True)
            for _ in range(2))
    sink = make_sink(4)
    options = dict(causal=True, window_size=(11, 0), softcap=4.0)
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 20, return_attn_probs=True,
                                                         learnable_sink=sink, **options)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    checks = compare_varlen_with_reference(out, lse, q, k, v, cu_q, cu_k, 20, grads, dout, learnable_sink=sink,
                                           **options)
    assert_checks_ok(checks)
    assert torch.equal(lse[:, -tail:], sink.detach()[:, None].expand(4, tail))


def test_varlen_packed_entries_carry_the_sink():
    lengths = [7, 19]
    cu = cu_seqlens(lengths, DEVICE)
    qkv = torch.randn(sum(lengths), 3, 2, 16, device=DEVICE, dtype=torch.float16)
    sink = make_sink(2, requires_grad=False)
    q, k, v = qkv.unbind(1)
    expected = flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, causal=True, learnable_sink=sink)
    packed = flashtriton.flash_attn_varlen_qkvpacked_func(qkv, cu, 19, causal=True, learnable_sink=sink)
    kv_packed = flashtriton.flash_attn_varlen_kvpacked_func(q, qkv[:, 1:], cu, cu, 19, 19, causal=True,
                                                            learnable_sink=sink)
    assert torch.equal(packed, expected) and torch.equal(kv_packed, expected)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_matches_reference(num_splits, paged):
    batch, heads, heads_k, dim, capacity = 3, 4, 2, 32, 128
    q = torch.randn(batch, 2, heads, dim, device=DEVICE, dtype=torch.float16)
    k_new, v_new = (torch.randn(batch, 2, heads_k, dim, device=DEVICE, dtype=torch.float16) for _ in range(2))
    block_table = None
    shape = (batch, capacity, heads_k, dim)
    if paged:
        page = 32
        block_table = torch.randperm(batch * capacity // page, device=DEVICE).view(batch, -1).to(torch.int32)
        shape = (batch * capacity // page, page, heads_k, dim)
    k_cache, v_cache = (torch.randn(shape, device=DEVICE, dtype=torch.float16) for _ in range(2))
    cache_seqlens = torch.tensor([0, 50, 126], dtype=torch.int32, device=DEVICE)
    sink = make_sink(heads, requires_grad=False)
    options = dict(cache_seqlens=cache_seqlens, block_table=block_table, causal=True)
    ref_out, ref_lse, _, _ = kvcache_reference(q, k_cache, v_cache, k_new, v_new, learnable_sink=sink, **options)
    pt_out = kvcache_reference(q, k_cache, v_cache, k_new, v_new, learnable_sink=sink, compute_dtype=None,
                               **options)[0]
    with poisoned_outputs():
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, num_splits=num_splits,
                                                       return_softmax_lse=True, learnable_sink=sink, **options)
    assert_checks_ok([check_error("out", out, ref_out, pt_out, factor=3.0), check_lse(lse, ref_lse)])


def test_paged_varlen_forward_matches_contiguous():
    lengths = [40, 7]
    cu = cu_seqlens(lengths, DEVICE)
    page = 16
    q = torch.randn(sum(lengths), 4, 32, device=DEVICE, dtype=torch.float16)
    k, v = (torch.randn(sum(lengths), 4, 32, device=DEVICE, dtype=torch.float16) for _ in range(2))
    block_table = torch.tensor([[3, 0, 5], [1, 2, 4]], dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = (torch.zeros(6, page, 4, 32, device=DEVICE, dtype=torch.float16) for _ in range(2))
    for cache, source in ((k_cache, k), (v_cache, v)):
        for b, (start, length) in enumerate(zip(cu[:-1].tolist(), lengths)):
            for t in range(length):
                cache[block_table[b, t // page], t % page] = source[start + t]
    sink = make_sink(4, requires_grad=False)
    expected, expected_lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True,
                                                                   return_attn_probs=True, learnable_sink=sink)
    out, lse, _ = flashtriton.flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, 40, 40, causal=True,
                                                     return_attn_probs=True, block_table=block_table,
                                                     learnable_sink=sink)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-3)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=1e-4)


def test_dropout_with_sinks_matches_reference_with_the_kernels_mask():
    case = Case(seqlen_q=60, seqlen_k=70, head_dim=32, causal=True)
    q, k, v, _ = make_case_inputs(case, DEVICE, requires_grad=True)
    sink = make_sink(case.num_heads)
    p = 0.2
    with poisoned_outputs():
        out, lse, s_dmask = flashtriton.flash_attn_func(q, k, v, p, causal=True, return_attn_probs=True,
                                                        learnable_sink=sink)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    keep = ~torch.signbit(s_dmask[:, :, :60, :70])
    # S_dmask's magnitudes are the keys' probabilities with the sink in the sum: with the sink's share, 1 per row
    ref_lse = attention_reference(q.detach().double(), k.detach().double(), v.detach().double(), causal=True,
                                  learnable_sink=sink.detach().double())[1].double()
    sink_share = torch.exp(sink.detach().double()[None, :, None] - ref_lse)
    row_mass = s_dmask[:, :, :60, :70].abs().double().sum(-1) + sink_share
    torch.testing.assert_close(row_mass, torch.ones_like(row_mass), rtol=0, atol=2e-2)
    checks = compare_with_reference(case, out, lse, q, k, v, None, grads, dout, dropout_p=p, dropout_mask=keep,
                                     learnable_sink=sink)
    assert_checks_ok(checks)


def test_low_level_forward_includes_the_sink_in_lse():
    q, k, v = (torch.randn(1, 30, 2, 16, device=DEVICE, dtype=torch.float16) for _ in range(3))
    sink = make_sink(2, requires_grad=False)
    _, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False, sink)
    _, plain_lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    torch.testing.assert_close(lse, torch.logaddexp(plain_lse, sink[None, :, None]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("sink,error,match", [
    (torch.zeros(3), RuntimeError, r"learnable_sink must have shape \(nheads,\) = \(4,\), got \(3,\)"),
    (torch.zeros(1, 4), RuntimeError, r"got \(1, 4\)"),
    (torch.zeros(4, dtype=torch.int32), RuntimeError, "float32, bfloat16 or float16, got torch.int32"),
    ([0.0] * 4, TypeError, "must be a tensor of shape"),
], ids=["heads", "rank", "dtype", "list"])
def test_bad_sinks_raise_before_any_launch(sink, error, match):
    q = torch.randn(1, 8, 4, 16, device=DEVICE, dtype=torch.float16)
    if isinstance(sink, torch.Tensor):
        sink = sink.to(DEVICE)
    with pytest.raises(error, match=match):
        flashtriton.flash_attn_func(q, q, q, learnable_sink=sink)
    with pytest.raises(error, match=match):
        flashtriton.flash_attn_with_kvcache(q, q, q, learnable_sink=sink)


def test_torch_compile_fullgraph_with_sinks():
    torch.compiler.reset()
    q, k, v = (torch.randn(1, 24, 2, 16, dtype=torch.float16) for _ in range(3))
    sink = torch.randn(2)
    dout = torch.randn_like(q)

    def attention(q, k, v, sink):
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=sink)
        return out, lse

    assert_compiled_matches_eager(attention, lambda: [t.clone().requires_grad_() for t in (q, k, v, sink)], dout)


def test_opcheck_forward_with_sink():
    q, k, v = (torch.randn(1, 24, 2, 16, dtype=torch.float16) for _ in range(3))
    args = (q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False, torch.randn(2))
    torch.library.opcheck(torch.ops.flashtriton._flash_attn_forward.default, args)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the Hopper kernels and long sequences run on a GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequences_gpu(head_dim, causal):
    """Shapes the Gluon Hopper forward and backward take on sm_90: the sink folds into their output."""
    case = Case(batch=2, seqlen_q=1000, seqlen_k=1000, num_heads=4, num_heads_k=2, head_dim=head_dim,
                dtype=torch.bfloat16, causal=causal)
    assert_checks_ok(run_dense(case))


def test_reference_path_and_kernels_agree():
    """On CPU both paths run the same fold (kernels/sink.py interpreted, or its PyTorch twin)."""
    from flashtriton.ops import sink as sink_ops

    out = torch.randn(2, 9, 3, 20, dtype=torch.float16)
    lse = torch.randn(2, 3, 9)
    lse[0, 1, 4] = float("inf")
    lse[1, 2, 0] = float("-inf")
    sinks = torch.randn(3)
    results = []
    for kernels in ((False, True) if backend.KERNELS_INTERPRETED else (False,)):
        o, s = out.clone(), lse.clone()
        sink_ops.fold_sink(o, s, sinks, runs_kernels=kernels)
        results.append((o, s))
        assert torch.equal(s[0, 1, 4], sinks[1]) and torch.equal(o[0, 4, 1], torch.zeros(20, dtype=o.dtype))
    for a, b in zip(results[0], results[-1]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
