"""Variable-length attention (flash_attn_varlen_*) against the per-sequence float64 reference."""

import pytest
import torch

import flashtriton
from flashtriton.flash_attn_interface import _flash_attn_varlen_backward, _flash_attn_varlen_forward
from flashtriton.ops import backend
from flashtriton.testing import (assert_checks_ok, compare_varlen_with_reference, cu_seqlens, forced_gluon,
                                 poisoned_outputs)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


def cumulative(lengths):
    return cu_seqlens(lengths, DEVICE)


def make_varlen(lens_q, lens_k, num_heads=4, num_heads_k=2, head_dim=32, dtype=torch.float16, tail=3):
    """q (Tq, H, D), k, v (Tk, Hk, D) with `tail` rows past the last sequence (uncovered rows)."""
    total_q, total_k = sum(lens_q) + tail, sum(lens_k) + tail
    q = torch.randn(total_q, num_heads, head_dim, device=DEVICE).to(dtype).requires_grad_()
    k = torch.randn(total_k, num_heads_k, head_dim, device=DEVICE).to(dtype).requires_grad_()
    v = torch.randn(total_k, num_heads_k, head_dim, device=DEVICE).to(dtype).requires_grad_()
    return q, k, v, cumulative(lens_q), cumulative(lens_k)


def reference_checks(q, k, v, cu_q, cu_k, max_seqlen_k, out, lse, grads, dout, **options):
    """Tolerance-rule checks of out, lse and (dq, dk, dv unless grads is None) on every row; rows past the
    last sequence must be exactly 0 (lse +inf)."""
    checks = compare_varlen_with_reference(out, lse, q, k, v, cu_q.cpu(), cu_k.cpu(), max_seqlen_k, grads, dout,
                                           **options)
    covered_q, covered_k = int(cu_q[-1]), int(cu_k[-1])
    for name, tensor, covered in zip(("out", "dq", "dk", "dv"), (out, *(grads or ())),
                                     (covered_q, covered_q, covered_k, covered_k)):
        assert torch.all(tensor[covered:] == 0), f"{name}: uncovered rows must be zero"
    assert torch.all(lse[:, covered_q:] == float("inf")), "lse: uncovered rows must be +inf"
    assert_checks_ok(checks)


LENGTH_MIXES = {
    "with-empty-and-one": ([5, 0, 70, 33, 1], [9, 12, 0, 80, 40]),
    "q-longer": ([130, 7, 64], [40, 7, 3]),
    "k-longer": ([17, 1, 90], [150, 65, 91]),
    "single": ([97], [97]),
}
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(9, 4)),
    "causal-window-alibi": dict(causal=True, window_size=(12, -1), alibi=True),
    "softcap-alibi-batch": dict(softcap=3.0, alibi="batch"),
    "bf16-scale": dict(dtype=torch.bfloat16, softmax_scale=0.25),
}


def _alibi(kind, batch, num_heads):
    if kind == "batch":
        return torch.rand(batch, num_heads, device=DEVICE) * 0.4
    return torch.rand(num_heads, device=DEVICE) * 0.4 if kind else None


@pytest.mark.parametrize("option", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("mix", list(LENGTH_MIXES), ids=list(LENGTH_MIXES))
def test_varlen_matches_reference(mix, option):
    lens_q, lens_k = LENGTH_MIXES[mix]
    opts = dict(OPTIONS[option])
    dtype = opts.pop("dtype", torch.float16)
    slopes = _alibi(opts.pop("alibi", None), len(lens_q), 4)
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, dtype=dtype)
    max_q, max_k = max(lens_q) + 5, max(lens_k) + 3  # upper bounds, not the true maxima
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes=slopes,
                                                         return_attn_probs=True, **opts)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert lse.shape == (4, q.shape[0])
    reference_checks(q, k, v, cu_q, cu_k, max_k, out, lse, grads, dout, alibi_slopes=slopes, **opts)


