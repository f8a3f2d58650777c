"""Property-based fuzzing of the public functions against the float64 reference (hypothesis).

Profiles (tests/conftest.py): `ci` (default, a few minutes through the interpreter) and `long`
(`--hypothesis-profile=long`, for a GPU or a long CPU run). Every drawn case runs forward and backward with
NaN-poisoned outputs and applies the tolerance rule of docs/api.md §4.10.
"""

import contextlib
import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flashtriton
from flashtriton import configs
from flashtriton.ops import backend, hopper
from flashtriton.reference import kvcache_reference
from flashtriton.testing import (Case, assert_checks_ok, check_error, check_lse, compare_varlen_with_reference,
                                 compare_with_reference, cu_seqlens, forced_dq_atomic, forced_heads_per_group,
                                 forced_hopper_grid, forced_tma, make_case_inputs, poisoned_outputs,
                                 unchecked_indices)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = DEVICE == "cpu"  # the interpreter is slow: keep CPU shapes small
MAX_SEQLEN = 150 if SMALL else 1100


@st.composite
def windows(draw):
    kind = draw(st.sampled_from(["none", "left", "right", "both"]))
    side = st.integers(0, 70)
    if kind == "none":
        return (-1, -1)
    if kind == "left":
        return (draw(side), -1)
    if kind == "right":
        return (-1, draw(side))
    return (draw(side), draw(side))


@st.composite
def dense_cases(draw):
    heads_k = draw(st.sampled_from([1, 2]))
    return Case(
        batch=draw(st.integers(1, 2)),
        seqlen_q=draw(st.integers(1, MAX_SEQLEN)),
        seqlen_k=draw(st.integers(1, MAX_SEQLEN)),
        num_heads=heads_k * draw(st.sampled_from([1, 2, 3])),
        num_heads_k=heads_k,
        head_dim=draw(st.sampled_from([8, 16, 24, 40, 64, 80, 128] if SMALL else [8, 40, 64, 96, 128, 192, 256])),
        dtype=draw(st.sampled_from([torch.float16] if SMALL else [torch.float16, torch.bfloat16])),
        causal=draw(st.booleans()),
        window_size=draw(windows()),
        softcap=draw(st.sampled_from([0.0, 0.0, 3.0])),
        alibi=draw(st.booleans()),
        softmax_scale=draw(st.sampled_from([None, None, 0.3])),
        layout=draw(st.sampled_from(["contiguous", "bhsd", "sliced"])),
    )


# On the CPU, half the cases force the tensor-descriptor (TMA) paths that sm90 runs by default, and half of
# the backward cases the atomic-dQ variant (on a GPU the configs decide both).
TMA_CHOICES = st.booleans() if SMALL else st.just(False)
ATOMIC_CHOICES = st.booleans() if SMALL else st.just(False)
# Launch order: the configs' groups of heads (None), or groups of 1-3 (batch, head) pairs, on every device.
GROUP_CHOICES = st.sampled_from([None, None, 1, 2, 3])


def forced_paths(tma: bool, dq_atomic: bool = False, heads_per_group=None):
    stack = contextlib.ExitStack()
    stack.enter_context(forced_tma(tma))
    if dq_atomic:
        stack.enter_context(forced_dq_atomic())
    stack.enter_context(forced_heads_per_group(heads_per_group))
    return stack


def drawn_sink(with_sink: bool, num_heads: int):
    """Learnable sinks (docs/api.md §4.11) of a drawn case, or None."""
    return (torch.randn(num_heads, device=DEVICE) * 2.0).requires_grad_() if with_sink else None


def leaves(q, k, v, sink):
    return (q, k, v) if sink is None else (q, k, v, sink)


@given(case=dense_cases(), input_scale=st.sampled_from([1.0, 4.0]), tma=TMA_CHOICES, dq_atomic=ATOMIC_CHOICES,
       heads_per_group=GROUP_CHOICES, with_sink=st.booleans())
