"""FP8 (e4m3) inputs with FA3's descales (docs/api.md §4.12): flash_attn_func, flash_attn_varlen_func and
flash_attn_with_kvcache against the float64 emulation of the same rounding (P in fp16 relative to each row's max)
and against the float64 attention of the dequantized inputs; accuracy next to the bf16 path's; bf16 outputs; clear
errors."""

from dataclasses import dataclass

import pytest
import torch

import flashtriton
from flashtriton import configs, flash_attn_interface as fai
from flashtriton.ops import hopper
from flashtriton.reference import attention_reference, attention_reference_varlen, kvcache_reference
from flashtriton.testing import check_lse, cu_seqlens, poisoned_outputs, quantize_e4m3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descales: tuple


def make_inputs(batch=2, seqlen_q=70, seqlen_k=90, heads=4, heads_k=2, head_dim=32, seed=0) -> Inputs:
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, s, h, head_dim, generator=generator)
               for s, h in ((seqlen_q, heads), (seqlen_k, heads_k), (seqlen_k, heads_k)))
    q8, q_descale = quantize_e4m3(q, heads // heads_k)
    k8, k_descale = quantize_e4m3(k)
    v8, v_descale = quantize_e4m3(v)
    return Inputs(*(t.to(DEVICE) for t in (q8, k8, v8)), tuple(d.to(DEVICE) for d in (q_descale, k_descale,
                                                                                     v_descale)))


def descale_kwargs(inputs: Inputs) -> dict:
    return dict(zip(("q_descale", "k_descale", "v_descale"), inputs.descales))


def rms(a, b) -> float:
    return float(((a.double() - b.double()) ** 2).mean().sqrt())


def accumulation_slack(inputs: Inputs) -> float:
    """How far Hopper's FP8 wgmma may leave a score from its exact value: its accumulator keeps about 14 bits of
    mantissa (DeepSeek-V3 technical report, section 3.3.2), so a score can move by about 2^-13 of the sum of its
    products' magnitudes (one bit of margin), times the softmax scale; the LSE moves by at most that much."""
    q_descale, k_descale, _ = inputs.descales
    group = inputs.q.shape[2] // inputs.k.shape[2]
    q = inputs.q.float().abs() * q_descale.repeat_interleave(group, 1)[:, None, :, None]
    k = (inputs.k.float().abs() * k_descale[:, None, :, None]).repeat_interleave(group, 2)
    magnitudes = torch.einsum("bihd,bjhd->bhij", q, k)  # [batch, heads, rows, keys]: sum_d |q_id k_jd|
    return 2 ** -13 * inputs.q.shape[-1] ** -0.5 * float(magnitudes.max())


def assert_matches_emulation(out, lse, emulated, emulated_lse, exact, lse_slack: float = 0.0):
    """out as far from the unquantized result as the emulation is, within a factor: the kernels round P relative to
    the running max of the key blocks seen so far, the emulation relative to the row's final max, so the two round
    different numbers by the same relative step; plus one bf16 step of out's scale (all three are rounded to bf16,
    and fp16 P leaves differences of that size only); the LSE (unquantized) exact, but for lse_slack (the scores' FP8
    accumulation: accumulation_slack)."""
    assert out.dtype == torch.bfloat16
    assert not out.isnan().any()
    emulation_error = float((emulated.double() - exact.double()).abs().max())
    bf16_step = 2 ** -7 * float(exact.double().abs().max())
    assert float((out.double() - exact.double()).abs().max()) <= 3 * emulation_error + bf16_step + 1e-3
    assert rms(out, exact) <= 1.5 * rms(emulated, exact) + 2 ** -8 * float(exact.double().pow(2).mean().sqrt())
    lse_check = check_lse(lse, emulated_lse)
    assert lse_check.finite and lse_check.max_error <= lse_check.bound + lse_slack, lse_check


FEATURES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window-softcap": dict(window_size=(20, 6), softcap=4.0),
    "alibi-causal": dict(causal=True, alibi=True),
}


@pytest.mark.parametrize("feature", list(FEATURES), ids=list(FEATURES))
@pytest.mark.parametrize("head_dim", [32, 64])
def test_dense(feature, head_dim):
    options = dict(FEATURES[feature])
    inputs = make_inputs(head_dim=head_dim)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(4, device=DEVICE) * 0.3
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(inputs.q, inputs.k, inputs.v, return_attn_probs=True,
                                                  **options, **descale_kwargs(inputs))
    reference = dict(descales=inputs.descales, compute_dtype=torch.float64, **options)
    emulated, emulated_lse = attention_reference(inputs.q, inputs.k, inputs.v, **reference)
    exact, _ = attention_reference(inputs.q, inputs.k, inputs.v, quantize_p=False, **reference)
    assert_matches_emulation(out, lse, emulated, emulated_lse, exact)


ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not ON_HOPPER or hopper.attn_fwd_hopper_kernel is None,
                    reason="the Gluon forward runs on sm_90 only")
