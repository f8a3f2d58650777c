"""Edge values on every device (interpreter-sized shapes on a CPU): NaN and inf inputs stay in the rows that read
them, large logits stay finite and accurate, NaN outside the valid cache or the packed sequences is never read, empty
key ranges give zero gradients."""

import pytest
import torch

import flashtriton
from flashtriton.reference import attention_reference, attention_reference_varlen, kvcache_reference
from flashtriton.testing import (Case, assert_checks_ok, check_error, check_lse, compare_with_reference, cu_seqlens,
                                 poisoned_outputs)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kvcache_checks(out, lse, ref_out, ref_lse, pt_out, factor=3.0):
    """The kv-cache tolerance rule (docs/api.md §4.10: 3x PyTorch's own error + 1e-5) and the LSE check."""
    return [check_error("out", out, ref_out, pt_out, factor=factor), check_lse(lse, ref_lse)]



def test_nan_query_row_stays_in_its_row():
    """A NaN query row gives a NaN output row (never a silent 0 or a finite guess) and a non-finite LSE (+inf,
    as upstream FA2, whose epilogue treats a NaN row sum like an empty row); every other (batch, row, head) is
    finite and matches the reference, in forward and in dq; other heads' and batch entries' dk/dv are unaffected."""
    q = torch.randn(2, 64, 2, 32, device=DEVICE).half()
    k, v = (torch.randn(2, 50, 2, 32, device=DEVICE).half() for _ in range(2))
    q_nan = q.clone()
    q_nan[0, 5, 1] = float("nan")
    q_nan.requires_grad_()
    k.requires_grad_(), v.requires_grad_()
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(q_nan, k, v, return_attn_probs=True)
        dout = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q_nan, k, v), dout)
    assert torch.isnan(out[0, 5, 1]).all(), "the NaN query row must give a NaN output row"
    assert not torch.isfinite(lse[0, 1, 5]), "the NaN query row must not get a finite LSE"
    clean = torch.ones(out.shape[:3], dtype=torch.bool, device=DEVICE)
    clean[0, 5, 1] = False
    assert torch.isfinite(out[clean]).all() and torch.isfinite(lse.transpose(1, 2)[clean]).all()
    # Every other row's reference does not depend on the NaN row, so the reference runs on the clean q.
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    inputs_pt = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        ref_out, ref_lse = attention_reference(*inputs64)
        pt_out, _ = attention_reference(*inputs_pt, compute_dtype=None)
        ref_grads = torch.autograd.grad(ref_out, inputs64, dout.double())
        pt_grads = torch.autograd.grad(pt_out, inputs_pt, dout)
    other = (slice(1, 2),)  # batch entry 1, and head 0 of entry 0 (its own kv head)
    head0 = (slice(0, 1), slice(None), slice(0, 1))
    checks = [check_error("out", out[clean], ref_out[clean], pt_out[clean]),
              check_lse(lse.transpose(1, 2)[clean], ref_lse.transpose(1, 2)[clean]),
              check_error("dq", dq[clean], ref_grads[0][clean], pt_grads[0][clean], factor=3.0, atol=1e-4)]
    for name, g, rg, pg in zip(("dk", "dv"), (dk, dv), ref_grads[1:], pt_grads[1:]):
        for part in (other, head0):
            checks.append(check_error(name, g[part], rg[part], pg[part], factor=3.0, atol=1e-4))
    assert_checks_ok(checks)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_nan_query_in_kvcache_decode_stays_in_its_row(num_splits):
    """Decode: a NaN query head stays in that head; the merge of the splits must not spread it to other heads or
    rows. Unsplit, its output is NaN. Split, each split's NaN row sum reads as "no key" (LSE -inf, as upstream
    FA2's split path does too), so the merge yields 0 and LSE +inf; either NaN or that 0 is accepted there."""
    q = torch.randn(3, 1, 4, 32, device=DEVICE).half()
    k_cache, v_cache = (torch.randn(3, 100, 2, 32, device=DEVICE).half() for _ in range(2))
    seqlens = torch.tensor([90, 37, 64], dtype=torch.int32, device=DEVICE)
    q_nan = q.clone()
    q_nan[1, 0, 2] = float("nan")
    with poisoned_outputs():
        out, lse = flashtriton.flash_attn_with_kvcache(q_nan, k_cache, v_cache, cache_seqlens=seqlens,
                                                       num_splits=num_splits, return_softmax_lse=True)
    row = out[1, 0, 2]
    if num_splits == 1:
        assert torch.isnan(row).all(), "the NaN query head must give a NaN output"
    else:
        assert torch.isnan(row).all() or torch.all(row == 0), f"NaN query head gave finite garbage {row}"
    assert not torch.isfinite(lse[1, 2, 0])
    clean = torch.ones(3, 1, 4, dtype=torch.bool, device=DEVICE)
    clean[1, 0, 2] = False
    ref_out, ref_lse, _, _ = kvcache_reference(q, k_cache, v_cache, cache_seqlens=seqlens)
    pt_out = kvcache_reference(q, k_cache, v_cache, cache_seqlens=seqlens, compute_dtype=None)[0]
    assert_checks_ok([check_error("out", out[clean], ref_out[clean], pt_out[clean], factor=3.0),
               check_lse(lse.transpose(1, 2)[clean], ref_lse.transpose(1, 2)[clean])])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf in the interpreter
