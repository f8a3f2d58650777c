"""Malformed index values reach the Triton kernels as they do on a GPU outside strict mode (host checks off:
testing.unchecked_indices), through the interpreter. docs/api.md §6: rows and pages out of range count as empty,
so each sequence's rows are clamped into its tensors, keys on a page outside the pool or in a cache row outside
the cache are absent (output 0, LSE +inf where a row sees no key) and appends outside the cache are dropped.

Every tensor a kernel reads or writes is a slice of a larger buffer whose guard regions hold a sentinel: an access
outside the tensor would read the sentinel into a result or overwrite it (the interpreter works on host memory).
Results are compared with a float64 reference of those semantics.
"""

import math

import pytest
import torch

import flashtriton
from flashtriton import testing
from flashtriton.ops import backend, kvcache

pytestmark = pytest.mark.skipif(not backend.KERNELS_INTERPRETED,
                                reason="the Triton kernels run on CPU only with TRITON_INTERPRET=1")

GUARD = 512
SENTINEL = 777.0
HEADS, HEADS_K, DIM = 2, 1, 16


class Guarded:
    """Allocates tensors inside sentinel-filled buffers and checks afterwards that every guard region is intact."""

    def __init__(self):
        self.buffers = []

    def tensor(self, shape, dtype, values=None):
        numel = math.prod(shape)
        fill = SENTINEL if dtype.is_floating_point else 0x5A5A
        buffer = torch.full((numel + 2 * GUARD,), fill, dtype=dtype)
        inside = buffer[GUARD:GUARD + numel].view(shape)
        if values is not None:
            inside.copy_(values)
        else:
            inside.fill_(float("nan") if dtype.is_floating_point else 0)
        self.buffers.append((buffer, numel, fill))
        return inside

    def like(self, tensor):
        return self.tensor(tuple(tensor.shape), tensor.dtype, tensor)

    def check(self):
        for buffer, numel, fill in self.buffers:
            guards = torch.cat([buffer[:GUARD], buffer[GUARD + numel:]])
            assert bool((guards == fill).all()), "a kernel wrote outside its tensor"


@pytest.fixture
def guarded(monkeypatch):
    """Library-allocated results come from guarded buffers too (NaN inside); host index checks are off."""
    guards = Guarded()
    allocate = lambda shape, dtype, device: guards.tensor(tuple(shape), dtype)  # noqa: E731
    monkeypatch.setattr(backend, "new_empty", allocate)
    monkeypatch.setattr(kvcache, "new_empty", allocate)
    with testing.unchecked_indices():
        yield guards
    guards.check()


def clamp_range(start: int, end: int, rows: int):
    start = min(max(start, 0), rows)
    return start, min(max(end, start), rows)


def attend(q, k, v, scale):
    """(out (M, H, D), lse (H, M)) of non-causal attention of rows q to keys k (GQA by head repetition); no keys:
    out 0, lse +inf."""
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=q.dtype)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("mhd,nhd->hmn", q, k) * scale
    return torch.einsum("hmn,nhd->mhd", scores.softmax(-1), v), scores.logsumexp(-1)


def reference(q, k, v, sequences, dout=None):
    """out, lse and (with dout) dq, dk, dv of the sequences [(q rows, k rows)] in float64 and in q's dtype."""
    results = []
    for dtype in (torch.float64, q.dtype):
        inputs = [t.detach().to(dtype).requires_grad_(dout is not None) for t in (q, k, v)]
        qd, kd, vd = inputs
        outs, lses = [], []
        for (q0, q1), (k0, k1) in sequences:
            out, lse = attend(qd[q0:q1], kd[k0:k1], vd[k0:k1], DIM ** -0.5)
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs), torch.cat(lses, dim=1)
        grads = None
        if dout is not None:
            grads = torch.autograd.grad(out, inputs, dout.to(dtype), allow_unused=True, materialize_grads=True)
        results.append((out.detach(), lse.detach(), grads))
    return results


def varlen_inputs(guards, total_q, total_k):
    q = guards.tensor((total_q, HEADS, DIM), torch.float16, torch.randn(total_q, HEADS, DIM))
    k = guards.tensor((total_k, HEADS_K, DIM), torch.float16, torch.randn(total_k, HEADS_K, DIM))
    v = guards.tensor((total_k, HEADS_K, DIM), torch.float16, torch.randn(total_k, HEADS_K, DIM))
    return q, k, v


def check_out_lse(out, lse, ref, pt, context):
    checks = [testing.check_error("out", out, ref[0], pt[0], atol=1e-3), testing.check_lse(lse, ref[1])]
    testing.assert_checks_ok(checks, context)


# (cu_seqlens_q, cu_seqlens_k, total_q, total_k): each sequence covers rows that no other sequence covers once
# clamped, so every row of the results is defined
VARLEN_CASES = {
    "last_entry_past_rows": ([0, 8, 27], [0, 10, 31], 20, 24),
    "negative_entry": ([0, -5, 20], [0, -3, 24], 20, 24),
    "keys_past_rows_leave_a_sequence_empty": ([0, 12, 20], [0, 30, 24], 20, 24),
}


