"""Index values of CPU calls (docs/api.md §6): cu_seqlens, max_seqlen, block_table, seqused_k, leftpad_k,
cache_batch_idx, cache_seqlens and cache_leftpad are checked on the host before anything runs, on both CPU paths:
the Triton kernels under the interpreter (TRITON_INTERPRET=1 at import) and the PyTorch reference path. A bad value
raises a RuntimeError that names the argument and the value, and nothing is launched or written; valid edge values
(empty sequences, cu_seqlens ending exactly at the rows, garbage in block_table entries a sequence does not use)
still give the float64 reference's result.
"""

import re
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

import flashtriton
from flashtriton.flash_attn_interface import _flash_attn_varlen_backward, _flash_attn_varlen_forward
from flashtriton.ops import backend, kvcache, reference_path
from flashtriton.reference import kvcache_reference
from flashtriton.testing import (assert_checks_ok, check_error, check_lse, compare_varlen_with_reference, cu_seqlens,
                                 poisoned_outputs)

H, HK, D = 2, 1, 16
FP16 = torch.float16
PAGE = 4


@pytest.fixture(params=["kernels", "reference"])
def cpu_path(request, monkeypatch):
    """The CPU path under test: the Triton kernels through the interpreter (only when the kernels were decorated
    with TRITON_INTERPRET=1), or the PyTorch reference path (backend.runs_triton False for CPU tensors)."""
    if request.param == "kernels":
        if not backend.KERNELS_INTERPRETED:
            pytest.skip("the Triton kernels run on CPU only with TRITON_INTERPRET=1")
    else:
        monkeypatch.setattr(backend, "KERNELS_INTERPRETED", False)
    assert backend.runs_triton(torch.empty(0)) == (request.param == "kernels")
    return request.param


def _launched(*args, **kwargs):
    raise AssertionError("launched")


@pytest.fixture
def no_launch(monkeypatch):
    """Every kernel launch and reference-path entry raises AssertionError("launched"): a check that is missing or
    comes too late fails the test instead of reading out of bounds."""
    for module, name in ((backend, "launch_fwd"), (backend, "launch_bwd"), (kvcache, "launch_fwd"),
                         (kvcache, "_append"), (kvcache, "apply_rotary")):
        monkeypatch.setattr(module, name, _launched)
    for name in ("dense_forward", "dense_backward", "varlen_forward", "varlen_backward", "kvcache_forward"):
        monkeypatch.setattr(reference_path, name, _launched)


def _tensor(*shape):
    return torch.randn(*shape).to(FP16)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32)


def _rejects(call, message: str):
    """call() raises RuntimeError whose message contains `message` (the argument and its bad value)."""
    with pytest.raises(RuntimeError, match=re.escape(message)) as excinfo:
        call()
    assert not isinstance(excinfo.value, NotImplementedError)


# ------------------------------------------------------------------------------------------------------------
# Varlen: flash_attn_varlen_func, the low-level forward (seqused_k, leftpad_k) and the low-level backward
# ------------------------------------------------------------------------------------------------------------

LENS_Q, LENS_K = (3, 5), (4, 6)  # cu_seqlens end exactly at the rows of q and k


@dataclass(frozen=True)
class Varlen:
    """One varlen call with contiguous (or, with block_table, paged) keys; the defaults are valid."""

    cu_q: list = field(default_factory=lambda: [0, 3, 8])
    cu_k: list = field(default_factory=lambda: [0, 4, 10])
    max_q: int = 5
    max_k: int = 6
    block_table: Optional[list] = None  # with PAGED_BLOCKS pages of PAGE keys
    seqused_k: Optional[list] = None
    leftpad_k: Optional[list] = None


PAGED_BLOCKS = 5
PAGED = dict(block_table=[[0, 3], [1, 2]])  # sequence 0 uses one page, sequence 1 two


def _varlen_inputs(case: Varlen):
    q = _tensor(sum(LENS_Q), H, D)
    if case.block_table is None:
        k, v = _tensor(sum(LENS_K), HK, D), _tensor(sum(LENS_K), HK, D)
    else:
        k, v = _tensor(PAGED_BLOCKS, PAGE, HK, D), _tensor(PAGED_BLOCKS, PAGE, HK, D)
    optional = {name: None if getattr(case, name) is None else _int32(getattr(case, name))
                for name in ("block_table", "seqused_k", "leftpad_k")}
    return q, k, v, _int32(case.cu_q), _int32(case.cu_k), optional


