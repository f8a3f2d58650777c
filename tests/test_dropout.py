"""Dropout (docs/api.md §4.7): Bernoulli keep mask from torch's RNG, read back through S_dmask and checked exactly."""

import numpy as np
import pytest
import torch

import flashtriton
from flashtriton.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
from flashtriton.ops import backend, dropout, hopper
from flashtriton.reference import attention_reference_varlen
from flashtriton.testing import Case, assert_checks_ok, check_error, compare_with_reference, poisoned_outputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_qkv(batch=2, seqlen_q=70, seqlen_k=90, heads=4, heads_k=2, dim=32, dtype=torch.float16):
    shape_q, shape_k = (batch, seqlen_q, heads, dim), (batch, seqlen_k, heads_k, dim)
    return tuple(torch.randn(s, device=DEVICE).to(dtype).requires_grad_() for s in (shape_q, shape_k, shape_k))


def keep_mask_of(s_dmask, seqlen_q, seqlen_k):
    """The keep mask S_dmask encodes: non-negative means kept (sign-bit encoding of docs/api.md §4.7)."""
    return ~torch.signbit(s_dmask[:, :, :seqlen_q, :seqlen_k])


@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window_size=(20, 5), alibi=True),
                                     dict(seqlen_q=5, causal=True, alibi=True)],
                         ids=["full", "causal", "local-alibi", "short-query-packed-gqa-alibi"])
def test_output_and_gradients_match_reference_with_the_kernels_mask(options):
    options = dict(options)
    seqlen_q = options.pop("seqlen_q", 70)
    q, k, v = make_qkv(seqlen_q=seqlen_q)
    slopes = torch.rand(4, device=DEVICE) * 0.3 if options.pop("alibi", False) else None
    p = 0.17
    with poisoned_outputs():
        out, lse, s_dmask = flashtriton.flash_attn_func(q, k, v, p, alibi_slopes=slopes, return_attn_probs=True,
                                                        **options)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert s_dmask.shape == (2, 4, 128, 128) and s_dmask.dtype == q.dtype
    keep = keep_mask_of(s_dmask, seqlen_q, 90)
    case = Case(causal=options.get("causal", False), window_size=options.get("window_size", (-1, -1)))
    checks = compare_with_reference(case, out, lse, q, k, v, slopes, grads, dout, dropout_p=p, dropout_mask=keep)
    assert_checks_ok(checks)


GLUON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not GLUON_GPU, reason="the Gluon kernels run on sm_90 GPUs")
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192])
@pytest.mark.parametrize("causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (70, 20))],
                         ids=["full", "causal", "local"])
def test_gluon_dropout_forward_and_backward_match_reference(head_dim, causal, window_size):
    """The Gluon forward drops P by the mask S_dmask shows (the Triton mask kernel's), the Gluon backward (head dims
    on kernels/hopper/bwd.py's tiles) by the same mask; gradients against float64 with that mask."""
    q, k, v = make_qkv(batch=2, seqlen_q=300, seqlen_k=333, heads=4, heads_k=2, dim=head_dim, dtype=torch.bfloat16)
    p = 0.17
    forwards, backwards = hopper.fwd_launch_count, hopper.bwd_launch_count
    with poisoned_outputs():
        out, lse, s_dmask = flashtriton.flash_attn_func(q, k, v, p, causal=causal, window_size=window_size,
                                                        return_attn_probs=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert hopper.fwd_launch_count == forwards + 1, "the Gluon forward takes dropout"
    assert hopper.bwd_launch_count - backwards == int(hopper.backward_takes_logit_options(head_dim))
    keep = keep_mask_of(s_dmask, 300, 333)
    case = Case(causal=causal, window_size=window_size, head_dim=head_dim, dtype=torch.bfloat16)
    checks = compare_with_reference(case, out, lse, q, k, v, None, grads, dout, dropout_p=p, dropout_mask=keep)
    assert_checks_ok(checks)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(20, 5), alibi=True)],
                         ids=["causal", "local-alibi"])
def test_gradients_with_atomic_dq_match_reference(force_dq_atomic, options):
    """The atomic-dQ backward drops the same elements of dS as the dK/dV it shares them with."""
    test_output_and_gradients_match_reference_with_the_kernels_mask(options)