def test_fuzz_flash_attn_func(case, input_scale, tma, dq_atomic, heads_per_group, with_sink):
    q, k, v, slopes = make_case_inputs(case, DEVICE, requires_grad=True, scale=input_scale)
    sink = drawn_sink(with_sink, case.num_heads)
    with poisoned_outputs(), forced_paths(tma, dq_atomic, heads_per_group):
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, 0.0, case.softmax_scale, case.causal, case.window_size,
                                                  case.softcap, slopes, return_attn_probs=True, learnable_sink=sink)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves(q, k, v, sink), dout)
    assert_checks_ok(compare_with_reference(case, out, lse, q, k, v, slopes, grads, dout, learnable_sink=sink))


@st.composite
def hopper_forward_cases(draw):
    """Cases in the domain of the Gluon Hopper forward (ops/hopper.covers): head dims up to 256 (those between the
    tile classes on wider tiles), 16-bit, any window (the causal one also spelled (-1, 0); local windows), no softcap
    or ALiBi, TMA-addressable layouts (rows of wider tensors too), more than DECODE_MAX_ROWS query rows."""
    heads_k = draw(st.sampled_from([1, 2]))
    causal = draw(st.booleans())
    window = (-1, 0) if causal else (-1, -1)
    if draw(st.booleans()):
        window = draw(windows())
    return Case(
        batch=draw(st.integers(1, 2)),
        seqlen_q=draw(st.integers(configs.DECODE_MAX_ROWS + 1, MAX_SEQLEN)),
        seqlen_k=draw(st.integers(1, MAX_SEQLEN)),
        num_heads=heads_k * draw(st.sampled_from([1, 2, 3])),
        num_heads_k=heads_k,
        head_dim=draw(st.sampled_from([64] if SMALL else (*configs.HOPPER_FWD_HEAD_DIMS, 40, 96, 192))),
        dtype=draw(st.sampled_from([torch.float16] if SMALL else [torch.float16, torch.bfloat16])),
        causal=causal and draw(st.booleans()),
        window_size=window,
        softmax_scale=draw(st.sampled_from([None, None, 0.3])),
        layout=draw(st.sampled_from(["contiguous", "bhsd", "wider-rows"])),
    )


ON_HOPPER = (DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
             and hopper.attn_fwd_hopper_kernel is not None and configs.GLUON_ALLOWED and configs.TMA_ALLOWED)


@given(case=hopper_forward_cases(), input_scale=st.sampled_from([1.0, 4.0]),
       programs=st.sampled_from([None, 1, 2, 5]), with_sink=st.booleans())
def test_fuzz_hopper_forward_domain(case, input_scale, programs, with_sink):
    """On sm_90 these all run the Gluon forward (asserted), with the configured grid or a few programs that each
    take many tiles, sinks folded into its output; elsewhere the same cases check the Triton kernels."""
    q, k, v, _ = make_case_inputs(case, DEVICE, requires_grad=True, scale=input_scale)
    sink = drawn_sink(with_sink, case.num_heads)
    launches = hopper.fwd_launch_count
    with poisoned_outputs(), forced_hopper_grid(programs):
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, 0.0, case.softmax_scale, case.causal, case.window_size,
                                                  return_attn_probs=True, learnable_sink=sink)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves(q, k, v, sink), dout)
    assert (hopper.fwd_launch_count > launches) == ON_HOPPER
    assert_checks_ok(compare_with_reference(case, out, lse, q, k, v, None, grads, dout, learnable_sink=sink))


@st.composite
def varlen_batches(draw):
    batch = draw(st.integers(1, 4))
    lens = st.integers(0, MAX_SEQLEN // 2)
    return [draw(lens) for _ in range(batch)], [draw(lens) for _ in range(batch)], draw(st.integers(0, 3))


@given(lengths=varlen_batches(), causal=st.booleans(), window=windows(), alibi=st.booleans(),
       heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]), head_dim=st.sampled_from([16, 40, 64]), tma=TMA_CHOICES,
       dq_atomic=ATOMIC_CHOICES, heads_per_group=GROUP_CHOICES, with_sink=st.booleans())