def _varlen_func(case: Varlen):
    q, k, v, cu_q, cu_k, optional = _varlen_inputs(case)
    return lambda: flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, case.max_q, case.max_k,
                                                      block_table=optional["block_table"])


def _varlen_low_level(case: Varlen):
    q, k, v, cu_q, cu_k, optional = _varlen_inputs(case)
    return lambda: _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, case.max_q, case.max_k, 0.0, 0.25, False,
                                              **optional)


def _varlen_backward(case: Varlen):
    q, k, v, cu_q, cu_k, _ = _varlen_inputs(case)
    out, dout = _tensor(*q.shape), _tensor(*q.shape)
    lse = torch.randn(H, q.shape[0])
    grads = [torch.empty_like(t) for t in (q, k, v)]
    return lambda: _flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, cu_q, cu_k, case.max_q, case.max_k,
                                               0.0, 0.25, False, -1, -1, 0.0, None, False,
                                               torch.zeros(2, dtype=torch.int64))


VARLEN_CASES = {
    "cu-q-start": (_varlen_func, Varlen(cu_q=[1, 3, 8]), "cu_seqlens_q must start at 0, got cu_seqlens_q[0] = 1"),
    "cu-k-decreasing": (_varlen_func, Varlen(cu_k=[0, 7, 4], max_k=7),
                        "cu_seqlens_k must be non-decreasing, got cu_seqlens_k[2] = 4 < cu_seqlens_k[1] = 7"),
    "cu-q-past-rows": (_varlen_func, Varlen(cu_q=[0, 3, 9], max_q=6),
                       "cu_seqlens_q must end at most at q.shape[0] (total_q) = 8, got cu_seqlens_q[2] = 9"),
    "cu-k-past-rows": (_varlen_func, Varlen(cu_k=[0, 4, 11], max_k=7),
                       "cu_seqlens_k must end at most at k.shape[0] (total_k) = 10, got cu_seqlens_k[2] = 11"),
    "max-seqlen-q-short": (_varlen_func, Varlen(max_q=4),
                           "max_seqlen_q must be >= the length of every sequence, got max_seqlen_q = 4 < "
                           "cu_seqlens_q[2] - cu_seqlens_q[1] = 5"),
    "max-seqlen-k-short": (_varlen_func, Varlen(max_k=5),
                           "got max_seqlen_k = 5 < cu_seqlens_k[2] - cu_seqlens_k[1] = 6"),
    "paged-sequence-past-table": (_varlen_func, Varlen(cu_k=[0, 4, 13], max_k=9, **PAGED),
                                  "sequence 1 has cu_seqlens_k[2] - cu_seqlens_k[1] = 9 keys, more than block_table "
                                  "addresses (max_num_blocks_per_seq * page_block_size = 2 * 4 = 8)"),
    "paged-block-id-past-pool": (_varlen_func, Varlen(block_table=[[0, 3], [1, 5]]),
                                 "block_table entries must be in [0, num_blocks) = [0, 5) for the pages a sequence "
                                 "uses, got block_table[1, 1] = 5"),
    "paged-block-id-negative": (_varlen_func, Varlen(block_table=[[-1, 3], [1, 2]]), "got block_table[0, 0] = -1"),
    "paged-block-id-within-seqused": (_varlen_low_level, Varlen(block_table=[[0, 3], [1, 7]], seqused_k=[4, 5]),
                                      "got block_table[1, 1] = 7"),
    "seqused-k-past-length": (_varlen_low_level, Varlen(seqused_k=[4, 7]),
                              "seqused_k[1] must be in [0, cu_seqlens_k[2] - cu_seqlens_k[1]] = [0, 6], got "
                              "seqused_k[1] = 7"),
    "seqused-k-negative": (_varlen_low_level, Varlen(seqused_k=[-1, 6]), "got seqused_k[0] = -1"),
    "leftpad-k-past-seqused": (_varlen_low_level, Varlen(seqused_k=[2, 6], leftpad_k=[3, 0]),
                               "leftpad_k[0] must be in [0, seqused_k[0]] = [0, 2], got leftpad_k[0] = 3"),
    "leftpad-k-past-length": (_varlen_low_level, Varlen(leftpad_k=[0, 7]),
                              "leftpad_k[1] must be in [0, cu_seqlens_k[2] - cu_seqlens_k[1]] = [0, 6], got "
                              "leftpad_k[1] = 7"),
    "leftpad-k-negative": (_varlen_low_level, Varlen(leftpad_k=[0, -2]), "got leftpad_k[1] = -2"),
    "max-seqlen-k-below-used-keys": (_varlen_low_level, Varlen(seqused_k=[4, 6], leftpad_k=[0, 1], max_k=4),
                                     "got max_seqlen_k = 4 < seqused_k[1] - leftpad_k[1] = 5"),
    "backward-cu-q-past-rows": (_varlen_backward, Varlen(cu_q=[0, 3, 9], max_q=6), "got cu_seqlens_q[2] = 9"),
    "backward-cu-k-negative-start": (_varlen_backward, Varlen(cu_k=[-2, 4, 10], max_k=8),
                                     "cu_seqlens_k must start at 0, got cu_seqlens_k[0] = -2"),
    "backward-max-seqlen-q-short": (_varlen_backward, Varlen(max_q=3), "got max_seqlen_q = 3 < "),
}