@pytest.mark.parametrize("mix,option", [("with-empty-and-one", "causal-window-alibi"), ("k-longer", "plain")])
def test_varlen_through_tensor_descriptors(force_tma, mix, option):
    """In-kernel descriptors bound to each sequence: rows past it read as zeros and are never written."""
    test_varlen_matches_reference(mix, option)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_in_neighbouring_sequences_stays_there(tma, causal):
    """Sequences are independent: NaN in every row of the sequences before and after one (and in the uncovered
    tail) leaves its output, LSE and gradients bitwise unchanged. Tiles read past their sequence's end into
    the next one (packed descriptors do), so this is what keeps 0 * NaN out of P.V."""
    from flashtriton.testing import forced_tma

    lens_q, lens_k = [20, 70, 9], [33, 80, 17]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k)
    middle_q = slice(lens_q[0], lens_q[0] + lens_q[1])
    middle_k = slice(lens_k[0], lens_k[0] + lens_k[1])
    dout = torch.randn_like(q)

    def run(q, k, v):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with forced_tma(tma):
            out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                             causal=causal, return_attn_probs=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        return out[middle_q], lse[:, middle_q], grads[0][middle_q], grads[1][middle_k], grads[2][middle_k]

    clean = run(q, k, v)
    poisoned = []
    for t, middle in ((q, middle_q), (k, middle_k), (v, middle_k)):
        t = t.detach().clone()
        keep = t[middle].clone()
        t.fill_(float("nan"))
        t[middle] = keep
        poisoned.append(t)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), clean, run(*poisoned)):
        assert torch.equal(a, b), f"{name} of the middle sequence changed with NaN in its neighbours"


def test_varlen_backward_with_atomic_dq(force_dq_atomic):
    """dQ by atomics into the packed (total, H, D) accumulator: per-sequence rows, uncovered rows 0."""
    test_varlen_matches_reference("with-empty-and-one", "causal-window-alibi")


def test_varlen_equals_dense_on_equal_lengths():
    """The Triton kernels' varlen forward is their dense forward on per-sequence bounds: bitwise equal on equal
    lengths (both calls kept off the Gluon Hopper kernel, whose varlen tiles may cut the work otherwise)."""
    batch, seqlen = 3, 75
    q = torch.randn(batch, seqlen, 4, 64, device=DEVICE, dtype=torch.float16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    cu = cumulative([seqlen] * batch)
    with forced_gluon(False):
        dense = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        varlen = flashtriton.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu,
                                                    seqlen, seqlen, causal=True, return_attn_probs=True)
    assert torch.equal(varlen[0], dense[0].flatten(0, 1))
    assert torch.equal(varlen[1], dense[1].transpose(0, 1).flatten(1))


def test_varlen_packed_variants_match():
    lens = [40, 0, 67]
    cu = cumulative(lens)
    qkv = torch.randn(sum(lens), 3, 4, 32, device=DEVICE, dtype=torch.float16, requires_grad=True)
    dout = torch.randn(sum(lens), 4, 32, device=DEVICE, dtype=torch.float16)
    out_packed = flashtriton.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    (dqkv,) = torch.autograd.grad(out_packed, (qkv,), dout)
    q, k, v = (qkv[:, i].detach().clone().requires_grad_() for i in range(3))
    out = flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.equal(out_packed, out) and torch.equal(dqkv, torch.stack(grads, dim=1))

    kv = torch.stack((k, v), dim=1).detach().requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    out_kv = flashtriton.flash_attn_varlen_kvpacked_func(q2, kv, cu, cu, max(lens), max(lens), causal=True)
    dq, dkv = torch.autograd.grad(out_kv, (q2, kv), dout)
    assert torch.equal(out_kv, out)
    assert torch.equal(dq, grads[0]) and torch.equal(dkv, torch.stack(grads[1:], dim=1))


@pytest.mark.parametrize("page_size", [16, 48, 7])
def test_paged_kv_forward(page_size):
    lens_q, lens_k = [3, 20, 0, 9], [50, 20, 11, 97]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, tail=0)
    max_pages = -(-max(lens_k) // page_size)
    num_pages = len(lens_k) * max_pages + 2
    order = torch.randperm(num_pages, device=DEVICE)[: len(lens_k) * max_pages].view(len(lens_k), max_pages)
    block_table = order.to(torch.int32)
    k_cache = torch.randn(num_pages, page_size, *k.shape[1:], device=DEVICE, dtype=k.dtype)
    v_cache = torch.randn_like(k_cache)
    for b, length in enumerate(lens_k):  # scatter each sequence's keys into its pages
        positions = torch.arange(length, device=DEVICE)
        pages = block_table[b, positions // page_size].long()
        k_cache[pages, positions % page_size] = k.detach()[int(cu_k[b]):int(cu_k[b]) + length]
        v_cache[pages, positions % page_size] = v.detach()[int(cu_k[b]):int(cu_k[b]) + length]
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_varlen_func(q.detach(), k_cache, v_cache, cu_q, cu_k, max(lens_q),
                                                         max(lens_k), causal=True, block_table=block_table,
                                                         return_attn_probs=True)
    # paged key tiles may be smaller than contiguous ones (one page lookup per tile), so compare with the reference
    reference_checks(q, k, v, cu_q, cu_k, max(lens_k), out, lse, None, None, causal=True)

    paged = flashtriton.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k),
                                               block_table=block_table)
    with pytest.raises(RuntimeError, match="block_table"):
        paged.sum().backward()