def test_fuzz_flash_attn_varlen_func(lengths, causal, window, alibi, heads, head_dim, tma, dq_atomic, heads_per_group,
                                     with_sink):
    lens_q, lens_k, tail = lengths
    num_heads, num_heads_k = heads
    cu_q, cu_k = cu_seqlens(lens_q, DEVICE), cu_seqlens(lens_k, DEVICE)
    q = torch.randn(sum(lens_q) + tail, num_heads, head_dim, device=DEVICE).half().requires_grad_()
    k = torch.randn(sum(lens_k) + tail, num_heads_k, head_dim, device=DEVICE).half().requires_grad_()
    v = torch.randn_like(k).requires_grad_()
    slopes = torch.rand(len(lens_q), num_heads, device=DEVICE) * 0.3 if alibi else None
    max_q, max_k = max(lens_q) + 1, max(lens_k) + 1
    sink = drawn_sink(with_sink, num_heads)
    with poisoned_outputs(), forced_paths(tma, dq_atomic, heads_per_group):
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                                         window_size=window, alibi_slopes=slopes,
                                                         return_attn_probs=True, learnable_sink=sink)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves(q, k, v, sink), dout, allow_unused=True)
    covered_q, covered_k = sum(lens_q), sum(lens_k)
    with_grads = covered_q > 0 and covered_k > 0  # otherwise no output depends on the inputs
    checks = compare_varlen_with_reference(out, lse, q, k, v, cu_q.cpu(), cu_k.cpu(), max_k,
                                           grads if with_grads else None, dout, causal=causal, window_size=window,
                                           alibi_slopes=slopes, learnable_sink=sink)
    assert_checks_ok(checks)
    assert torch.all(out[covered_q:] == 0) and all(torch.all(g[n:] == 0) for g, n in
                                                   zip(grads, (covered_q, covered_k, covered_k)))


@given(batch=st.integers(1, 3), seqlen_q=st.integers(1, 6), seqlen_new=st.integers(0, 4),
       capacity=st.integers(8, 120), page_size=st.sampled_from([0, 0, 7, 16, 33]), causal=st.booleans(),
       window=windows(), splits=st.sampled_from([0, 1, 2, 5]), rotary=st.booleans(), leftpad=st.booleans(),
       tma=TMA_CHOICES, heads_per_group=GROUP_CHOICES)
def test_fuzz_flash_attn_with_kvcache(batch, seqlen_q, seqlen_new, capacity, page_size, causal, window, splits,
                                      rotary, leftpad, tma, heads_per_group):
    capacity = max(capacity, seqlen_new)
    if page_size:  # the block table addresses whole pages
        capacity = -(-capacity // page_size) * page_size
    lengths = torch.randint(0, capacity - seqlen_new + 1, (batch,), device=DEVICE).to(torch.int32)
    inputs = dict(cache_seqlens=lengths)
    if page_size:
        pages = capacity // page_size
        inputs["block_table"] = torch.randperm(batch * pages + 1, device=DEVICE)[: batch * pages].view(
            batch, pages).to(torch.int32)
        cache_shape = (batch * pages + 1, page_size, 2, 32)
    else:
        cache_shape = (batch, capacity, 2, 32)
        if leftpad:
            inputs["cache_leftpad"] = torch.minimum(torch.randint(0, 5, (batch,), device=DEVICE).to(torch.int32),
                                                    lengths)
    q = torch.randn(batch, seqlen_q, 4, 32, device=DEVICE).half()
    k_cache, v_cache = torch.randn(cache_shape, device=DEVICE).half(), torch.randn(cache_shape, device=DEVICE).half()
    if seqlen_new:
        inputs["k"] = torch.randn(batch, seqlen_new, 2, 32, device=DEVICE).half()
        inputs["v"] = torch.randn_like(inputs["k"])
        if rotary:
            angles = torch.rand(capacity + 3, 8, device=DEVICE) * 6.28
            inputs["rotary_cos"], inputs["rotary_sin"] = angles.cos().half(), angles.sin().half()
    options = dict(causal=causal, window_size=window)
    ref, ref_lse, ref_k, ref_v = kvcache_reference(q, k_cache, v_cache, **inputs, **options)
    pt = kvcache_reference(q, k_cache, v_cache, **inputs, **options, compute_dtype=None)[0]
    with poisoned_outputs(), forced_paths(tma, heads_per_group=heads_per_group):
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs, **options, num_splits=splits,
                                                       return_softmax_lse=True)
    assert_checks_ok([check_error("out", out, ref, pt, factor=3.0), check_lse(lse, ref_lse)])
    assert torch.equal(v_cache, ref_v)


