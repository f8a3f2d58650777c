"""flash_attn_with_kvcache against the literal float64 reference (docs/api.md §5), contiguous and paged caches."""

from dataclasses import dataclass, replace

import pytest
import torch

import flashtriton
from flashtriton.reference import kvcache_reference
from flashtriton.testing import assert_checks_ok, check_error, check_lse, poisoned_outputs
from flashtriton.validate_checks import rotated_key_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class KVCase:
    batch: int = 3
    seqlen_q: int = 1
    seqlen_new: int = 1          # 0: no k/v appended
    capacity: int = 150
    num_heads: int = 4
    num_heads_k: int = 2
    head_dim: int = 64
    dtype: torch.dtype = torch.float16
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    rotary_dim: int = 0          # 0: no rotary
    rotary_interleaved: bool = True
    page_size: int = 0           # 0: contiguous cache
    batch_idx: bool = False
    leftpad: bool = False


def make_inputs(case: KVCase):
    gen = dict(device=DEVICE)
    q = torch.randn(case.batch, case.seqlen_q, case.num_heads, case.head_dim, **gen).to(case.dtype)
    lengths = torch.randint(0, case.capacity - case.seqlen_new + 1, (case.batch,), **gen).to(torch.int32)
    lengths[0] = case.capacity - case.seqlen_new  # one row fills the cache exactly
    inputs = dict(cache_seqlens=lengths)
    cache_rows = case.batch + 2 if case.batch_idx else case.batch
    if case.page_size:
        pages_per_row = -(-case.capacity // case.page_size)
        num_pages = case.batch * pages_per_row + 3
        table = torch.randperm(num_pages, **gen)[: case.batch * pages_per_row].view(case.batch, pages_per_row)
        inputs["block_table"] = table.to(torch.int32)
        cache_shape = (num_pages, case.page_size, case.num_heads_k, case.head_dim)
    else:
        cache_shape = (cache_rows, case.capacity, case.num_heads_k, case.head_dim)
    k_cache = torch.randn(cache_shape, **gen).to(case.dtype)
    v_cache = torch.randn(cache_shape, **gen).to(case.dtype)
    if case.seqlen_new:
        inputs["k"] = torch.randn(case.batch, case.seqlen_new, case.num_heads_k, case.head_dim, **gen).to(case.dtype)
        inputs["v"] = torch.randn_like(inputs["k"])
    if case.batch_idx:
        inputs["cache_batch_idx"] = torch.randperm(cache_rows, **gen)[: case.batch].to(torch.int32)
    if case.leftpad:
        inputs["cache_leftpad"] = torch.minimum(torch.randint(0, 40, (case.batch,), **gen).to(torch.int32), lengths)
    if case.rotary_dim:
        angles = torch.rand(case.capacity + 5, case.rotary_dim // 2, **gen) * 6.28
        inputs["rotary_cos"], inputs["rotary_sin"] = angles.cos().to(case.dtype), angles.sin().to(case.dtype)
        inputs["rotary_interleaved"] = case.rotary_interleaved
    if case.alibi:
        inputs["alibi_slopes"] = torch.rand(case.num_heads, **gen) * 0.3
    options = dict(causal=case.causal, window_size=case.window_size, softcap=case.softcap)
    return q, k_cache, v_cache, inputs, options


def run_and_check(case: KVCase):
    q, k_cache, v_cache, inputs, options = make_inputs(case)
    ref_out, ref_lse, ref_k, ref_v = kvcache_reference(q, k_cache, v_cache, **inputs, **options)
    pt_out, _, _, _ = kvcache_reference(q, k_cache, v_cache, **inputs, **options, compute_dtype=None)
    with poisoned_outputs():
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs, **options,
                                                       return_softmax_lse=True)
    factor = 5.0 if case.alibi else 3.0
    checks = [check_error("out", out, ref_out, pt_out, factor=factor), check_lse(lse, ref_lse)]
    assert_checks_ok(checks)
    assert torch.equal(v_cache, ref_v), "v_cache must be updated bit-exactly"
    if case.rotary_dim:
        torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=rotated_key_tolerance(ref_k))
    else:
        assert torch.equal(k_cache, ref_k), "k_cache must be updated bit-exactly without rotary"