@pytest.mark.parametrize("name", sorted(VARLEN_CASES))
def test_varlen_rows_out_of_range_are_clamped(guarded, name):
    """cu_seqlens outside [0, total rows], forward and backward: each sequence is clamped into the packed rows."""
    cu_q, cu_k, total_q, total_k = VARLEN_CASES[name]
    q, k, v = varlen_inputs(guarded, total_q, total_k)
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:])) + 5
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:])) + 5
    cu_q_t, cu_k_t = (guarded.like(torch.tensor(cu, dtype=torch.int32)) for cu in (cu_q, cu_k))
    out, lse, _, rng_state = backend.mha_varlen_fwd(q, k, v, cu_q_t, cu_k_t, max_q, max_k, 0.0, DIM ** -0.5, False)
    sequences = [(clamp_range(cu_q[b], cu_q[b + 1], total_q), clamp_range(cu_k[b], cu_k[b + 1], total_k))
                 for b in range(len(cu_q) - 1)]
    dout = torch.randn(total_q, HEADS, DIM).to(torch.float16)
    ref, pt = reference(q, k, v, sequences, dout)
    check_out_lse(out, lse, ref, pt, name)
    dq, dk, dv = (guarded.tensor(tuple(t.shape), t.dtype) for t in (q, k, v))
    backend.mha_varlen_bwd(guarded.like(dout), q, k, v, out, lse, dq, dk, dv, cu_q_t, cu_k_t, max_q, max_k, 0.0,
                           DIM ** -0.5, False, -1, -1, 0.0, None, False, rng_state)
    testing.assert_checks_ok([testing.check_error(label, grad, ref_grad, pt_grad, factor=3.0, atol=1e-3)
                              for label, grad, ref_grad, pt_grad in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2],
                                                                         pt[2])], name)


def paged_keys(pages, table, lengths, page_size):
    """Each row's keys gathered from the pool through its block-table row; a page outside the pool is absent."""
    rows = []
    for b, length in enumerate(lengths):
        ids = table[b, :math.ceil(length / page_size)].tolist()
        parts = [pages[i] if 0 <= i < pages.shape[0] else pages[:0, 0] for i in ids]
        kept = [part[:min(page_size, length - j * page_size)] for j, part in enumerate(parts)]
        rows.append(torch.cat(kept) if kept else pages[:0, 0])
    return rows


def test_paged_varlen_page_ids_out_of_range_are_absent(guarded):
    """A block-table entry >= num_blocks or < 0: that page's keys are masked and the pool is never left."""
    page_size, num_blocks = 16, 4
    lengths_q, lengths_k = [5, 7], [40, 30]
    table = torch.tensor([[0, 9, 1], [-2, 3, 2]], dtype=torch.int32)
    pool = torch.randn(num_blocks, page_size, HEADS_K, DIM).to(torch.float16)
    k_cache, v_cache = guarded.like(pool), guarded.like(torch.randn_like(pool.float()).to(torch.float16))
    q = guarded.tensor((sum(lengths_q), HEADS, DIM), torch.float16, torch.randn(sum(lengths_q), HEADS, DIM))
    cu_q, cu_k = (guarded.like(testing.cu_seqlens(lengths)) for lengths in (lengths_q, lengths_k))
    out, lse, _, _ = backend.mha_varlen_fwd(q, k_cache, v_cache, cu_q, cu_k, max(lengths_q), max(lengths_k), 0.0,
                                            DIM ** -0.5, False, block_table=guarded.like(table))
    keys = paged_keys(k_cache, table, lengths_k, page_size)
    values = paged_keys(v_cache, table, lengths_k, page_size)
    starts = [0, lengths_q[0]]
    refs = [reference(q[s:s + n], kb, vb, [((0, n), (0, kb.shape[0]))])
            for s, n, kb, vb in zip(starts, lengths_q, keys, values)]
    ref = (torch.cat([r[0][0] for r in refs]), torch.cat([r[0][1] for r in refs], dim=1))
    pt = (torch.cat([r[1][0] for r in refs]), torch.cat([r[1][1] for r in refs], dim=1))
    check_out_lse(out, lse, ref, pt, "paged varlen")