def _assert_same(results, expected, deterministic=True):
    """(out, lse, dq, dk, dv) of two calls bitwise equal; with deterministic=False dQ only up to the rounding of the
    same fp32 sums in another order (the backward adds each key block's dQ with atomics as the blocks finish)."""
    for position, (got, want) in enumerate(zip(results, expected)):
        if position == 2 and not deterministic:
            scale = float(want.abs().max()) if want.numel() else 0.0
            torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3 * scale)
        else:
            assert torch.equal(got, want), position


def _attention_with_grads(fn, leaves, dout, **options):
    out, lse, _ = fn(*leaves, return_attn_probs=True, **options)
    return (out, lse, *torch.autograd.grad(out, leaves, dout))


@given(case=dense_cases(), self_attention=st.booleans(), deterministic=st.booleans())
def test_fuzz_packed_variants_match_separate(case, self_attention, deterministic):
    """flash_attn_kvpacked_func (and qkvpacked_func for self-attention shapes) on packed views give the separate
    call's outputs and gradients bitwise: the packed wrappers pass every option through and pack the gradients."""
    if self_attention:
        case = dataclasses.replace(case, seqlen_k=case.seqlen_q, num_heads_k=case.num_heads)
    q, k, v, slopes = make_case_inputs(case, DEVICE)
    options = dict(softmax_scale=case.softmax_scale, causal=case.causal, window_size=case.window_size,
                   softcap=case.softcap, alibi_slopes=slopes, deterministic=deterministic)
    dout = torch.randn_like(q)
    kv = torch.stack((k, v), dim=2).requires_grad_()
    separate = [t.detach().requires_grad_() for t in (q, kv[:, :, 0], kv[:, :, 1])]
    expected = _attention_with_grads(flashtriton.flash_attn_func, separate, dout, **options)
    q_leaf = q.detach().requires_grad_()
    out, lse, dq, dkv = _attention_with_grads(flashtriton.flash_attn_kvpacked_func, (q_leaf, kv), dout, **options)
    _assert_same((out, lse, dq, *dkv.unbind(dim=2)), expected, deterministic)
    if self_attention:
        # against the separate call on qkv's own views: q's layout decides which kernel runs (a sliced q that TMA
        # cannot address takes the Triton kernels on sm_90, qkv's views the Gluon ones), and two kernels need not
        # agree bitwise
        qkv = torch.stack((q, k, v), dim=2).requires_grad_()
        views = [qkv.detach()[:, :, i].requires_grad_() for i in range(3)]
        expected = _attention_with_grads(flashtriton.flash_attn_func, views, dout, **options)
        out, lse, dqkv = _attention_with_grads(flashtriton.flash_attn_qkvpacked_func, (qkv,), dout, **options)
        _assert_same((out, lse, *dqkv.unbind(dim=2)), expected, deterministic)


@given(lengths=varlen_batches(), causal=st.booleans(), window=windows(), heads_k=st.sampled_from([1, 2]),
       self_attention=st.booleans(), deterministic=st.booleans())