def test_drop_rate_lse_and_s_dmask_contents():
    q, k, v = make_qkv(batch=2, seqlen_q=128, seqlen_k=128, heads=4, heads_k=4)
    p = 0.3
    out, lse, s_dmask = flashtriton.flash_attn_func(q, k, v, p, causal=True, return_attn_probs=True)
    _, lse_no_dropout, _ = flashtriton.flash_attn_func(q, k, v, 0.0, causal=True, return_attn_probs=True)
    assert torch.equal(lse, lse_no_dropout), "the LSE does not depend on dropout"
    visible = torch.ones(128, 128, dtype=torch.bool, device=DEVICE).tril()
    kept = keep_mask_of(s_dmask, 128, 128)
    rate = 1.0 - kept[..., visible].float().mean().item()
    assert abs(rate - p) < 0.01
    assert torch.all(s_dmask[..., ~visible] == 0) and not torch.signbit(s_dmask[..., ~visible]).any()
    probs = s_dmask.abs().float()
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)), rtol=0, atol=2e-2)


@pytest.mark.parametrize("p,threshold", [(0.1, 229), (0.17, 211), (0.2, 204), (0.5, 127), (0.9, 25)])
def test_keep_threshold_is_fa2s_byte(p, threshold):
    """FA2's 8-bit convention: keep = 1 - p in fp32, threshold floor(keep * 255) (fp32 rounding makes p = 0.2's
    0.8 * 255 land just above 204), keep probability (threshold + 1) / 256, kept values scaled by 1 / keep."""
    assert dropout.keep_threshold(p) == threshold
    assert dropout.keep_probability(p) == (threshold + 1) / 256
    assert dropout.kernel_dropout(p) == (float(threshold), float(torch.tensor(1.0) / (1 - torch.tensor(p))))


def _philox4x32_7(counters, key):
    """Philox4x32 (Salmon et al. 2011) with FA2's seven rounds on uint64 numpy arrays holding 32-bit values:
    counters (c0, c1, c2, c3), key (k0, k1); returns the four output words."""
    mask = np.uint64(0xFFFFFFFF)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & mask for c in counters)
    k0, k1 = (np.uint64(k) & mask for k in key)
    for _ in range(7):
        product0, product1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((product1 >> np.uint64(32)) ^ c1 ^ k0, product1 & mask,
                          (product0 >> np.uint64(32)) ^ c3 ^ k1, product0 & mask)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return c0, c1, c2, c3


@pytest.mark.skipif(not backend.runs_triton(torch.empty(0, device=DEVICE)), reason="the kernels' mask (interpreter or "
                    "GPU); the CPU reference path draws its own")