def kvcache_call(guarded, batch_cache, cache_len, seqlens, new, **kwargs):
    """flash_attn_with_kvcache on guarded caches and inputs; returns (out, lse, caches before, caches after)."""
    k_cache = guarded.like(torch.randn(batch_cache, cache_len, HEADS_K, DIM).to(torch.float16))
    v_cache = guarded.like(torch.randn(batch_cache, cache_len, HEADS_K, DIM).to(torch.float16))
    before = (k_cache.clone(), v_cache.clone())
    batch = len(seqlens)
    q = guarded.like(torch.randn(batch, 1, HEADS, DIM).to(torch.float16))
    k_new = guarded.like(torch.randn(batch, new, HEADS_K, DIM).to(torch.float16))
    v_new = guarded.like(torch.randn(batch, new, HEADS_K, DIM).to(torch.float16))
    kwargs = {name: guarded.like(value) for name, value in kwargs.items()}
    out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                   cache_seqlens=guarded.like(torch.tensor(seqlens, dtype=torch.int32)),
                                                   return_softmax_lse=True, **kwargs)
    return q, (k_new, v_new), out, lse, before, (k_cache, v_cache)


def test_kvcache_batch_idx_out_of_range_sees_no_key_and_drops_its_append(guarded):
    """cache_batch_idx >= the cache's batch or < 0: the row's output is 0, its LSE +inf, its new keys are not
    written anywhere; the valid rows append and attend as usual."""
    seqlens, new = [5, 3, 6], 2
    batch_idx = torch.tensor([1, 3, -1], dtype=torch.int32)
    q, (k_new, v_new), out, lse, before, after = kvcache_call(guarded, 2, 12, seqlens, new, cache_batch_idx=batch_idx)
    expected_k, expected_v = (t.clone() for t in before)
    expected_k[1, 5:7], expected_v[1, 5:7] = k_new[0], v_new[0]
    assert torch.equal(after[0], expected_k) and torch.equal(after[1], expected_v)
    ref, pt = reference(q[0], after[0][1, :7], after[1][1, :7], [((0, 1), (0, 7))])
    check_out_lse(out[0], lse[0], ref, pt, "valid row")
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    assert bool(torch.isposinf(lse[1:]).all())


@pytest.mark.parametrize("bad_page", [7, -1])
def test_kvcache_paged_page_ids_out_of_range_are_absent_and_not_written(guarded, bad_page):
    """A block-table entry outside [0, num_blocks): the append to that page is dropped and its keys are absent."""
    page_size, num_blocks, new = 8, 3, 3
    seqlens = [6, 9]
    # row 0 appends positions 6..8: position 8 lies on the bad page; row 1's first page is the bad entry
    table = torch.tensor([[0, bad_page], [bad_page, 2]], dtype=torch.int32)
    pool_k = guarded.like(torch.randn(num_blocks, page_size, HEADS_K, DIM).to(torch.float16))
    pool_v = guarded.like(torch.randn(num_blocks, page_size, HEADS_K, DIM).to(torch.float16))
    before = (pool_k.clone(), pool_v.clone())
    q = guarded.like(torch.randn(2, 1, HEADS, DIM).to(torch.float16))
    k_new = guarded.like(torch.randn(2, new, HEADS_K, DIM).to(torch.float16))
    v_new = guarded.like(torch.randn(2, new, HEADS_K, DIM).to(torch.float16))
    out, lse = flashtriton.flash_attn_with_kvcache(q, pool_k, pool_v, k_new, v_new,
                                                   cache_seqlens=guarded.like(torch.tensor(seqlens, dtype=torch.int32)),
                                                   block_table=guarded.like(table), return_softmax_lse=True)
    expected_k, expected_v = (t.clone() for t in before)
    expected_k[0, 6:8], expected_v[0, 6:8] = k_new[0, :2], v_new[0, :2]
    expected_k[2, 1:4], expected_v[2, 1:4] = k_new[1], v_new[1]
    assert torch.equal(pool_k, expected_k) and torch.equal(pool_v, expected_v)
    lengths = [s + new for s in seqlens]
    keys = paged_keys(pool_k, table, lengths, page_size)
    values = paged_keys(pool_v, table, lengths, page_size)
    for b in range(2):
        ref, pt = reference(q[b], keys[b], values[b], [((0, 1), (0, keys[b].shape[0]))])
        check_out_lse(out[b], lse[b], ref, pt, f"row {b}")


def test_kvcache_seqlens_out_of_range_stay_in_the_cache(guarded):
    """cache_seqlens past the capacity or negative (contiguous cache): appends outside [0, capacity) are dropped and
    each row sees its keys clamped into the cache."""
    capacity, new = 8, 3
    seqlens = [7, -2]
    q, (k_new, v_new), out, lse, before, after = kvcache_call(guarded, 2, capacity, seqlens, new)
    expected_k, expected_v = (t.clone() for t in before)
    expected_k[0, 7], expected_v[0, 7] = k_new[0, 0], v_new[0, 0]
    expected_k[1, 0], expected_v[1, 0] = k_new[1, 2], v_new[1, 2]
    assert torch.equal(after[0], expected_k) and torch.equal(after[1], expected_v)
    for b, keys in enumerate((capacity, 1)):
        ref, pt = reference(q[b], after[0][b, :keys], after[1][b, :keys], [((0, 1), (0, keys))])
        check_out_lse(out[b], lse[b], ref, pt, f"row {b}")