def test_fuzz_varlen_packed_variants_match_separate(lengths, causal, window, heads_k, self_attention, deterministic):
    """The varlen kvpacked / qkvpacked forms against flash_attn_varlen_func on the same views, bitwise."""
    lens_q, lens_k, tail = lengths
    if self_attention:
        lens_k = lens_q
    num_heads = heads_k if self_attention else 2 * heads_k
    cu_q = cu_seqlens(lens_q, DEVICE)
    cu_k = cu_q if self_attention else cu_seqlens(lens_k, DEVICE)
    max_q, max_k = max(lens_q) + 1, max(lens_k) + 1
    q = torch.randn(sum(lens_q) + tail, num_heads, 32, device=DEVICE).half()
    kv = torch.randn(sum(lens_k) + tail, 2, heads_k, 32, device=DEVICE).half().requires_grad_()
    dout = torch.randn_like(q)
    options = dict(causal=causal, window_size=window, deterministic=deterministic)
    seqlens = (cu_q, cu_k, max_q, max_k)
    separate = [t.detach().requires_grad_() for t in (q, kv[:, 0], kv[:, 1])]
    expected = _attention_with_grads(lambda *t, **o: flashtriton.flash_attn_varlen_func(*t, *seqlens, **o),
                                     separate, dout, **options)
    packed = _attention_with_grads(lambda *t, **o: flashtriton.flash_attn_varlen_kvpacked_func(*t, *seqlens, **o),
                                   (q.detach().requires_grad_(), kv), dout, **options)
    _assert_same((*packed[:3], *packed[3].unbind(dim=1)), expected, deterministic)
    if self_attention:
        qkv = torch.stack((q, kv[:, 0].detach(), kv[:, 1].detach()), dim=1).requires_grad_()
        packed = _attention_with_grads(lambda t, **o: flashtriton.flash_attn_varlen_qkvpacked_func(t, cu_q, max_q, **o),
                                       (qkv,), dout, **options)
        _assert_same((*packed[:2], *packed[2].unbind(dim=1)), expected, deterministic)


@pytest.mark.skipif(DEVICE == "cpu" and not backend.KERNELS_INTERPRETED,
                    reason="malformed index values reach kernels only (the CPU reference path needs valid ones)")
@given(batch=st.integers(1, 3), cache_rows=st.integers(1, 3), seqlen_q=st.integers(1, 3), seqlen_new=st.integers(0, 3),
       capacity=st.integers(8, 40), causal=st.booleans(), data=st.data())
def test_fuzz_kvcache_malformed_indices(batch, cache_rows, seqlen_q, seqlen_new, capacity, causal, data):
    """Malformed cache_batch_idx and cache_seqlens reach the kernels unchecked (testing.unchecked_indices, as on a GPU
    outside strict mode; docs/api.md §6): appends outside the cache are dropped, a row whose cache row is out of range
    sees no key, and the others attend to their keys clamped into the cache."""
    batch_idx = data.draw(st.lists(st.integers(-2, cache_rows + 1), min_size=batch, max_size=batch))
    seqlens = data.draw(st.lists(st.integers(-4, capacity + 4), min_size=batch, max_size=batch))
    rows_used = set()
    for b, row in enumerate(batch_idx):  # one batch row per cache row: two appends into one row would race
        if row in rows_used:
            batch_idx[b] = cache_rows
        rows_used.add(batch_idx[b])
    q = torch.randn(batch, seqlen_q, 4, 32, device=DEVICE).half()
    k_cache = torch.randn(cache_rows, capacity, 2, 32, device=DEVICE).half()
    v_cache = torch.randn_like(k_cache)
    k_new = torch.randn(batch, seqlen_new, 2, 32, device=DEVICE).half()
    v_new = torch.randn_like(k_new)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, (row, start) in enumerate(zip(batch_idx, seqlens)):
        for t in range(seqlen_new):
            if 0 <= row < cache_rows and 0 <= start + t < capacity:
                expected_k[row, start + t], expected_v[row, start + t] = k_new[b, t], v_new[b, t]
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    with poisoned_outputs(), unchecked_indices():
        out, lse = flashtriton.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new if seqlen_new else None, v_new if seqlen_new else None,
            cache_seqlens=as_int32(seqlens), cache_batch_idx=as_int32(batch_idx), causal=causal,
            return_softmax_lse=True)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    for b, (row, start) in enumerate(zip(batch_idx, seqlens)):
        if not 0 <= row < cache_rows:
            assert torch.equal(out[b], torch.zeros_like(out[b])) and bool(torch.isposinf(lse[b]).all())
            continue
        keys = as_int32([min(max(start + seqlen_new, 0), capacity)])
        rows = (q[b:b + 1], k_cache[row:row + 1], v_cache[row:row + 1])
        ref, ref_lse, _, _ = kvcache_reference(*rows, cache_seqlens=keys, causal=causal)
        pt = kvcache_reference(*rows, cache_seqlens=keys, causal=causal, compute_dtype=None)[0]
        assert_checks_ok([check_error("out", out[b:b + 1], ref, pt, factor=3.0), check_lse(lse[b:b + 1], ref_lse)],
                         f"row {b}")