@pytest.mark.parametrize("head_dim,causal,window", [(128, True, (-1, -1)), (64, False, (-1, -1)),
                                                    (96, False, (40, 7)), (256, True, (-1, -1)), (48, True, (-1, -1))])
def test_gluon_forward_takes_fp8(monkeypatch, head_dim, causal, window):
    """On sm_90 a dense FP8 call runs the Gluon forward (e4m3 q . k, fp16 P V), as close to the unquantized result
    as the emulation, and close to the Triton kernel's output on the same inputs (the Gluon kernels off)."""
    inputs = make_inputs(batch=2, seqlen_q=300, seqlen_k=333, heads=6, heads_k=2, head_dim=head_dim, seed=head_dim)
    options = dict(causal=causal, window_size=window)
    launches = hopper.fwd_launch_count
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(inputs.q, inputs.k, inputs.v, return_attn_probs=True, **options,
                                                  **descale_kwargs(inputs))
    assert hopper.fwd_launch_count == launches + 1
    reference = dict(descales=inputs.descales, compute_dtype=torch.float64, **options)
    emulated, emulated_lse = attention_reference(inputs.q, inputs.k, inputs.v, **reference)
    exact, _ = attention_reference(inputs.q, inputs.k, inputs.v, quantize_p=False, **reference)
    lse_slack = accumulation_slack(inputs)
    assert_matches_emulation(out, lse, emulated, emulated_lse, exact, lse_slack)
    monkeypatch.setattr(configs, "GLUON_ALLOWED", False)
    triton_out, triton_lse, _ = flashtriton.flash_attn_func(inputs.q, inputs.k, inputs.v, return_attn_probs=True,
                                                            **options, **descale_kwargs(inputs))
    assert hopper.fwd_launch_count == launches + 1
    assert rms(out, triton_out) <= 2 ** -8 * float(exact.double().pow(2).mean().sqrt())
    torch.testing.assert_close(lse, triton_lse, rtol=1e-4, atol=1e-4 + 2 * lse_slack)