@pytest.mark.parametrize("cols", [96, 200])
def test_kernel_mask_is_the_documented_philox_mapping(cols):
    """docs/api.md §4.7's mapping, bit for bit: key j of row i in stream s keeps byte 2 ((i / 8) % 2) + j % 2 of
    word (j / 8) % 4 of Philox4x32-7 (4 (j / 32) + (j / 2) % 4, 8 (i / 16) + i % 8, s, offset) keyed by the seed."""
    batch, heads, rows, p = 2, 3, 80, 0.3
    rng_state = dropout.new_rng_state(DEVICE)
    keep = dropout.keep_mask(rng_state, batch, heads, rows, cols, p, True).cpu().numpy()
    seed, offset = (int(x) for x in rng_state.tolist())
    i = np.arange(rows, dtype=np.uint64)[:, None]
    j = np.arange(cols, dtype=np.uint64)[None, :]
    for stream in range(batch * heads):
        words = _philox4x32_7((4 * (j // 32) + (j // 2) % 4, 8 * (i // 16) + i % 8, np.full_like(i, stream),
                                np.full_like(i, offset & 0x7FFFFFFF)), (seed & 0xFFFFFFFF, seed >> 32))
        word = np.choose(((j // 8) % 4).astype(np.int64) + np.zeros_like(i, dtype=np.int64), words)
        byte = (word >> (np.uint64(8) * (2 * ((i // 8) % 2) + j % 2))) & np.uint64(0xFF)
        expected = byte <= dropout.keep_threshold(p)
        got = keep[stream // heads, stream % heads]
        assert (got == expected).all(), f"stream {stream}: {(got != expected).sum()} of {got.size} elements differ"


@pytest.mark.parametrize("p", [0.1, 0.17])
def test_dropped_fraction_over_a_large_mask(p):
    """The kernels' mask (the CPU reference path's draws) drops a fraction within 0.01 of p, and within sampling
    noise of 1 - keep_probability(p)."""
    rng_state = dropout.new_rng_state(DEVICE)
    keep = dropout.keep_mask(rng_state, 2, 4, 256, 256, p, backend.runs_triton(rng_state))
    dropped = 1.0 - keep.float().mean().item()
    assert abs(dropped - p) < 0.01
    assert abs(dropped - (1 - dropout.keep_probability(p))) < 5 * (p * (1 - p) / keep.numel()) ** 0.5


def test_dropped_fraction_under_a_window():
    """Under a local window the visible elements' dropped fraction stays within 0.025 of p (S_dmask's signs)."""
    q, k, v = make_qkv(batch=2, seqlen_q=256, seqlen_k=256, heads=4, heads_k=4)
    p = 0.1
    _, _, s_dmask = flashtriton.flash_attn_func(q, k, v, p, window_size=(40, 8), return_attn_probs=True)
    rows, cols = torch.arange(256, device=DEVICE)[:, None], torch.arange(256, device=DEVICE)[None, :]
    visible = (cols >= rows - 40) & (cols <= rows + 8)
    kept = keep_mask_of(s_dmask, 256, 256)
    assert abs(1.0 - kept[..., visible].float().mean().item() - p) < 0.025
    assert torch.all(s_dmask[..., :256, :256][..., ~visible] == 0)


def test_manual_seed_reproduces_and_calls_differ():
    q, k, v = make_qkv()
    torch.manual_seed(1234)
    first = flashtriton.flash_attn_func(q, k, v, 0.25, return_attn_probs=True)
    second = flashtriton.flash_attn_func(q, k, v, 0.25, return_attn_probs=True)
    torch.manual_seed(1234)
    again = flashtriton.flash_attn_func(q, k, v, 0.25, return_attn_probs=True)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[2], second[2]), "two calls must draw different masks"


def test_backward_is_deterministic_and_uses_the_forward_mask():
    q, k, v = make_qkv()
    out = flashtriton.flash_attn_func(q, k, v, 0.2, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    grads = [torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) for _ in range(3)]
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


def test_dense_and_varlen_draw_the_same_mask():
    q, k, v = make_qkv(batch=3, seqlen_q=50, seqlen_k=50, heads=2, heads_k=2)
    cu = torch.arange(0, 151, 50, dtype=torch.int32, device=DEVICE)
    torch.manual_seed(7)
    dense, _, dense_mask = flashtriton.flash_attn_func(q, k, v, 0.3, causal=True, return_attn_probs=True)
    torch.manual_seed(7)
    varlen, _, varlen_mask = flashtriton.flash_attn_varlen_func(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 50, 50, 0.3, causal=True, return_attn_probs=True)
    assert torch.equal(varlen, dense.flatten(0, 1))
    assert torch.equal(varlen_mask, dense_mask)


def test_varlen_matches_reference_with_the_kernels_mask():
    lens_q, lens_k = [30, 0, 45], [20, 10, 60]
    cu_q = torch.tensor([0, 30, 30, 75], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 20, 30, 90], dtype=torch.int32, device=DEVICE)
    q = torch.randn(75, 2, 32, device=DEVICE).half()
    k, v = torch.randn(90, 2, 32, device=DEVICE).half(), torch.randn(90, 2, 32, device=DEVICE).half()
    out, _, s_dmask = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), 0.2,
                                                         causal=True, return_attn_probs=True)
    keep = keep_mask_of(s_dmask, max(lens_q), max(lens_k))
    ref, _ = attention_reference_varlen(q, k, v, cu_q.cpu(), cu_k.cpu(), max(lens_k), causal=True, dropout_p=0.2,
                                        dropout_mask=keep)
    pt, _ = attention_reference_varlen(q, k, v, cu_q.cpu(), cu_k.cpu(), max(lens_k), causal=True, dropout_p=0.2,
                                       dropout_mask=keep, compute_dtype=None)
    check = check_error("out", out, ref, pt)
    assert check.ok, str(check)


def test_backward_without_rng_state_raises():
    q, k, v = make_qkv()
    out, lse, _, _ = _flash_attn_forward(
        q.detach(), k.detach(), v.detach(), 0.1, 0.2, False, -1, -1, 0.0, None, False)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with pytest.raises(RuntimeError, match="rng_state"):
        _flash_attn_backward(
            torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, 0.1, 0.2, False, -1, -1,
            0.0, None, False, None)