CASES = {
    "decode": KVCase(),
    "decode-no-append": KVCase(seqlen_new=0),
    "chunk-causal": KVCase(seqlen_q=5, seqlen_new=5, causal=True),
    "sq2-append3": KVCase(seqlen_q=2, seqlen_new=3, causal=True),
    "window": KVCase(seqlen_q=2, seqlen_new=2, window_size=(20, 0)),
    "local-two-sided": KVCase(seqlen_q=5, seqlen_new=1, window_size=(30, 10)),
    "alibi-causal": KVCase(seqlen_q=5, seqlen_new=5, causal=True, alibi=True),
    "softcap": KVCase(seqlen_q=2, seqlen_new=1, softcap=4.0),
    "mqa-bf16": KVCase(num_heads=4, num_heads_k=1, dtype=torch.bfloat16, seqlen_q=2, seqlen_new=2, causal=True),
    "batch-idx": KVCase(batch_idx=True, seqlen_q=2, seqlen_new=2),
    "leftpad": KVCase(leftpad=True, seqlen_q=2, seqlen_new=1, causal=True),
    "leftpad-batch-idx-alibi": KVCase(leftpad=True, batch_idx=True, alibi=True, seqlen_q=1),
    "rotary-gptj-causal": KVCase(rotary_dim=32, seqlen_q=2, seqlen_new=2, causal=True),
    "rotary-neox-noncausal": KVCase(rotary_dim=64, rotary_interleaved=False, seqlen_q=5, seqlen_new=5),
    "rotary-partial-local": KVCase(rotary_dim=16, seqlen_q=2, seqlen_new=3, window_size=(25, 2), head_dim=48),
    "paged-16": KVCase(page_size=16, seqlen_q=2, seqlen_new=3, causal=True),
    "paged-48-rotary": KVCase(page_size=48, rotary_dim=32, seqlen_q=1, seqlen_new=1, capacity=144),
    "paged-7-gqa": KVCase(page_size=7, seqlen_q=5, seqlen_new=4, num_heads=6, num_heads_k=3, causal=True,
                          capacity=70),
}


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_kvcache_matches_reference(name):
    run_and_check(CASES[name])


@pytest.mark.parametrize("name", ["chunk-causal", "leftpad-batch-idx-alibi", "rotary-neox-noncausal"])
@pytest.mark.parametrize("heads", ["gqa-packed", "mha"])
def test_kvcache_through_tensor_descriptors(force_tma, name, heads):
    """In-kernel descriptors bounded by each row's cache length; packed GQA queries keep pointer loads for Q/O."""
    case = CASES[name] if heads == "gqa-packed" else replace(CASES[name], num_heads=2, num_heads_k=2)
    run_and_check(case)


def test_int_cache_seqlens_and_full_cache():
    case = KVCase(seqlen_new=0, seqlen_q=2)
    q, k_cache, v_cache, _, _ = make_inputs(case)
    out = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=37)
    expected, _, _, _ = kvcache_reference(q, k_cache, v_cache, cache_seqlens=37, compute_dtype=torch.float32)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-3)
    full = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache)
    expected_full, _, _, _ = kvcache_reference(q, k_cache, v_cache, compute_dtype=torch.float32)
    torch.testing.assert_close(full, expected_full, rtol=0, atol=2e-3)


def test_shared_read_only_pages():
    """Two rows whose block tables point at the same pages see the same keys."""
    case = KVCase(batch=2, page_size=16, seqlen_new=0, capacity=64, seqlen_q=1)
    q, k_cache, v_cache, inputs, _ = make_inputs(case)
    table = inputs["block_table"]
    table[1] = table[0]
    q[1] = q[0]
    lengths = torch.tensor([50, 50], dtype=torch.int32, device=DEVICE)
    out = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)
    assert torch.equal(out[0], out[1])


def test_no_autograd_and_fixed_result():
    case = KVCase(seqlen_q=2, seqlen_new=0)
    q, k_cache, v_cache, inputs, _ = make_inputs(case)
    q.requires_grad_()
    first = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs)
    second = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs)
    assert not first.requires_grad
    assert torch.equal(first, second)


def test_paged_capacity_error_mentions_block_table():
    case = KVCase(page_size=16, capacity=64, seqlen_new=2)
    q, k_cache, v_cache, inputs, _ = make_inputs(case)
    inputs["cache_seqlens"] = torch.full((case.batch,), 63, dtype=torch.int32, device=DEVICE)
    with pytest.raises(RuntimeError, match="block_table"):
        flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs)


