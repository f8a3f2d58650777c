"""Dense attention (flash_attn_func and the packed forms) against the float64 reference.

Every case draws fresh random inputs, runs forward and backward with NaN-poisoned output buffers,
and applies the tolerance rule of docs/api.md §4.10 (out: 2x PyTorch's own error in the dtype + 1e-5;
gradients: 3x + 1e-4; LSE: +inf exactly where the reference has it, else 1e-4 relative).
On CPU the shapes are interpreter-sized; on a GPU the `gpu` cases add long sequences.
"""

from dataclasses import replace

import pytest
import torch

import flashtriton
from flashtriton import configs
from flashtriton.ops import backend
from flashtriton.testing import (Case, assert_checks_ok, compare_with_reference, forced_gluon, forced_heads_per_group,
                                 forced_rescale_threshold, make_case_inputs, poisoned_outputs)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
RUNS_KERNELS = ON_GPU or backend.KERNELS_INTERPRETED


def run_case(case: Case, grads: bool = True, scale: float = 1.0):
    q, k, v, slopes = make_case_inputs(case, DEVICE, requires_grad=grads, scale=scale)
    with poisoned_outputs():
        out, lse, s_dmask = flashtriton.flash_attn_func(
            q, k, v, 0.0, case.softmax_scale, case.causal, case.window_size, case.softcap, slopes,
            return_attn_probs=True)
        dout = torch.randn_like(out)
        grad_values = torch.autograd.grad(out, (q, k, v), dout) if grads else None
    assert s_dmask.shape == (0,)
    return compare_with_reference(case, out, lse, q, k, v, slopes, grad_values, dout if grads else None)


SHAPES = [(1, 1), (1, 239), (3, 113), (113, 113), (239, 97), (97, 239), (64, 128)]
HEAD_DIMS = [16, 40, 64, 72, 96, 128, 160, 256]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SHAPES, ids=[f"sq{a}-sk{b}" for a, b in SHAPES])
def test_shapes(seqlen_q, seqlen_k, dtype, causal):
    assert_checks_ok(run_case(Case(seqlen_q=seqlen_q, seqlen_k=seqlen_k, dtype=dtype, causal=causal)))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_head_dims(head_dim, causal):
    case = Case(batch=1, seqlen_q=97, seqlen_k=75, num_heads=2, num_heads_k=2, head_dim=head_dim, causal=causal)
    assert_checks_ok(run_case(case))


FEATURES = {
    "window-10-5": dict(window_size=(10, 5)),
    "window-0-0": dict(window_size=(0, 0)),
    "window-left-only": dict(window_size=(20, -1)),
    "window-right-only": dict(window_size=(-1, 30)),
    "window-minus1-0-is-causal": dict(window_size=(-1, 0)),
    "causal-window": dict(causal=True, window_size=(24, 7)),
    "softcap": dict(softcap=5.0),
    "softcap-causal": dict(softcap=2.0, causal=True),
    "alibi": dict(alibi=True),
    "alibi-causal-quirk": dict(alibi=True, causal=True),
    "alibi-window": dict(alibi=True, window_size=(16, 16)),
    "scale": dict(softmax_scale=0.3),
    "gqa": dict(num_heads=6, num_heads_k=2),
    "mqa": dict(num_heads=4, num_heads_k=1),
    "bhsd-layout": dict(layout="bhsd"),
    "sliced-layout": dict(layout="sliced", num_heads=4, num_heads_k=2),
    "all-combined": dict(causal=True, window_size=(40, 3), softcap=3.0, alibi=True, num_heads=6, num_heads_k=3,
                         softmax_scale=0.2, dtype=torch.bfloat16, head_dim=40),
    "local-all-combined": dict(window_size=(13, 21), softcap=4.0, alibi=True, num_heads=4, num_heads_k=2,
                               head_dim=72, layout="bhsd"),
}
FEATURE_SHAPES = [(97, 97), (150, 83), (83, 150)]


@pytest.mark.parametrize("seqlen_q,seqlen_k", FEATURE_SHAPES, ids=[f"sq{a}-sk{b}" for a, b in FEATURE_SHAPES])
@pytest.mark.parametrize("feature", list(FEATURES), ids=list(FEATURES))
def test_features(feature, seqlen_q, seqlen_k):
    case = replace(Case(seqlen_q=seqlen_q, seqlen_k=seqlen_k), **FEATURES[feature])
    assert_checks_ok(run_case(case))