def test_seqused_and_leftpad_low_level():
    lens_q, slots = [6, 30], [50, 40]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, slots, tail=0)
    seqused = torch.tensor([37, 40], dtype=torch.int32, device=DEVICE)
    leftpad = torch.tensor([5, 0], dtype=torch.int32, device=DEVICE)
    out, lse, _, _ = _flash_attn_varlen_forward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, max(lens_q),
                                                max(slots), 0.0, 0.125, True, leftpad_k=leftpad, seqused_k=seqused)
    # The same keys laid out explicitly: sequence b keeps slot rows [leftpad, seqused).
    keep = torch.cat([torch.arange(int(cu_k[b]) + int(leftpad[b]), int(cu_k[b]) + int(seqused[b]))
                      for b in range(2)]).to(DEVICE)
    cu_kept = cumulative((seqused - leftpad).tolist())
    expected, expected_lse, _, _ = _flash_attn_varlen_forward(q.detach(), k.detach()[keep], v.detach()[keep], cu_q,
                                                              cu_kept, max(lens_q), max(slots), 0.0, 0.125, True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)


def test_varlen_deterministic_repeats_are_bitwise_equal(force_dq_atomic):
    """deterministic=True gives bitwise-equal outputs and gradients, even where the config asks for atomic dQ."""
    lens_q, lens_k = [40, 0, 75], [30, 9, 75]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k)
    dout = torch.randn(q.shape, device=DEVICE, dtype=q.dtype)
    results = []
    for _ in range(3):
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                         deterministic=True, return_attn_probs=True)
        results.append((out, lse, *torch.autograd.grad(out, (q, k, v), dout)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_low_level_backward_softmax_d():
    """softmax_d (H, Tq + 128 B): rowsum(dout * out) on covered rows, 0 on the rows past the last sequence and
    on the padding. Found by initcheck: the rows past the last sequence were copied from unwritten memory."""
    lens_q, lens_k = [5, 0, 70], [9, 4, 66]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, tail=3)
    q, k, v = q.detach(), k.detach(), v.detach()
    with poisoned_outputs():
        out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), 0.0, 0.2, True)
        dout = torch.randn_like(out)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        softmax_d = _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max(lens_q),
                                                max(lens_k), 0.0, 0.2, True, -1, 0, 0.0, None, False)
    covered = int(cu_q[-1])
    total_q = q.shape[0]
    assert softmax_d.shape == (q.shape[1], total_q + 128 * len(lens_q))
    rowsum = (dout.float() * out.float()).sum(-1).t()
    torch.testing.assert_close(softmax_d[:, :covered], rowsum[:, :covered])
    assert torch.equal(softmax_d[:, covered:], torch.zeros_like(softmax_d[:, covered:]))


def test_seqused_and_leftpad_through_tensor_descriptors(force_tma):
    test_seqused_and_leftpad_low_level()