@pytest.mark.parametrize("make,case,message", VARLEN_CASES.values(), ids=VARLEN_CASES.keys())
def test_varlen_index_values_are_checked(cpu_path, no_launch, make, case, message):
    _rejects(make(case), message)


def test_valid_varlen_calls_reach_the_launch(cpu_path, no_launch):
    """The cases above fail on their own value: the same calls with the default values get to the launch."""
    for make, case in ((_varlen_func, Varlen()), (_varlen_func, Varlen(**PAGED)),
                       (_varlen_low_level, Varlen(seqused_k=[4, 6], leftpad_k=[4, 0])), (_varlen_backward, Varlen())):
        with pytest.raises(AssertionError, match="launched"):
            make(case)()


# ------------------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache
# ------------------------------------------------------------------------------------------------------------

CACHE_ROWS, CAPACITY = 3, 8


@dataclass(frozen=True)
class KV:
    """One flash_attn_with_kvcache call (batch 2, one query, two new keys); the defaults are valid and the second
    row fills its cache row exactly. Paged: block_table over PAGED_BLOCKS pages of PAGE keys."""

    cache_seqlens: object = field(default_factory=lambda: [3, 6])  # a list becomes an int32 tensor; an int stays
    seqlen_new: int = 2
    cache_batch_idx: Optional[list] = None
    cache_leftpad: Optional[list] = None
    block_table: Optional[list] = None
    rotary: bool = False