@pytest.mark.parametrize("causal", [False, True])
def test_accuracy_next_to_bf16(causal):
    """On N(0, 1) inputs the FP8 output is within 1.5x the bf16 path's RMSE, each against float64 attention of its
    own inputs (the dequantized e4m3 ones, the bf16 ones): one e4m3 term of P would give about 10x."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 192, 4, 64, generator=generator) for _ in range(3))
    (q8, q_descale), (k8, k_descale), (v8, v_descale) = quantize_e4m3(q), quantize_e4m3(k), quantize_e4m3(v)
    inputs = Inputs(*(t.to(DEVICE) for t in (q8, k8, v8)),
                    tuple(d.to(DEVICE) for d in (q_descale, k_descale, v_descale)))
    with poisoned_outputs():
        fp8_out = flashtriton.flash_attn_func(inputs.q, inputs.k, inputs.v, causal=causal, **descale_kwargs(inputs))
    exact_fp8, _ = attention_reference(inputs.q, inputs.k, inputs.v, causal=causal, descales=inputs.descales,
                                       quantize_p=False, compute_dtype=torch.float64)
    q16, k16, v16 = (t.to(DEVICE, torch.bfloat16) for t in (q, k, v))
    with poisoned_outputs():
        bf16_out = flashtriton.flash_attn_func(q16, k16, v16, causal=causal)
    exact_bf16, _ = attention_reference(q16.double(), k16.double(), v16.double(), causal=causal,
                                        compute_dtype=torch.float64)
    assert rms(fp8_out, exact_fp8) <= 1.5 * rms(bf16_out, exact_bf16)


def test_decode_shape_splits_and_sinks():
    inputs = make_inputs(batch=1, seqlen_q=2, seqlen_k=500, heads=8, heads_k=2, head_dim=64)
    sink = torch.randn(8, device=DEVICE)
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(inputs.q, inputs.k, inputs.v, causal=True, return_attn_probs=True,
                                                  learnable_sink=sink, **descale_kwargs(inputs))
    reference = dict(causal=True, descales=inputs.descales, compute_dtype=torch.float64, learnable_sink=sink)
    emulated, emulated_lse = attention_reference(inputs.q, inputs.k, inputs.v, **reference)
    exact, _ = attention_reference(inputs.q, inputs.k, inputs.v, quantize_p=False, **reference)
    assert_matches_emulation(out, lse, emulated, emulated_lse, exact)


def test_varlen():
    lengths_q, lengths_k = [9, 0, 40], [30, 5, 41]
    cu_q, cu_k = cu_seqlens(lengths_q, DEVICE), cu_seqlens(lengths_k, DEVICE)
    inputs = make_inputs(batch=1, seqlen_q=sum(lengths_q), seqlen_k=sum(lengths_k))
    q, k, v = (t[0] for t in (inputs.q, inputs.k, inputs.v))
    # one descale row per sequence
    descales = tuple(d.expand(3, -1).contiguous() for d in inputs.descales)
    kwargs = dict(zip(("q_descale", "k_descale", "v_descale"), descales))
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 41, causal=True,
                                                         return_attn_probs=True, **kwargs)
    reference = dict(causal=True, descales=descales, compute_dtype=torch.float64)
    emulated, emulated_lse = attention_reference_varlen(q, k, v, cu_q, cu_k, 41, **reference)
    exact, _ = attention_reference_varlen(q, k, v, cu_q, cu_k, 41, quantize_p=False, **reference)
    assert_matches_emulation(out, lse, emulated, emulated_lse, exact)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_with_an_fp8_cache(num_splits):
    """The serving case: an e4m3 KV cache (new keys appended in e4m3), one new query token, GQA."""
    batch, capacity = 3, 128
    cache = make_inputs(batch=batch, seqlen_q=2, seqlen_k=capacity, heads=8, heads_k=2, head_dim=64, seed=1)
    new = make_inputs(batch=batch, seqlen_q=2, seqlen_k=1, heads=8, heads_k=2, head_dim=64, seed=2)
    cache_seqlens = torch.tensor([0, 60, 127], dtype=torch.int32, device=DEVICE)
    options = dict(cache_seqlens=cache_seqlens, causal=True)
    emulated, emulated_lse, ref_k, ref_v = kvcache_reference(cache.q, cache.k, cache.v, new.k, new.v,
                                                             descales=cache.descales, **options)
    exact = kvcache_reference(cache.q, cache.k, cache.v, new.k, new.v, descales=cache.descales, quantize_p=False,
                              **options)[0]
    k_cache, v_cache = cache.k.clone(), cache.v.clone()
    with poisoned_outputs():
        out, lse = flashtriton.flash_attn_with_kvcache(cache.q, k_cache, v_cache, new.k, new.v,
                                                       num_splits=num_splits, return_softmax_lse=True, **options,
                                                       **descale_kwargs(cache))
    assert_matches_emulation(out, lse, emulated, emulated_lse, exact)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))


def _bad(**changes):
    inputs = make_inputs(batch=2, seqlen_q=8, seqlen_k=8)
    kwargs = {"q": inputs.q, "k": inputs.k, "v": inputs.v, **descale_kwargs(inputs), **changes}
    return lambda: flashtriton.flash_attn_func(**kwargs)


@pytest.mark.parametrize("call,error,match", [
    (_bad(k_descale=None), RuntimeError, r"need q_descale, k_descale and v_descale .* missing k_descale"),
    (_bad(v_descale=torch.ones(2, 4)), RuntimeError, r"v_descale must be a \(batch_size, num_heads_k\) = \(2, 2\)"),
    (_bad(q_descale=torch.ones(2, 2, dtype=torch.float16)), RuntimeError, "float32 tensor, got"),
    (_bad(k=torch.zeros(2, 8, 2, 32, dtype=torch.bfloat16)), RuntimeError, "all in torch.float8_e4m3fn"),
    (_bad(dropout_p=0.1), RuntimeError, "FP8 attention takes no dropout"),
    (lambda: flashtriton.flash_attn_func(*(torch.zeros(1, 8, 2, 32, dtype=torch.bfloat16) for _ in range(3)),
                                         q_descale=torch.ones(1, 2)), RuntimeError, "apply to FP8"),
], ids=["missing", "shape", "dtype", "mixed", "dropout", "bf16-with-descale"])
def test_bad_fp8_calls_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_no_backward():
    inputs = make_inputs(batch=1, seqlen_q=8, seqlen_k=8)
    q = inputs.q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="FP8 attention is forward only"):
        flashtriton.flash_attn_func(q, inputs.k, inputs.v, **descale_kwargs(inputs))
    out, lse, _, rng_state = fai._flash_attn_forward(inputs.q, inputs.k, inputs.v, 0.0, 0.2, False, -1, -1, 0.0,
                                                     None, False, None, *inputs.descales)
    grads = [torch.empty(t.shape, dtype=torch.bfloat16, device=DEVICE) for t in (inputs.q, inputs.k, inputs.v)]
    with pytest.raises(RuntimeError, match="FP8 attention is forward only"):
        fai._flash_attn_backward(out, inputs.q, inputs.k, inputs.v, out, lse, *grads, 0.0, 0.2, False, -1, -1, 0.0,
                                 None, False, rng_state)


def test_fake_tensors_give_bf16_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 5, 4, 64, dtype=FP8)
        k = torch.empty(2, 9, 2, 64, dtype=FP8)
        descale = torch.empty(2, 2)
        out = flashtriton.flash_attn_func(q, k, k, q_descale=descale, k_descale=descale, v_descale=descale)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 5, 4, 64)