@pytest.mark.parametrize("bad", ["k_cache-stride", "v_cache-stride", "k-without-v", "k-without-seqlens",
                                 "rotary-without-k", "cos-without-sin", "rotary-dim-15", "rotary-short-table",
                                 "num-splits", "paged-batch-idx", "paged-leftpad", "seqlens-shape",
                                 "seqlens-int16", "k-longer-than-cache", "k-dtype", "v-dtype",
                                 "leftpad-int64", "batch-idx-int64", "rotary-dim-above-head-dim", "rotary-dtype",
                                 "paged-table-int64", "paged-table-rows"])
def test_kvcache_errors(bad):
    """docs/api.md §6 rows of flash_attn_with_kvcache (seqlens_k contiguity is not reachable: the Python layer makes
    cache_seqlens contiguous first, as flash_attn's does)."""
    case = KVCase(seqlen_new=1, rotary_dim=32, page_size=16 if bad.startswith("paged") else 0)
    q, k_cache, v_cache, inputs, _ = make_inputs(case)
    expected = {
        "k_cache-stride": (AssertionError, "k_cache must have contiguous last dimension"),
        "v_cache-stride": (AssertionError, "v_cache must have contiguous last dimension"),
        "k-without-v": (RuntimeError, "If key is supplied, value must also be passed in"),
        "k-without-seqlens": (RuntimeError, "If key is supplied, seqlens_k must also be passed in"),
        "rotary-without-k": (RuntimeError, "new key / value to be appended to KV cache must also be provided"),
        "cos-without-sin": (RuntimeError, "If rotary cos is provided, rotary sin must also be provided"),
        "rotary-dim-15": (RuntimeError, "Only rotary dimensions divisible by 16 are currently supported"),
        "rotary-short-table": (RuntimeError, "cos/sin seqlen must be at least the seqlen of KV cache"),
        "num-splits": (RuntimeError, "num_splits > 128 not supported"),
        "paged-batch-idx": (RuntimeError, "Paged KVcache does not support cache_batch_idx"),
        "paged-leftpad": (RuntimeError, "We don't support Paged KV and leftpad_k running at the same time yet"),
        "seqlens-shape": (RuntimeError, "seqlens_k must have shape (batch_size)"),
        "seqlens-int16": (RuntimeError, "seqlens_k must have dtype int32"),
        "k-longer-than-cache": (RuntimeError, "If key is supplied, it must have seqlen <= the seqlen of the KV cache"),
        "k-dtype": (RuntimeError, "Key must have the same dtype as query"),
        "v-dtype": (RuntimeError, "Value must have the same dtype as query"),
        "leftpad-int64": (RuntimeError, "leftpad_k must have dtype int32"),
        "batch-idx-int64": (RuntimeError, "cache_batch_idx must have dtype int32"),
        "rotary-dim-above-head-dim": (RuntimeError, "rotary_dim must be <= headdim"),
        "rotary-dtype": (RuntimeError, "rotary_cos must have the same dtype as query"),
        "paged-table-int64": (RuntimeError, "block_table must have dtype torch.int32"),
        "paged-table-rows": (RuntimeError, "block_table must have shape (batch_size, max_num_blocks_per_seq)"),
    }[bad]
    if bad == "k_cache-stride":
        k_cache = k_cache.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif bad == "v_cache-stride":
        v_cache = v_cache.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif bad == "k-without-v":
        inputs.pop("v")
    elif bad == "k-without-seqlens":
        inputs.pop("cache_seqlens")
    elif bad == "rotary-without-k":
        inputs.pop("k"), inputs.pop("v")
    elif bad == "cos-without-sin":
        inputs.pop("rotary_sin")
    elif bad == "rotary-dim-15":
        inputs["rotary_cos"], inputs["rotary_sin"] = inputs["rotary_cos"][:, :15], inputs["rotary_sin"][:, :15]
    elif bad == "rotary-short-table":
        inputs["rotary_cos"], inputs["rotary_sin"] = inputs["rotary_cos"][:100], inputs["rotary_sin"][:100]
    elif bad == "num-splits":
        inputs["num_splits"] = 129
    elif bad == "paged-batch-idx":
        inputs["cache_batch_idx"] = torch.arange(case.batch, dtype=torch.int32, device=DEVICE)
    elif bad == "paged-leftpad":
        inputs["cache_leftpad"] = torch.zeros(case.batch, dtype=torch.int32, device=DEVICE)
    elif bad == "seqlens-shape":
        inputs["cache_seqlens"] = inputs["cache_seqlens"][:2]
    elif bad == "seqlens-int16":
        inputs["cache_seqlens"] = inputs["cache_seqlens"].to(torch.int16)
    elif bad == "k-longer-than-cache":
        longer = k_cache.shape[1] + 1
        inputs["k"] = torch.randn(case.batch, longer, *inputs["k"].shape[2:], device=DEVICE).to(q.dtype)
        inputs["v"] = torch.randn_like(inputs["k"])
        inputs.pop("rotary_cos"), inputs.pop("rotary_sin")
    elif bad == "k-dtype":
        inputs["k"] = inputs["k"].float()
    elif bad == "v-dtype":
        inputs["v"] = inputs["v"].float()
    elif bad == "leftpad-int64":
        inputs["cache_leftpad"] = torch.zeros(case.batch, dtype=torch.int64, device=DEVICE)
    elif bad == "batch-idx-int64":
        inputs["cache_batch_idx"] = torch.arange(case.batch, dtype=torch.int64, device=DEVICE)
    elif bad == "rotary-dim-above-head-dim":
        wide = torch.rand(inputs["rotary_cos"].shape[0], q.shape[-1], device=DEVICE).to(q.dtype)
        inputs["rotary_cos"], inputs["rotary_sin"] = wide, wide
    elif bad == "rotary-dtype":
        inputs["rotary_cos"], inputs["rotary_sin"] = inputs["rotary_cos"].float(), inputs["rotary_sin"].float()
    elif bad == "paged-table-int64":
        inputs["block_table"] = inputs["block_table"].long()
    elif bad == "paged-table-rows":
        inputs["block_table"] = torch.cat([inputs["block_table"], inputs["block_table"][:1]])
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(expected[0], match=expected[1].replace("(", r"\(").replace(")", r"\)")):
        flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "nothing may be written"