def _kv_inputs(case: KV):
    q = _tensor(2, 1, H, D)
    cache_shape = (PAGED_BLOCKS, PAGE, HK, D) if case.block_table is not None else (CACHE_ROWS, CAPACITY, HK, D)
    k_cache, v_cache = _tensor(*cache_shape), _tensor(*cache_shape)
    inputs = {name: _int32(getattr(case, name)) for name in ("cache_batch_idx", "cache_leftpad", "block_table")
              if getattr(case, name) is not None}
    seqlens = case.cache_seqlens
    inputs["cache_seqlens"] = _int32(seqlens) if isinstance(seqlens, list) else seqlens
    if case.seqlen_new:
        inputs["k"], inputs["v"] = _tensor(2, case.seqlen_new, HK, D), _tensor(2, case.seqlen_new, HK, D)
    if case.rotary:
        angles = torch.rand(CAPACITY, D // 2) * 6.28
        inputs["rotary_cos"], inputs["rotary_sin"] = angles.cos().to(FP16), angles.sin().to(FP16)
    return q, k_cache, v_cache, inputs


KV_CASES = {
    "batch-idx-past-cache": (KV(cache_batch_idx=[0, 3]),
                             "cache_batch_idx must be in [0, batch_size_cache) = [0, 3) (the rows of k_cache), got "
                             "cache_batch_idx[1] = 3"),
    "batch-idx-negative": (KV(cache_batch_idx=[-1, 0]), "got cache_batch_idx[0] = -1"),
    "seqlens-negative": (KV(cache_seqlens=[-1, 2]), "cache_seqlens must be >= 0, got cache_seqlens[0] = -1"),
    "seqlens-int-negative": (KV(cache_seqlens=-1, seqlen_new=0), "cache_seqlens must be >= 0, got -1"),
    "seqlens-past-capacity": (KV(cache_seqlens=[3, 7]),
                              "cache_seqlens[b] + seqlen_new (k.shape[1]) must be <= the capacity of a cache row (8), "
                              "got cache_seqlens[1] + 2 = 9"),
    "seqlens-past-capacity-rotary": (KV(cache_seqlens=[7, 3], rotary=True), "got cache_seqlens[0] + 2 = 9"),
    "seqlens-past-capacity-no-append": (KV(cache_seqlens=[9, 0], seqlen_new=0), "got cache_seqlens[0] + 0 = 9"),
    "leftpad-past-seqlens": (KV(cache_leftpad=[4, 0]),
                             "cache_leftpad[0] must be in [0, cache_seqlens[0]] = [0, 3], got cache_leftpad[0] = 4"),
    "leftpad-negative": (KV(cache_leftpad=[0, -1]), "got cache_leftpad[1] = -1"),
    "paged-block-id-past-pool": (KV(cache_seqlens=[1, 5], block_table=[[0, 9], [1, 5]]),
                                 "block_table entries must be in [0, num_blocks) = [0, 5) for the pages a sequence "
                                 "uses, got block_table[1, 1] = 5"),
    "paged-block-id-negative": (KV(cache_seqlens=[0, 0], block_table=[[-3, 1], [2, 4]]), "got block_table[0, 0] = -3"),
    "paged-full-cache-block-id": (KV(cache_seqlens=None, seqlen_new=0, block_table=[[0, 1], [2, -1]]),
                                  "got block_table[1, 1] = -1"),
    "paged-past-capacity": (KV(cache_seqlens=[1, 7], block_table=[[0, 1], [2, 3]]),
                            "exceeds the capacity addressable by block_table"),
}


@pytest.mark.parametrize("case,message", KV_CASES.values(), ids=KV_CASES.keys())
def test_kvcache_index_values_are_checked(cpu_path, no_launch, case, message):
    q, k_cache, v_cache, inputs = _kv_inputs(case)
    before = (k_cache.clone(), v_cache.clone())
    _rejects(lambda: flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs), message)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "nothing may be written"


def test_valid_kvcache_calls_reach_the_launch(cpu_path, no_launch):
    for case in (KV(), KV(cache_batch_idx=[2, 0], cache_leftpad=[3, 0]), KV(cache_seqlens=8, seqlen_new=0),
                 KV(cache_seqlens=[1, 5], block_table=[[0, 9], [1, 4]]), KV(cache_seqlens=[3, 6], rotary=True)):
        q, k_cache, v_cache, inputs = _kv_inputs(case)
        with pytest.raises(AssertionError, match="launched"):
            flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs)


# ------------------------------------------------------------------------------------------------------------
# Valid edge values compute the reference's result on both paths
# ------------------------------------------------------------------------------------------------------------


def _gathered(cache: torch.Tensor, block_table: torch.Tensor, lengths) -> torch.Tensor:
    """(sum(lengths), Hk, D) keys of a paged cache, sequence after sequence."""
    rows = []
    for b, length in enumerate(lengths):
        positions = torch.arange(length)
        rows.append(cache[block_table[b, positions // PAGE].long(), positions % PAGE])
    return torch.cat(rows)


def test_varlen_empty_sequences_and_cu_seqlens_ending_at_the_rows(cpu_path):
    """Empty query and key sequences, cu_seqlens ending exactly at the rows, max_seqlen equal to the longest."""
    lens_q, lens_k = (3, 0, 5, 2), (4, 6, 0, 3)
    q = _tensor(sum(lens_q), H, D).requires_grad_()
    k, v = (_tensor(sum(lens_k), HK, D).requires_grad_() for _ in range(2))
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                         return_attn_probs=True)
        dout = _tensor(*out.shape)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_checks_ok(compare_varlen_with_reference(out, lse, q, k, v, cu_q, cu_k, max(lens_k), grads, dout,
                                                   causal=True))


def test_paged_varlen_ignores_unused_block_table_entries(cpu_path):
    """block_table entries past a sequence's pages hold garbage (out of the pool, negative): never read."""
    lens_q, lens_k = (2, 3, 1), (4, 6, 0)
    block_table = _int32([[3, 1000, -7], [0, 2, 99], [-1, -1, -1]])
    k_cache, v_cache = _tensor(PAGED_BLOCKS, PAGE, HK, D), _tensor(PAGED_BLOCKS, PAGE, HK, D)
    q, cu_q, cu_k = _tensor(sum(lens_q), H, D), cu_seqlens(lens_q), cu_seqlens(lens_k)
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k),
                                                         block_table=block_table, return_attn_probs=True)
    k, v = _gathered(k_cache, block_table, lens_k), _gathered(v_cache, block_table, lens_k)
    assert_checks_ok(compare_varlen_with_reference(out, lse, q, k, v, cu_q, cu_k, max(lens_k)))