PACKED_GQA_CASES = {
    # 16 rows x 6 heads = 96 packed rows: the tile boundary falls inside one query row's head group
    "two-packed-tiles": dict(seqlen_q=16, seqlen_k=83, num_heads=12, num_heads_k=2, causal=True,
                             window_size=(30, 0), alibi=True, softcap=3.0),
    "mqa-one-row": dict(seqlen_q=1, seqlen_k=150, num_heads=5, num_heads_k=1, alibi=True),
    "gqa-bf16-local": dict(seqlen_q=7, seqlen_k=97, num_heads=8, num_heads_k=2, window_size=(11, 3),
                           dtype=torch.bfloat16, layout="bhsd"),
}


@pytest.mark.parametrize("name", list(PACKED_GQA_CASES), ids=list(PACKED_GQA_CASES))
def test_short_queries_pack_gqa_heads(name):
    """Few query rows with GQA: the forward packs each KV head's query heads into one tile."""
    case = replace(Case(), **PACKED_GQA_CASES[name])
    assert configs.pack_gqa(case.seqlen_q, case.num_heads // case.num_heads_k)
    assert_checks_ok(run_case(case))


DECODE_SPLIT_CASES = {
    "one-row-gqa": dict(seqlen_q=1, seqlen_k=700, num_heads=8, num_heads_k=2),
    "causal-sq-lt-sk-window-alibi": dict(seqlen_q=5, seqlen_k=611, causal=True, window_size=(300, 0), alibi=True),
    "softcap-bf16": dict(seqlen_q=3, seqlen_k=517, softcap=4.0, dtype=torch.bfloat16, num_heads=4, num_heads_k=4),
}


@pytest.mark.skipif(not RUNS_KERNELS, reason="the reference path has no split-KV")
@pytest.mark.parametrize("name", list(DECODE_SPLIT_CASES), ids=list(DECODE_SPLIT_CASES))
def test_decode_shaped_calls_split_the_keys(name, monkeypatch):
    """flash_attn_func with a few query rows and a grid that leaves the GPU idle splits each row's keys (the
    heuristic of flash_attn_with_kvcache) and merges the parts: same tolerance rule, gradients included."""
    launched = []
    launch = backend.launch_fwd

    def spy(*args, **kwargs):
        launched.append(kwargs.get("num_splits", 1))
        return launch(*args, **kwargs)

    monkeypatch.setattr(backend, "launch_fwd", spy)
    case = replace(Case(batch=1), **DECODE_SPLIT_CASES[name])
    assert_checks_ok(run_case(case))
    assert launched and launched[0] > 1


@pytest.mark.parametrize("feature", ["causal-window", "gqa", "alibi-causal-quirk"])
def test_dense_through_tensor_descriptors(force_tma, feature):
    """Host-built descriptors over whole (B, S, H, D) tensors, as sm90 runs dense layouts."""
    assert_checks_ok(run_case(replace(Case(seqlen_q=150, seqlen_k=83), **FEATURES[feature])))


@pytest.mark.parametrize("feature", ["causal-window", "gqa", "alibi-causal-quirk", "all-combined"])
def test_backward_with_atomic_dq(force_dq_atomic, feature):
    """dQ added with atomics by the dK/dV kernel (no dQ pass) meets the same tolerance rule."""
    assert_checks_ok(run_case(replace(Case(seqlen_q=150, seqlen_k=83), **FEATURES[feature])))


@pytest.mark.parametrize("heads_per_group", [2, 4])
@pytest.mark.parametrize("num_heads,num_heads_k", [(5, 5), (6, 3)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grids_run_in_groups_of_heads(heads_per_group, num_heads, num_heads_k, causal):
    """Launch order in groups of (batch, head) pairs, the last group smaller: every tile still runs once."""
    case = Case(batch=3, seqlen_q=150, seqlen_k=130, num_heads=num_heads, num_heads_k=num_heads_k, causal=causal)
    with forced_heads_per_group(heads_per_group):
        assert_checks_ok(run_case(case))


def test_heads_per_l2_group_fits_the_budget(monkeypatch):
    monkeypatch.setattr(configs, "L2_GROUP_BYTES", {False: 0, True: 10 << 20})
    assert configs.heads_per_l2_group(3 << 20, 64, True) == 3
    assert configs.heads_per_l2_group(3 << 20, 2, True) == 2
    assert configs.heads_per_l2_group(20 << 20, 64, True) == 1
    assert configs.heads_per_l2_group(1, 64, False) == 1


def test_atomic_dq_ignores_keys_past_the_sequence(force_dq_atomic):
    """Found by the long fuzz run: keys past seqlen_k in an unmasked block got P = exp2(0 - lse), inf for a
    very negative LSE, and 0 * inf reached dQ as NaN. One key with q.k = -128: the exact dQ and dK are 0."""
    q = torch.full((1, 1, 1, 8), 4.0, device=DEVICE, dtype=torch.float16, requires_grad=True)
    k = torch.full((1, 1, 1, 8), -4.0, device=DEVICE, dtype=torch.float16, requires_grad=True)
    v = torch.randn(1, 1, 1, 8, device=DEVICE, dtype=torch.float16, requires_grad=True)
    out = flashtriton.flash_attn_func(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    # dS = P (dP - delta) is fp32 rounding here (dP and delta are the same sum in another order)
    assert dq.abs().max() < 1e-3 and dk.abs().max() < 1e-3


@pytest.mark.skipif(not RUNS_KERNELS, reason="counts launches of the Triton dK/dV kernel; the reference path has none")
def test_deterministic_backward_skips_atomic_dq(force_dq_atomic, monkeypatch):
    """deterministic=True never launches the atomic variant of the Triton dK/dV kernel, even where the config asks for
    it (the Gluon backward, which never takes deterministic calls, is kept off so that both calls reach it)."""
    launched = []
    kernel = backend.attn_bwd_dkdv_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["DQ_ATOMIC"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(backend, "attn_bwd_dkdv_kernel", Recorder())
    case = Case(seqlen_q=70, seqlen_k=90)
    q, k, v, _ = make_case_inputs(case, DEVICE, requires_grad=True)
    with forced_gluon(False):
        for deterministic in (True, False):
            out = flashtriton.flash_attn_func(q, k, v, deterministic=deterministic)
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert launched == [False, True]


def test_saturated_softmax_gradients_follow_the_flash_algorithm():
    """Found by fuzzing: with inputs x4 the softmax is nearly one-hot, the true dQ/dK are tiny, and the
    rounding of O in delta = rowsum(dO * O) puts them at ~5x PyTorch's fp16 error. The kernel matches the
    float64 emulation of that algorithm (flashtriton.testing.flash_reference_grads) within the usual rule."""
    case = Case(batch=1, seqlen_q=2, seqlen_k=2, num_heads=2, num_heads_k=1, head_dim=40, causal=True,
                window_size=(2, 2), alibi=True)
    for seed in (5, 10):
        torch.manual_seed(seed)
        assert_checks_ok(run_case(case, scale=4.0))


def test_rows_with_a_single_visible_key_have_fp32_level_gradients():
    """Found by the long fuzz run: when every row sees one key the exact dQ and dK are 0, PyTorch's fp16 gradient
    is exactly 0 too, and the kernel's dS = P * (dP - delta) keeps fp32 rounding (~1e-4 with inputs x4).
    The tolerance allows what PyTorch's own fp32 evaluation of that formula leaves
    (flashtriton.testing.fp32_backward_floor), nothing more."""
    case = Case(batch=1, seqlen_q=27, seqlen_k=85, num_heads=6, num_heads_k=2, head_dim=80, causal=True,
                window_size=(0, 27), alibi=True, softmax_scale=0.3)
    for seed in (0, 9):
        torch.manual_seed(seed)
        assert_checks_ok(run_case(case, scale=4.0))


def test_window_quirk_query_longer_than_keys():
    """FA2's §4.2.3 rewrite: with Sq >= Sk + 2 a finite left window turns an unbounded right into Sk."""
    assert_checks_ok(run_case(Case(seqlen_q=200, seqlen_k=30, window_size=(5, -1))))
    assert_checks_ok(run_case(Case(seqlen_q=200, seqlen_k=30, window_size=(40, 2))))


def test_large_magnitudes_stay_finite():
    """Upstream's regression: q scaled by 5, k/v by 3, lengths off the block size; gradients finite."""
    for seqlen in (1, 2, 5, 17, 128):
        case = Case(seqlen_q=seqlen, seqlen_k=seqlen, head_dim=32, causal=True)
        assert_checks_ok(run_case(case, scale=4.0))


@pytest.mark.parametrize("threshold", [0.0, 8.0], ids=["always-rescale", "lagging-max"])
def test_rescale_skip_is_exact(threshold):
    """A-1: with the max lagging by up to 8 (log2), out and LSE match the always-rescale kernel within rounding."""
    # Growing logits along the keys make the row max rise slowly, so most tiles take the skip.
    case = Case(batch=1, seqlen_q=70, seqlen_k=260, num_heads=2, num_heads_k=2, head_dim=32)
    q, k, v, _ = make_case_inputs(case, DEVICE)
    ramp = torch.linspace(0.0, 3.0, case.seqlen_k, device=DEVICE)[None, :, None, None]
    k = (k.float() + ramp * q.float().mean(1, keepdim=True)).to(case.dtype)
    with poisoned_outputs(), forced_rescale_threshold(threshold):
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, return_attn_probs=True)
    assert_checks_ok(compare_with_reference(case, out, lse, q, k, v, None))


def test_rescale_skip_matches_always_rescale():
    case = Case(batch=1, seqlen_q=65, seqlen_k=300, num_heads=2, num_heads_k=2, head_dim=64)
    q, k, v, _ = make_case_inputs(case, DEVICE, scale=2.0)
    results = []
    for threshold in (0.0, 8.0):
        with forced_rescale_threshold(threshold), forced_gluon(False):  # the threshold is the Triton forward's
            results.append(flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True))
    (out0, lse0, _), (out8, lse8, _) = results
    torch.testing.assert_close(lse8, lse0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out8.float(), out0.float(), rtol=2e-3, atol=2e-3)


def test_rows_without_keys_give_zero_and_inf():
    case = Case(seqlen_q=100, seqlen_k=40, causal=True)
    q, k, v, _ = make_case_inputs(case, DEVICE)
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.all(out[:, :60] == 0)
    assert torch.all(torch.isposinf(lse[:, :, :60]))
    assert torch.isfinite(lse[:, :, 60:]).all()


def test_empty_keys_give_zero_and_inf():
    q = torch.randn(2, 5, 2, 16, device=DEVICE, dtype=torch.float16)
    k = torch.randn(2, 0, 2, 16, device=DEVICE, dtype=torch.float16)
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(q, k, k.clone(), return_attn_probs=True)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))


def test_empty_queries():
    q = torch.randn(2, 0, 2, 16, device=DEVICE, dtype=torch.float16, requires_grad=True)
    k = torch.randn(2, 7, 2, 16, device=DEVICE, dtype=torch.float16, requires_grad=True)
    out = flashtriton.flash_attn_func(q, k, k)
    assert out.shape == (2, 0, 2, 16)
    (dk,) = torch.autograd.grad(out.sum(), (k,))
    assert torch.all(dk == 0)


def test_deterministic_repeats_are_bitwise_equal():
    case = Case(seqlen_q=90, seqlen_k=130, num_heads=4, num_heads_k=2, causal=True, alibi=True)
    q, k, v, slopes = make_case_inputs(case, DEVICE, requires_grad=True)
    dout = torch.randn(q.shape, device=DEVICE, dtype=q.dtype)
    results = []
    for _ in range(3):
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, deterministic=True,
                                                  return_attn_probs=True)
        results.append((out, lse, *torch.autograd.grad(out, (q, k, v), dout)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_packed_variants_match_separate():
    case = Case(seqlen_q=77, seqlen_k=77, causal=True)
    qkv = torch.randn(2, 77, 3, 4, 64, device=DEVICE, dtype=torch.float16, requires_grad=True)
    dout = torch.randn(2, 77, 4, 64, device=DEVICE, dtype=torch.float16)
    out_packed = flashtriton.flash_attn_qkvpacked_func(qkv, causal=case.causal)
    (dqkv,) = torch.autograd.grad(out_packed, (qkv,), dout)
    q, k, v = (qkv[:, :, i].detach().clone().requires_grad_() for i in range(3))
    out = flashtriton.flash_attn_func(q, k, v, causal=case.causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.equal(out_packed, out)
    assert torch.equal(dqkv, torch.stack(grads, dim=2))

    kv = torch.stack((k, v), dim=2).detach().requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    out_kv = flashtriton.flash_attn_kvpacked_func(q2, kv, causal=case.causal)
    dq, dkv = torch.autograd.grad(out_kv, (q2, kv), dout)
    assert torch.equal(out_kv, out)
    assert torch.equal(dq, grads[0]) and torch.equal(dkv, torch.stack(grads[1:], dim=2))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="long sequences need a GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=["d64", "d128", "d256"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1024, 1024), (2048, 1531), (777, 4096)],
                         ids=["1k", "2k-1531", "777-4k"])
def test_long_sequences_gpu(seqlen_q, seqlen_k, dtype, causal, head_dim):
    case = Case(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=4, num_heads_k=2, head_dim=head_dim,
                dtype=dtype, causal=causal)
    assert_checks_ok(run_case(case))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="long sequences need a GPU")
@pytest.mark.parametrize("feature", ["causal-window", "alibi-causal-quirk", "softcap-causal", "local-all-combined"])
def test_long_features_gpu(feature):
    case = replace(Case(batch=2, seqlen_q=1500, seqlen_k=2100, head_dim=128), **FEATURES[feature])
    assert_checks_ok(run_case(case))