def test_inf_key_reaches_only_the_rows_that_see_it():
    """k[0, 40, 0, 7] = +inf under a causal mask (Sq = Sk = 64): rows before 40 never see key 40 and must match
    the reference exactly as if it were finite; rows that see it get +-inf scores (the reference is then NaN or
    finite, and the kernel must agree on which); other heads and batch entries are untouched."""
    q, k, v = (torch.randn(2, 64, 2, 32, device=DEVICE).half() for _ in range(3))
    k[0, 40, 0, 7] = float("inf")
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    pt_out, _ = attention_reference(q, k, v, causal=True, compute_dtype=None)
    defined = torch.isfinite(ref_out.double()).all(-1)  # (B, S, H): rows with a well-defined exact result
    assert not defined[0, 40:, 0].all(), "the test needs some rows where the +inf score is positive"
    assert defined[0, :40].all() and defined[1].all() and defined[:, :, 1].all()
    assert (~torch.isfinite(out[~defined])).all(), "rows whose exact result is NaN must not come out finite"
    checks = [check_error("out", out[defined], ref_out[defined], pt_out[defined]),
              check_lse(lse.transpose(1, 2)[defined], ref_lse.transpose(1, 2)[defined])]
    assert_checks_ok(checks)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_large_logits_stay_finite_and_accurate(dtype):
    """q scaled by 50 (logits of magnitude ~100, far beyond exp's fp32 range before max subtraction): out, lse
    and all gradients are finite and pass the tolerance rule; lengths are off the block sizes."""
    case = Case(batch=1, seqlen_q=50, seqlen_k=70, num_heads=2, num_heads_k=1, head_dim=64, dtype=dtype, causal=True)
    q = (torch.randn(1, 50, 2, 64, device=DEVICE) * 50).to(dtype).requires_grad_()
    k, v = (torch.randn(1, 70, 1, 64, device=DEVICE).to(dtype).requires_grad_() for _ in range(2))
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert float(lse.detach().abs().max()) > 50, "the logits are not large: the test lost its point"
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert torch.isfinite(t).all(), f"{name} is not finite"
    assert_checks_ok(compare_with_reference(case, out, lse, q, k, v, None, grads=grads, dout=dout))


GARBAGE_LAYOUTS = ["contiguous-batch-idx", "leftpad", "paged"]