def test_paged_varlen_with_seqused_reads_only_the_used_pages(cpu_path):
    """With seqused_k, the block_table entries past each sequence's used keys (within its cu_seqlens_k slot) hold
    garbage: never read, on either path."""
    lens_q, slots, used = (2, 3), (4, 12), (4, 4)
    block_table = _int32([[0, 0, 0], [1, 99, -3]])
    k_cache, v_cache = _tensor(PAGED_BLOCKS, PAGE, HK, D), _tensor(PAGED_BLOCKS, PAGE, HK, D)
    q, cu_q, cu_k = _tensor(sum(lens_q), H, D), cu_seqlens(lens_q), cu_seqlens(slots)
    with poisoned_outputs():
        out, lse, _, _ = _flash_attn_varlen_forward(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(used), 0.0,
                                                    0.25, False, block_table=block_table, seqused_k=_int32(used))
    k, v = _gathered(k_cache, block_table, used), _gathered(v_cache, block_table, used)
    assert_checks_ok(compare_varlen_with_reference(out, lse, q, k, v, cu_q, cu_seqlens(used), max(used),
                                                   softmax_scale=0.25))


def test_seqused_and_leftpad_at_their_bounds(cpu_path):
    """seqused_k = 0 and = the slot's length; leftpad_k = 0 and = seqused_k (a sequence with no keys)."""
    lens_q, slots = (2, 3, 1), (4, 6, 3)
    seqused, leftpad = _int32([0, 6, 3]), _int32([0, 2, 3])
    q, cu_q, cu_k = _tensor(sum(lens_q), H, D), cu_seqlens(lens_q), cu_seqlens(slots)
    k, v = _tensor(sum(slots), HK, D), _tensor(sum(slots), HK, D)
    with poisoned_outputs():
        out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), 4, 0.0, 0.25, False,
                                                    leftpad_k=leftpad, seqused_k=seqused)
    kept = torch.cat([torch.arange(int(cu_k[b] + leftpad[b]), int(cu_k[b] + seqused[b])) for b in range(3)])
    cu_kept = cu_seqlens((seqused - leftpad).tolist())
    assert_checks_ok(compare_varlen_with_reference(out, lse, q, k[kept], v[kept], cu_q, cu_kept, 4,
                                                   softmax_scale=0.25))


@pytest.mark.parametrize("case", [
    pytest.param(KV(cache_seqlens=[6, 0], cache_batch_idx=[2, 0], cache_leftpad=[6, 0]),
                 id="full-row-last-cache-row-leftpad-at-seqlens"),
    pytest.param(KV(cache_seqlens=[1, 6], block_table=[[2, -5], [4, 0]]), id="paged-garbage-past-used-pages"),
    pytest.param(KV(cache_seqlens=None, seqlen_new=0, block_table=[[4, 0], [0, 3]]), id="paged-full-capacity"),
])
def test_kvcache_edge_values(cpu_path, case):
    q, k_cache, v_cache, inputs = _kv_inputs(case)
    ref_out, ref_lse, ref_k, ref_v = kvcache_reference(q, k_cache, v_cache, **inputs)
    pt_out, _, _, _ = kvcache_reference(q, k_cache, v_cache, **inputs, compute_dtype=None)
    with poisoned_outputs():
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, **inputs, return_softmax_lse=True)
    assert_checks_ok([check_error("out", out, ref_out, pt_out, factor=3.0), check_lse(lse, ref_lse)])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