ON_GPU = DEVICE == "cuda"
SPLIT_CASES = ["decode", "paged-7-gqa", "chunk-causal", "leftpad-batch-idx-alibi", "local-two-sided"]
# The interpreter runs every split program in Python: CPU runs take fewer cases and split counts.
SPLIT_COUNTS = (1, 2, 3, 7, 0, 128) if ON_GPU else (1, 3, 0)


@pytest.mark.parametrize("name", SPLIT_CASES if ON_GPU else SPLIT_CASES[:2])
def test_every_num_splits_agrees_with_one(name):
    """Split-KV changes only rounding; each fixed split count is deterministic."""
    q, k_cache, v_cache, inputs, options = make_inputs(replace(CASES[name], seqlen_new=0, capacity=100))
    inputs.pop("rotary_cos", None), inputs.pop("rotary_sin", None), inputs.pop("rotary_interleaved", None)
    results = {}
    for splits in SPLIT_COUNTS:
        results[splits] = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs, **options,
                                                              num_splits=splits, return_softmax_lse=True)
    again = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs, **options, num_splits=3,
                                                return_softmax_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(again, results[3])), "num_splits=3 is not deterministic"
    out_one, lse_one = results[1]
    for splits, (out, lse) in results.items():
        torch.testing.assert_close(out.float(), out_one.float(), rtol=0, atol=2e-3, msg=f"num_splits={splits}")
        torch.testing.assert_close(lse, lse_one, rtol=1e-5, atol=1e-5, msg=f"num_splits={splits}")


def test_splits_with_no_visible_keys_merge_to_zero_and_inf():
    """Rows whose every key is out of the window: each split sees nothing, the merge gives 0 and +inf."""
    case = KVCase(seqlen_q=5, seqlen_new=0, capacity=120, window_size=(0, 0))
    q, k_cache, v_cache, inputs, _ = make_inputs(case)
    inputs["cache_seqlens"] = torch.tensor([0, 3, 120], dtype=torch.int32, device=DEVICE)
    out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs, window_size=(0, 0), num_splits=4,
                                                   return_softmax_lse=True)
    ref_out, ref_lse, _, _ = kvcache_reference(q, k_cache, v_cache, **inputs, window_size=(0, 0))
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and torch.all(out[torch.isinf(ref_lse).transpose(1, 2)] == 0)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=0, atol=2e-3)