@pytest.mark.parametrize("layout", GARBAGE_LAYOUTS)
def test_nan_outside_the_valid_cache_is_never_read(layout):
    """Real caches hold garbage past cache_seqlens, before cache_leftpad, in unused rows and in unused pages.
    Fill all of that with NaN: decode + append (split-KV) must match the reference, which never looks there."""
    batch, capacity, heads, heads_k, dim, page = 3, 150, 4, 2, 32, 16
    lengths = torch.tensor([0, 77, 148], dtype=torch.int32, device=DEVICE)  # + 1 appended; row 2 ends at 149
    q = torch.randn(batch, 2, heads, dim, device=DEVICE).half()
    k_new, v_new = (torch.randn(batch, 1, heads_k, dim, device=DEVICE).half() for _ in range(2))
    inputs = dict(cache_seqlens=lengths)
    positions = torch.arange(capacity, device=DEVICE)
    valid_end = lengths.long() + 1
    if layout == "paged":
        pages_per_row = -(-capacity // page)
        num_pages = batch * pages_per_row + 4
        table = torch.randperm(num_pages, device=DEVICE)[: batch * pages_per_row].view(batch, pages_per_row)
        inputs["block_table"] = table.to(torch.int32)
        k_cache = torch.full((num_pages, page, heads_k, dim), float("nan"), device=DEVICE).half()
        v_cache = k_cache.clone()
        for b in range(batch):
            live = positions[: int(valid_end[b])]
            slots = table[b, live // page], live % page
            k_cache[slots] = torch.randn(len(live), heads_k, dim, device=DEVICE).half()
            v_cache[slots] = torch.randn(len(live), heads_k, dim, device=DEVICE).half()
    else:
        k_cache = torch.randn(batch + 2, capacity, heads_k, dim, device=DEVICE).half()
        v_cache = torch.randn_like(k_cache)
        start = torch.zeros(batch, dtype=torch.long, device=DEVICE)
        rows = torch.arange(batch, device=DEVICE)
        if layout == "leftpad":
            inputs["cache_leftpad"] = torch.tensor([0, 30, 100], dtype=torch.int32, device=DEVICE)
            start = inputs["cache_leftpad"].long()
        else:
            rows = torch.tensor([4, 0, 2], device=DEVICE)
            inputs["cache_batch_idx"] = rows.to(torch.int32)
        garbage = torch.ones(batch + 2, capacity, dtype=torch.bool, device=DEVICE)
        garbage[rows] = (positions[None] < start[:, None]) | (positions[None] >= valid_end[:, None])
        k_cache[garbage] = float("nan")
        v_cache[garbage] = float("nan")
    ref_out, ref_lse, ref_k, ref_v = kvcache_reference(q, k_cache, v_cache, k_new, v_new, **inputs, causal=True)
    pt_out = kvcache_reference(q, k_cache, v_cache, k_new, v_new, **inputs, causal=True, compute_dtype=None)[0]
    assert torch.isfinite(ref_out).all()
    with poisoned_outputs():
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **inputs, causal=True,
                                                       num_splits=3, return_softmax_lse=True)
    assert_checks_ok(kvcache_checks(out, lse, ref_out, ref_lse, pt_out))
    assert torch.equal(k_cache.nan_to_num(1e4), ref_k.nan_to_num(1e4))
    assert torch.equal(v_cache.nan_to_num(1e4), ref_v.nan_to_num(1e4))


def test_nan_in_varlen_padding_is_never_read():
    """Rows past cu_seqlens[-1] of q, k and v (padding of a packed batch) hold NaN: covered outputs and gradients
    are finite and match the per-sequence reference."""
    lens_q, lens_k, tail = [5, 40, 0, 17], [30, 0, 45, 64], 7
    cu_q, cu_k = cu_seqlens(lens_q, DEVICE), cu_seqlens(lens_k, DEVICE)
    covered_q, covered_k = sum(lens_q), sum(lens_k)
    q = torch.randn(covered_q + tail, 4, 32, device=DEVICE).half()
    k, v = (torch.randn(covered_k + tail, 2, 32, device=DEVICE).half() for _ in range(2))
    for t, covered in ((q, covered_q), (k, covered_k), (v, covered_k)):
        t[covered:] = float("nan")
        t.requires_grad_()
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                         return_attn_probs=True)
        dout = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    clean = [t.detach()[:c] for t, c in ((q, covered_q), (k, covered_k), (v, covered_k))]
    inputs64 = [t.double().requires_grad_() for t in clean]
    inputs_pt = [t.clone().requires_grad_() for t in clean]
    with torch.enable_grad():
        ref_out, ref_lse = attention_reference_varlen(*inputs64, cu_q.cpu(), cu_k.cpu(), max(lens_k), causal=True)
        pt_out, _ = attention_reference_varlen(*inputs_pt, cu_q.cpu(), cu_k.cpu(), max(lens_k), causal=True,
                                               compute_dtype=None)
        ref_grads = torch.autograd.grad(ref_out, inputs64, dout[:covered_q].double())
        pt_grads = torch.autograd.grad(pt_out, inputs_pt, dout[:covered_q])
    checks = [check_error("out", out[:covered_q], ref_out, pt_out), check_lse(lse[:, :covered_q], ref_lse)]
    for name, g, rg, pg, covered in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, pt_grads,
                                        (covered_q, covered_k, covered_k)):
        checks.append(check_error(name, g[:covered], rg, pg, factor=3.0, atol=1e-4))
    assert_checks_ok(checks)


def test_empty_keys_backward_gives_zero_gradients():
    """Sk = 0 (padded API): out 0, LSE +inf, and the backward writes dq = 0 (no NaN from 0/0) and empty dk/dv."""
    q = torch.randn(2, 9, 2, 16, device=DEVICE, dtype=torch.float16, requires_grad=True)
    k = torch.randn(2, 0, 2, 16, device=DEVICE, dtype=torch.float16, requires_grad=True)
    v = torch.randn(2, 0, 2, 16, device=DEVICE, dtype=torch.float16, requires_grad=True)
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))
    assert torch.all(dq == 0), "dq of rows without keys must be exactly 0"
    assert dk.shape == k.shape and dv.shape == v.shape