@pytest.mark.skipif(ON_GPU or not backend.KERNELS_INTERPRETED, reason="records the interpreter's launches")
def test_new_lengths_keep_the_compiled_kernels_cache_key(monkeypatch):
    """The CPU counterpart of test_new_lengths_do_not_recompile: each launch's arguments go through Triton's own
    binder for an sm_90 target (the specialization a compiled launch gets), and the cache key it yields is the same
    for new lengths, batch sizes, split counts, window sizes and softcap values, dense, varlen and kv-cache, forward
    and backward, and for new total
    rows of the packed tensors and cache rows (the kernels' row bounds, kernels/common.sequence_bounds)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    cuda = make_backend(GPUTarget("cuda", 90, 32))
    keys = {}

    def record(name):
        interpreted = getattr(backend, name)
        jit = JITFunction(interpreted.fn, **{option: interpreted.kwargs[option] for option in (
            "do_not_specialize", "do_not_specialize_on_alignment") if option in interpreted.kwargs})
        binder = create_function_from_signature(jit.signature, jit.params, cuda)

        class Recorder:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    _, specialization, options = binder(*args, **kwargs)
                    keys.setdefault(name, set()).add(compute_cache_key({}, specialization, options))
                    return interpreted[grid](*args, **kwargs)
                return launch
        monkeypatch.setattr(backend, name, Recorder())

    for name in ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
        record(name)
    for lens_q, lens_k, dense_len, batch, cache_len, window, softcap in (
            ([20, 7], [24, 9], 17, 2, 40, (5, 3), 2.0), ([1, 32], [48, 3], 32, 3, 64, (40, 1), 7.5),
            ([20, 12], [31, 1], 40, 2, 24, (2, 17), 30.0)):
        q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, head_dim=16)
        out = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
        out.sum().backward()
        qd = torch.randn(batch, dense_len, 2, 16, dtype=torch.float16, requires_grad=True)
        flashtriton.flash_attn_func(qd, qd, qd, window_size=window, softcap=softcap).sum().backward()
        cache = torch.randn(batch, cache_len, 2, 16, dtype=torch.float16)
        flashtriton.flash_attn_with_kvcache(qd[:, :1].detach(), cache, cache.clone(),
                                            cache_seqlens=torch.full((batch,), cache_len // 2, dtype=torch.int32),
                                            causal=True, num_splits=batch)
        # a cache with more rows than the batch (cache_batch_idx): the kernel's cache-row bound changes
        rows = torch.randn(batch + len(lens_q), cache_len, 2, 16, dtype=torch.float16)
        flashtriton.flash_attn_with_kvcache(qd[:, :1].detach(), rows, rows.clone(),
                                            cache_seqlens=torch.full((batch,), cache_len // 2, dtype=torch.int32),
                                            cache_batch_idx=torch.arange(batch, dtype=torch.int32), num_splits=1)
    # one key per path and kernel: dense, varlen, the kv-cache's split launch and the cache_batch_idx launch share
    # none of them
    assert {name: len(found) for name, found in keys.items()} == {
        "attn_fwd_kernel": 4, "attn_bwd_dkdv_kernel": 2, "attn_bwd_dq_kernel": 2}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compilation counting needs compiled kernels")
def test_new_lengths_do_not_recompile():
    from flashtriton.kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
    from flashtriton.kernels.fwd import attn_fwd_kernel
    from flashtriton.ops.hopper import attn_bwd_hopper_kernel, attn_fwd_hopper_kernel

    # on sm_90 the calls below run the Gluon kernels (the backward's softcap included)
    kernels = [fn for fn in (attn_fwd_kernel, attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_fwd_hopper_kernel,
                             attn_bwd_hopper_kernel) if fn]

    def compiled_count():
        return sum(len(cache[0]) for fn in kernels for cache in fn.device_caches.values())

    def run(lens_q, lens_k, dense_len, batch, window, softcap):
        """Lengths above configs.DECODE_MAX_ROWS: a query of <= 16 rows uses decode tiles (a different kernel).
        Windows keep window_right > 0 (0 would be causal-like: other tiles, a different kernel by design)."""
        q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, head_dim=64)
        out = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
        out.sum().backward()
        flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), window_size=window,
                                           softcap=softcap).sum().backward()
        qd = torch.randn(batch, dense_len, 4, 64, device=DEVICE, dtype=torch.float16, requires_grad=True)
        flashtriton.flash_attn_func(qd, qd, qd, causal=True).sum().backward()
        flashtriton.flash_attn_func(qd, qd, qd, window_size=window, softcap=softcap).sum().backward()

    run([100, 37], [120, 99], 128, 2, (32, 8), 5.0)
    before = compiled_count()
    run([1, 513, 77], [1000, 3, 129], 17, 5, (300, 1), 30.0)
    run([2049], [4097], 333, 1, (7, 700), 0.5)
    assert compiled_count() == before


@pytest.mark.parametrize("path", ["kernels", "reference"])
@pytest.mark.parametrize("zero_tensors", [False, True], ids=["default", "zero_tensors"])
def test_uncovered_lse_rows_agree_between_cpu_paths(monkeypatch, path, zero_tensors):
    """Rows past cu_seqlens_q[-1]: LSE -inf with zero_tensors=True (FA2's fill), else +inf, on every path."""
    from flashtriton.flash_attn_interface import _flash_attn_varlen_forward
    from flashtriton.ops import backend

    if path == "kernels" and not backend.KERNELS_INTERPRETED and DEVICE == "cpu":
        pytest.skip("the kernels run on CPU tensors only through the interpreter")
    if path == "reference":
        if DEVICE != "cpu":
            pytest.skip("the reference path takes CPU tensors")
        monkeypatch.setattr(backend, "KERNELS_INTERPRETED", False)
    q, k, v, cu_q, cu_k = make_varlen([3, 5], [4, 2], tail=3)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 5, 4, 0.0, 0.25, False,
                                                zero_tensors=zero_tensors)
    fill = float("-inf") if zero_tensors else float("inf")
    assert torch.all(lse[:, 8:] == fill)
    assert torch.isfinite(lse[:, :8]).all()
    assert torch.all(out[8:] == 0)
