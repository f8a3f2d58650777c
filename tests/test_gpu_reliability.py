"""Reliability on a GPU: CUDA graphs, tensors past 2**31 elements, device guards, bitwise repeatability, malformed
index values (edge values that also run on a CPU: tests/test_edge_values.py).

The GPU tests need compiled kernels on a CUDA device and are skipped elsewhere (and under TRITON_INTERPRET=1).

On the GPU:
    PYTHONPATH=. python -m pytest -q tests/test_gpu_reliability.py                # everything
    PYTHONPATH=. python -m pytest -q tests/test_gpu_reliability.py -k huge        # only the > 2**31-element tests
    PYTHONPATH=. python -m pytest -q tests/test_gpu_reliability.py -k "not huge"
Each huge test stays below ~45 GB of GPU memory and skips itself when less is free.
Sizes, device names and the graph capture are module-level names, so the test logic can be rehearsed with small
shapes on a CPU by rebinding them (nothing in this file does that by itself).
"""

import gc

import pytest
import torch

import flashtriton
from flashtriton.ops import backend
from flashtriton.reference import kvcache_reference
from flashtriton.testing import (Case, assert_checks_ok, check_error, check_lse, compare_with_reference, cu_seqlens,
                                 poisoned_outputs)
from flashtriton.validate_checks import rotated_key_tolerance

COMPILED_GPU = torch.cuda.is_available() and not backend.KERNELS_INTERPRETED
TWO_GPUS = COMPILED_GPU and torch.cuda.device_count() >= 2

gpu_only = pytest.mark.skipif(not COMPILED_GPU,
                              reason="needs a CUDA GPU running the compiled Triton kernels (TRITON_INTERPRET unset)")
two_gpus_only = pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs running the compiled Triton kernels")

GPU = "cuda"                      # device of the GPU-only tests
DEV0, DEV1 = "cuda:0", "cuda:1"   # devices of the two-GPU tests
INT32_MAX = 2**31 - 1

# (b) huge shapes
HUGE_DENSE = dict(batch=33000, seqlen=512, heads=1, dim=128)            # 2.16e9 elements per tensor
HUGE_KEYS = dict(seqlen_q=64, seqlen_k=2**20 + 257, heads=16, dim=128)  # key row n at element n * 2048
HUGE_KEYS_WINDOW, HUGE_KEYS_REF_TAIL, HUGE_KEYS_HOT = 255, 1024, 300
HUGE_KV_CAPACITY = 2**21 + 64     # (8, capacity, 1, 128) caches
HUGE_PAGES = dict(num_pages=2**18 + 320, pages_per_row=256, page=64)
GRID_BATCH = 4100                 # x 16 heads > 65535
# (d)
REPEATS = 100
RACE_SEQLEN = 1024


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    free_cached_memory()


def free_cached_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device=None):
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)


def require_free_gib(gib: float) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")


def compiled_variants():
    """How many kernel binaries Triton holds for the kv-cache path's kernels (None if this Triton hides it)."""
    from flashtriton.kernels.append import kv_append_kernel
    from flashtriton.kernels.combine import attn_combine_kernel
    from flashtriton.kernels.fwd import attn_fwd_kernel
    from flashtriton.kernels.rotary import rotary_kernel

    try:
        return sum(len(cache[0]) for kernel in (attn_fwd_kernel, attn_combine_kernel, kv_append_kernel, rotary_kernel)
                   for cache in kernel.device_caches.values())
    except (AttributeError, TypeError, IndexError):
        return None


def kvcache_checks(out, lse, ref_out, ref_lse, pt_out, factor=3.0):
    """The kv-cache tolerance rule (docs/api.md §4.10: 3x PyTorch's own error + 1e-5) and the LSE check."""
    return [check_error("out", out, ref_out, pt_out, factor=factor), check_lse(lse, ref_lse)]


def all_written(**tensors):
    """Results computed under poisoned_outputs(): a NaN means an element no kernel wrote."""
    for name, tensor in tensors.items():
        assert not tensor.isnan().any(), f"{name} has NaN: some elements were never written"


# ------------------------------------------------------------------------------------------------------------
# (a) CUDA graphs: capture one decode step, replay it for other lengths
# ------------------------------------------------------------------------------------------------------------


def capture_graph(step):
    """Warm `step` up on a side stream (Triton compiles at the first launch, which cannot happen inside a capture),
    capture one call in a CUDA graph. Returns (replay, the call's outputs: the graph's static output tensors)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph.replay, outputs


GRAPH_LENGTHS = ([0, 1, 64, 1023], [1023, 1023, 1023, 1023], [127, 128, 129, 700], [5, 900, 0, 333])


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_splits", [0, 3], ids=["splits-auto", "splits-3"])
@pytest.mark.parametrize("layout", ["contiguous", "paged", "contiguous-rotary"])
def test_cuda_graph_decode_replay(layout, num_splits):
    """One decode step (Sq=1, GQA 8/2, d128, bf16, append one k/v token, int32 cache_seqlens tensor; paged: page
    size 64) captured in a CUDA graph and replayed after copying new q/k/v and new lengths into the captured tensors:
    every replay equals an eager call bit for bit, matches the float64 reference and leaves the appended k/v in
    the cache. No kernel is recompiled after the warm-up."""
    batch, heads, heads_k, dim, dtype, capacity, page = 4, 8, 2, 128, torch.bfloat16, 1024, 64
    if layout == "paged":
        pages_per_row = capacity // page
        num_pages = batch * pages_per_row + 7
        block_table = torch.randperm(num_pages, device=GPU)[: batch * pages_per_row].view(batch, pages_per_row)
        block_table = block_table.to(torch.int32)
        cache_shape = (num_pages, page, heads_k, dim)
    else:
        block_table = None
        cache_shape = (batch, capacity, heads_k, dim)
    k_cache = torch.randn(cache_shape, device=GPU, dtype=dtype)
    v_cache = torch.randn(cache_shape, device=GPU, dtype=dtype)
    q = torch.randn(batch, 1, heads, dim, device=GPU, dtype=dtype)
    k_new = torch.randn(batch, 1, heads_k, dim, device=GPU, dtype=dtype)
    v_new = torch.randn(batch, 1, heads_k, dim, device=GPU, dtype=dtype)
    cache_seqlens = torch.tensor([3, 200, 511, 1000], dtype=torch.int32, device=GPU)
    rotary = {}
    if layout.endswith("rotary"):
        angles = torch.rand(capacity, 32, device=GPU) * 6.28  # rotary_dim 64 of 128
        rotary = dict(rotary_cos=angles.cos().to(dtype), rotary_sin=angles.sin().to(dtype), rotary_interleaved=False)

    def step(k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens):
        return flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                   block_table=block_table, num_splits=num_splits,
                                                   return_softmax_lse=True, **rotary)

    replay, (static_out, static_lse) = capture_graph(step)
    compiled = compiled_variants()

    for lengths in GRAPH_LENGTHS:
        q.copy_(torch.randn_like(q))
        k_new.copy_(torch.randn_like(k_new))
        v_new.copy_(torch.randn_like(v_new))
        cache_seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        k_before, v_before = k_cache.clone(), v_cache.clone()
        replay()
        sync()

        k_eager, v_eager = k_before.clone(), v_before.clone()
        eager_out, eager_lse = step(k_eager, v_eager, cache_seqlens.clone())
        assert torch.equal(static_out, eager_out) and torch.equal(static_lse, eager_lse), \
            f"lengths {lengths}: the replay differs from an eager call"
        assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager), \
            f"lengths {lengths}: the replay's appended k/v differ from an eager call's"

        inputs = dict(cache_seqlens=cache_seqlens, block_table=block_table, **rotary)
        ref_out, ref_lse, ref_k, ref_v = kvcache_reference(q, k_before, v_before, k_new, v_new, **inputs)
        pt_out = kvcache_reference(q, k_before, v_before, k_new, v_new, **inputs, compute_dtype=None)[0]
        checks = kvcache_checks(static_out, static_lse, ref_out, ref_lse, pt_out)
        if rotary:
            # The kernel and the reference each round the rotated q and k to bf16, and may land one ulp apart
            # (FMA vs separate multiply-add); that moves scores, hence the LSE, by ~1e-2, past check_lse's 1e-4.
            checks = checks[:1]
            torch.testing.assert_close(static_lse, ref_lse, rtol=0, atol=5e-2)
        assert_checks_ok(checks, f"lengths {lengths}")
        assert torch.equal(v_cache, ref_v), f"lengths {lengths}: v_cache must hold the appended values bit-exactly"
        if rotary:
            torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=rotated_key_tolerance(ref_k))
        else:
            assert torch.equal(k_cache, ref_k), f"lengths {lengths}: k_cache must hold the appended keys bit-exactly"
    if compiled is not None:
        assert compiled_variants() == compiled, "new lengths recompiled a kernel"


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("head_dim", [128, 256], ids=["d128", "d256"])
def test_cuda_graph_training_step_replay(head_dim):
    """A training step (forward through autograd, then torch.autograd.grad; causal, GQA 4/2, bf16, odd length)
    captured in a CUDA graph and replayed after copying new q, k, v and dout into the captured tensors: every
    replay's out, lse, dk and dv equal an eager step's bit for bit, and out, lse and every gradient pass the
    tolerance rule against the float64 reference (dq too: at d128 it is added by TMA reductions in no fixed order,
    so it is not compared bitwise). BENCHMARKS.md's fwd+bwd-graph rows time such a step; README advises it for
    short calls. d128 runs the Gluon forward and backward on sm_90, d256 the Gluon forward and Triton backward."""
    case = Case(batch=2, seqlen_q=300, seqlen_k=300, num_heads=4, num_heads_k=2, head_dim=head_dim,
                dtype=torch.bfloat16, causal=True)
    q = torch.randn(2, 300, 4, head_dim, device=GPU, dtype=case.dtype, requires_grad=True)
    k = torch.randn(2, 300, 2, head_dim, device=GPU, dtype=case.dtype, requires_grad=True)
    v = torch.randn(2, 300, 2, head_dim, device=GPU, dtype=case.dtype, requires_grad=True)
    dout = torch.randn_like(q)

    def step():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return (out, lse) + torch.autograd.grad(out, (q, k, v), dout)

    replay, static = capture_graph(step)
    for round_ in range(3):
        with torch.no_grad():
            for tensor in (q, k, v, dout):
                tensor.copy_(torch.randn_like(tensor))
        replay()
        sync()
        eager = step()
        for name, replayed, eager_value in zip(("out", "lse", "dq", "dk", "dv"), static, eager):
            if name != "dq":
                assert torch.equal(replayed, eager_value), f"round {round_}: the replay's {name} differs from eager"
        out, lse, dq, dk, dv = static
        assert_checks_ok(compare_with_reference(case, out, lse, q.detach(), k.detach(), v.detach(), None,
                                                (dq, dk, dv), dout), f"round {round_}")


# ------------------------------------------------------------------------------------------------------------
# (b) Tensors with more than 2**31 elements: every offset must be computed in 64 bits
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@gpu_only
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_huge_dense_batch_offsets_fwd_bwd(causal):
    """q/k/v (33000, 512, 1, 128) bf16: 2.16e9 elements (4.3 GB) each, so batch entries >= 32768 start past
    element 2**31. Forward + backward with NaN-poisoned outputs (no element may stay unwritten); entries on both
    sides of the boundary, the middle and the last ones must match the float64 reference.
    Peak ~40 GB: q, k, v, out, dout, dq, dk, dv."""
    batch, seqlen, heads, dim = (HUGE_DENSE[name] for name in ("batch", "seqlen", "heads", "dim"))
    dtype, row = torch.bfloat16, seqlen * heads * dim
    assert batch * row > INT32_MAX + 1
    require_free_gib(45)
    shape = (batch, seqlen, heads, dim)
    q, k, v = (torch.randn(shape, device=GPU, dtype=dtype).requires_grad_() for _ in range(3))
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        dout = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    all_written(out=out, lse=lse, dq=dq, dk=dk, dv=dv)

    boundary = (INT32_MAX + 1) // row  # the first entry whose offset does not fit in int32
    entries = sorted(e for e in {0, 1, batch // 2, boundary - 1, boundary, batch - 2, batch - 1} if 0 <= e < batch)
    assert entries[-1] * row > INT32_MAX
    index = torch.tensor(entries, device=GPU)

    def pick(t):
        return t.detach()[index]

    case = Case(batch=len(entries), seqlen_q=seqlen, seqlen_k=seqlen, num_heads=heads, num_heads_k=heads,
                head_dim=dim, dtype=dtype, causal=causal)
    checks = compare_with_reference(case, pick(out), pick(lse), pick(q), pick(k), pick(v), None,
                                    grads=(pick(dq), pick(dk), pick(dv)), dout=pick(dout))
    assert_checks_ok(checks, f"batch entries {entries}")


@pytest.mark.gpu
@pytest.mark.slow
@gpu_only
@pytest.mark.parametrize("variant", ["window", "full"])
def test_huge_key_length_row_offsets_fwd_bwd(variant):
    """One batch entry with k/v (1, 2**20 + 257, 16, 128) bf16 (2**31 + 526336 elements, 4.3 GB each): the last
    257 key rows start past element 2**31. q (1, 64, 16, 128); forward + backward.

    window: causal with window (255, 0): every query sees only keys among the last 320, most of them past 2**31.
        The reference runs on the last 1024 keys (same bottom-right alignment); dk/dv of all earlier keys must be 0.
    full: no mask; q and the last 300 keys share a random direction, so those keys carry most of the softmax
        mass (a wrong read there moves out far past the tolerance). Reference per head over all keys.
    Peak ~30 GB: k, v, dk, dv and one head's float64 reference."""
    seqlen_q, seqlen_k, heads, dim = (HUGE_KEYS[name] for name in ("seqlen_q", "seqlen_k", "heads", "dim"))
    dtype = torch.bfloat16
    assert (seqlen_k - 1) * heads * dim > INT32_MAX
    require_free_gib(40)
    q = torch.randn(1, seqlen_q, heads, dim, device=GPU, dtype=dtype)
    k = torch.randn(1, seqlen_k, heads, dim, device=GPU, dtype=dtype)
    v = torch.randn(1, seqlen_k, heads, dim, device=GPU, dtype=dtype)
    if variant == "full":
        direction = torch.randn(1, 1, heads, dim, device=GPU)
        q = (q.float() + direction).to(dtype)
        k[:, -HUGE_KEYS_HOT:] = (k[:, -HUGE_KEYS_HOT:].float() + direction).to(dtype)
        options, keys, ref_seqlen_k = dict(causal=False), slice(None), seqlen_k
    else:
        options = dict(causal=True, window_size=(HUGE_KEYS_WINDOW, 0))
        keys, ref_seqlen_k = slice(seqlen_k - HUGE_KEYS_REF_TAIL, None), HUGE_KEYS_REF_TAIL
        assert HUGE_KEYS_REF_TAIL >= seqlen_q + HUGE_KEYS_WINDOW
    for t in (q, k, v):
        t.requires_grad_()
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, return_attn_probs=True, **options)
        dout = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    all_written(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    if keys.start is not None:
        assert not dk[:, :keys.start].any() and not dv[:, :keys.start].any(), "keys outside the window got gradient"

    case = Case(batch=1, seqlen_q=seqlen_q, seqlen_k=ref_seqlen_k, num_heads=1, num_heads_k=1, head_dim=dim,
                dtype=dtype, **options)
    for h in range(heads):
        head = slice(h, h + 1)
        checks = compare_with_reference(
            case, out[:, :, head].detach(), lse[:, head].detach(), q.detach()[:, :, head],
            k.detach()[:, keys, head], v.detach()[:, keys, head], None,
            grads=(dq[:, :, head], dk[:, keys, head], dv[:, keys, head]), dout=dout[:, :, head])
        assert_checks_ok(checks, f"head {h}")
        free_cached_memory()


def kvcache_row_reference(b, q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_leftpad=None):
    """(out (1, 1, H, D), lse (1, H, 1), PyTorch-in-dtype out) of batch row b of a contiguous cache, one query head
    at a time: a GQA reference would expand the kv head to every query head (8 x 2 GB of float64 keys here)."""
    outs, lses, pts = [], [], []
    rows = slice(b, b + 1)
    inputs = dict(cache_seqlens=cache_seqlens[rows], cache_leftpad=None if cache_leftpad is None else cache_leftpad[rows])
    for h in range(q.shape[2]):
        args = (q[rows, :, h:h + 1], k_cache[rows], v_cache[rows], k_new[rows], v_new[rows])
        ref_out, ref_lse, _, _ = kvcache_reference(*args, **inputs)
        pt_out = kvcache_reference(*args, **inputs, compute_dtype=None)[0]
        outs.append(ref_out)
        lses.append(ref_lse)
        pts.append(pt_out)
    return torch.cat(outs, 2), torch.cat(lses, 1), torch.cat(pts, 2)


@pytest.mark.gpu
@pytest.mark.slow
@gpu_only
@pytest.mark.parametrize("variant", ["leftpad", "full"])
def test_huge_kvcache_contiguous(variant):
    """k_cache/v_cache (8, 2**21 + 64, 1, 128) bf16: 2**31 + 65536 elements (4.3 GB) each; row 7's keys from
    position 2096704 on start past element 2**31. Decode (Sq=1, MQA 8/1) appending one token per row; row 7 fills
    its cache to the last slot, whose offset is past 2**31.

    leftpad: row 7's valid keys start at capacity - 700, so nearly all it attends to is past 2**31 (split heuristic).
    full: no leftpad, num_splits=32; q and row 7's last 600 keys share a direction, so they dominate its softmax.
    Rows 0, 6 and 7 against the float64 reference; every row's appended k/v must be in the cache. Peak ~20 GB."""
    batch, capacity, heads, dim, dtype = 8, HUGE_KV_CAPACITY, 8, 128, torch.bfloat16
    assert (7 * capacity + capacity - 1) * dim > INT32_MAX  # row 7's append lands past 2**31
    require_free_gib(28)
    k_cache = torch.randn(batch, capacity, 1, dim, device=GPU, dtype=dtype)
    v_cache = torch.randn(batch, capacity, 1, dim, device=GPU, dtype=dtype)
    q = torch.randn(batch, 1, heads, dim, device=GPU, dtype=dtype)
    k_new = torch.randn(batch, 1, 1, dim, device=GPU, dtype=dtype)
    v_new = torch.randn(batch, 1, 1, dim, device=GPU, dtype=dtype)
    lengths = [17, capacity // 3, capacity // 2, 100, capacity - 100, 5, capacity - 1000, capacity - 1]
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=GPU)
    cache_leftpad = None
    if variant == "leftpad":
        leftpads = [0, capacity // 6, capacity // 4, 0, 0, 5, capacity // 2, capacity - 700]
        assert all(0 <= p <= n for p, n in zip(leftpads, lengths))
        cache_leftpad = torch.tensor(leftpads, dtype=torch.int32, device=GPU)
        num_splits = 0
    else:
        direction = torch.randn(dim, device=GPU)
        q[7] = (q[7].float() + direction).to(dtype)
        k_cache[7, -600:] = (k_cache[7, -600:].float() + direction).to(dtype)
        num_splits = 32
    references = {b: kvcache_row_reference(b, q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_leftpad)
                  for b in (0, 6, 7)}
    free_cached_memory()
    with poisoned_outputs():
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                       cache_leftpad=cache_leftpad, num_splits=num_splits,
                                                       return_softmax_lse=True)
    all_written(out=out, lse=lse)
    for b, (ref_out, ref_lse, pt_out) in references.items():
        assert_checks_ok(kvcache_checks(out[b:b + 1], lse[b:b + 1], ref_out, ref_lse, pt_out), f"batch row {b}")
    rows, positions = torch.arange(batch, device=GPU), cache_seqlens.long()
    assert torch.equal(k_cache[rows, positions], k_new[:, 0]), "appended keys missing from k_cache"
    assert torch.equal(v_cache[rows, positions], v_new[:, 0]), "appended values missing from v_cache"


@pytest.mark.gpu
@pytest.mark.slow
@gpu_only
def test_huge_kvcache_paged():
    """A page pool (2**18 + 320, 64, 1, 128) bf16 of 2**31 + 2.6e6 elements (4.3 GB per cache): row 3's pages are
    the last 256 of the pool, every one starting past element 2**31; rows 0-2 take random pages of the rest.
    Decode (Sq=1, MQA 8/1) appending one token; every row against the float64 reference on its own pages, and the
    appended k/v must be in the right page. Peak ~10 GB."""
    batch, heads, dim, dtype = 4, 8, 128, torch.bfloat16
    num_pages, pages_per_row, page = (HUGE_PAGES[name] for name in ("num_pages", "pages_per_row", "page"))
    assert (num_pages - pages_per_row) * page * dim > INT32_MAX
    require_free_gib(16)
    capacity = pages_per_row * page
    k_cache = torch.randn(num_pages, page, 1, dim, device=GPU, dtype=dtype)
    v_cache = torch.randn(num_pages, page, 1, dim, device=GPU, dtype=dtype)
    low = torch.randperm(num_pages - pages_per_row, device=GPU)[: 3 * pages_per_row].view(3, pages_per_row)
    high = num_pages - pages_per_row + torch.randperm(pages_per_row, device=GPU)
    block_table = torch.cat([low, high[None]]).to(torch.int32)
    q = torch.randn(batch, 1, heads, dim, device=GPU, dtype=dtype)
    k_new = torch.randn(batch, 1, 1, dim, device=GPU, dtype=dtype)
    v_new = torch.randn(batch, 1, 1, dim, device=GPU, dtype=dtype)
    cache_seqlens = torch.tensor([100, capacity // 3, capacity - 384, capacity - 1], dtype=torch.int32, device=GPU)

    references = []
    table = torch.arange(pages_per_row, device=GPU, dtype=torch.int32)[None]
    for b in range(batch):  # the reference sees a compact pool of the row's own pages, in table order
        own = block_table[b].long()
        args = (q[b:b + 1], k_cache[own], v_cache[own], k_new[b:b + 1], v_new[b:b + 1])
        inputs = dict(cache_seqlens=cache_seqlens[b:b + 1], block_table=table)
        ref_out, ref_lse, _, _ = kvcache_reference(*args, **inputs)
        pt_out = kvcache_reference(*args, **inputs, compute_dtype=None)[0]
        references.append((ref_out, ref_lse, pt_out))
    with poisoned_outputs():
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                       block_table=block_table, return_softmax_lse=True)
    all_written(out=out, lse=lse)
    for b, (ref_out, ref_lse, pt_out) in enumerate(references):
        assert_checks_ok(kvcache_checks(out[b:b + 1], lse[b:b + 1], ref_out, ref_lse, pt_out), f"batch row {b}")
        position = int(cache_seqlens[b])
        slot = (int(block_table[b, position // page]), position % page)
        assert torch.equal(k_cache[slot], k_new[b, 0]) and torch.equal(v_cache[slot], v_new[b, 0]), \
            f"batch row {b}: the appended k/v are not in page {slot[0]}"


@pytest.mark.gpu
@gpu_only
def test_grid_batch_times_heads_over_65535():
    """batch * heads = 4100 * 16 = 65600 > 65535, CUDA's limit on grid axes 1 and 2: dense forward + backward
    and a kv-cache decode must cover every (batch, head); the first, the 4096th and the last entries against
    the float64 reference, and nothing left unwritten."""
    batch, heads, seqlen, dim, dtype = GRID_BATCH, 16, 40, 64, torch.float16
    shape = (batch, seqlen, heads, dim)
    q, k, v = (torch.randn(shape, device=GPU, dtype=dtype).requires_grad_() for _ in range(3))
    with poisoned_outputs():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    all_written(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    entries = sorted({0, min(4095, batch - 1), batch - 1})
    index = torch.tensor(entries, device=GPU)
    case = Case(batch=len(entries), seqlen_q=seqlen, seqlen_k=seqlen, num_heads=heads, num_heads_k=heads,
                head_dim=dim, dtype=dtype, causal=True)
    assert_checks_ok(compare_with_reference(case, out.detach()[index], lse.detach()[index],
                                     *(t.detach()[index] for t in (q, k, v)), None,
                                     grads=[g[index] for g in grads], dout=dout[index]), "dense")

    q1 = torch.randn(batch, 1, heads, dim, device=GPU, dtype=dtype)
    k_cache = torch.randn(batch, 128, heads, dim, device=GPU, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.randint(1, 128, (batch,), device=GPU, dtype=torch.int32)
    with poisoned_outputs():
        out1, lse1 = flashtriton.flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=seqlens,
                                                         return_softmax_lse=True)
    all_written(out=out1, lse=lse1)
    ref_out, ref_lse, _, _ = kvcache_reference(q1[index], k_cache[index], v_cache[index], cache_seqlens=seqlens[index])
    pt_out = kvcache_reference(q1[index], k_cache[index], v_cache[index], cache_seqlens=seqlens[index],
                               compute_dtype=None)[0]
    assert_checks_ok(kvcache_checks(out1[index], lse1[index], ref_out, ref_lse, pt_out), "kvcache")


# ------------------------------------------------------------------------------------------------------------
# (c) Device guard: tensors on cuda:1 while cuda:0 is current; mixed devices are rejected before any launch
# ------------------------------------------------------------------------------------------------------------


def device_test_inputs(seqlen=300, dim=128):
    """CPU tensors for all_entry_points."""
    return dict(q=torch.randn(2, seqlen, 8, dim), k=torch.randn(2, seqlen, 2, dim), v=torch.randn(2, seqlen, 2, dim),
                dout=torch.randn(2, seqlen, 8, dim), cu=torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32),
                q1=torch.randn(3, 2, 8, dim), k_new=torch.randn(3, 2, 2, dim), v_new=torch.randn(3, 2, 2, dim),
                seqlens=torch.tensor([0, 100, 254], dtype=torch.int32), cache=torch.randn(3, 256, 2, dim),
                pages=torch.randn(3 * 4 + 2, 64, 2, dim), table=torch.randperm(14)[:12].view(3, 4).to(torch.int32))


def all_entry_points(device, host):
    """Dense fwd+bwd, varlen fwd+bwd, and kv-cache decode with append (contiguous and paged, num_splits=3) on
    `device`, from the CPU tensors `host`. Returns every result, the updated caches included."""
    dtype = torch.bfloat16
    seqlen = host["q"].shape[1]
    q, k, v = (host[name].to(device=device, dtype=dtype).requires_grad_() for name in ("q", "k", "v"))
    dout = host["dout"].to(device=device, dtype=dtype)
    out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    results = [out, lse, *torch.autograd.grad(out, (q, k, v), dout)]

    qv, kv, vv = (host[name].flatten(0, 1).to(device=device, dtype=dtype).requires_grad_() for name in ("q", "k", "v"))
    cu = host["cu"].to(device)
    out_v, lse_v, _ = flashtriton.flash_attn_varlen_func(qv, kv, vv, cu, cu, seqlen, seqlen, window_size=(40, 7),
                                                         return_attn_probs=True)
    results += [out_v, lse_v, *torch.autograd.grad(out_v, (qv, kv, vv), dout.flatten(0, 1))]

    q1, k_new, v_new = (host[name].to(device=device, dtype=dtype) for name in ("q1", "k_new", "v_new"))
    seqlens = host["seqlens"].to(device)
    for block_table, cache_name in ((None, "cache"), (host["table"].to(device), "pages")):
        k_cache = host[cache_name].to(device=device, dtype=dtype)
        v_cache = (host[cache_name] * 0.5 + 1).to(device=device, dtype=dtype)
        out_c, lse_c = flashtriton.flash_attn_with_kvcache(q1, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                           block_table=block_table, causal=True, num_splits=3,
                                                           return_softmax_lse=True)
        results += [out_c, lse_c, k_cache, v_cache]
    return [t.detach() for t in results]


@pytest.mark.gpu
@two_gpus_only
def test_tensors_on_second_gpu_while_first_is_current():
    """With cuda:0 current and every tensor on cuda:1: dense fwd+bwd, varlen fwd+bwd and kv-cache calls run on
    cuda:1 (no memory allocated on cuda:0, the current device unchanged) and equal the same calls on cuda:0."""
    host = device_test_inputs()
    results = {}
    with torch.cuda.device(0):
        for device in (DEV1, DEV0):
            gc.collect()  # nothing on cuda:0 may be freed (or allocated) while the cuda:1 calls run
            sync(0)
            allocated_on_0 = torch.cuda.memory_allocated(0)
            results[device] = all_entry_points(device, host)
            sync(device)
            assert torch.cuda.current_device() == 0, "a call left another device current"
            if device == DEV1:
                assert torch.cuda.memory_allocated(0) == allocated_on_0, f"a {DEV1} call allocated memory on cuda:0"
    same_model = torch.cuda.get_device_name(0) == torch.cuda.get_device_name(1)
    for i, (on_1, on_0) in enumerate(zip(results[DEV1], results[DEV0])):
        assert on_1.device == torch.device(DEV1), f"result {i} is on {on_1.device}"
        on_0 = on_0.to(DEV1)
        if same_model:
            assert torch.equal(on_1, on_0), f"result {i} differs between {DEV1} and {DEV0}"
        else:
            torch.testing.assert_close(on_1.float(), on_0.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@two_gpus_only
def test_mixed_devices_raise_before_any_launch(monkeypatch):
    """q on cuda:0 and one other tensor on cuda:1: a RuntimeError naming the device, raised before anything runs
    (the launchers are replaced by functions that fail), and the caches are left untouched."""
    from flashtriton.ops import kvcache

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched before the mixed devices were noticed")

    for module in (backend, kvcache):
        monkeypatch.setattr(module, "launch_fwd", launched)
    monkeypatch.setattr(backend, "launch_bwd", launched)
    for name in ("_append", "apply_rotary"):  # the kv-cache path runs these before the attention
        if hasattr(kvcache, name):
            monkeypatch.setattr(kvcache, name, launched)

    def t(*shape, device=DEV0, dtype=torch.float16):
        return torch.randn(*shape, device=device).to(dtype)

    q, k, v = t(2, 64, 4, 64), t(2, 64, 2, 64), t(2, 64, 2, 64)
    cu = torch.tensor([0, 64, 128], dtype=torch.int32, device=DEV0)
    qv, kv, vv = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    calls = {
        "k": lambda: flashtriton.flash_attn_func(q, k.to(DEV1), v),
        "v": lambda: flashtriton.flash_attn_func(q, k, v.to(DEV1)),
        "q": lambda: flashtriton.flash_attn_func(q.to(DEV1), k, v),
        "alibi_slopes": lambda: flashtriton.flash_attn_func(q, k, v, alibi_slopes=torch.rand(4, device=DEV1)),
        "varlen cu_seqlens_k": lambda: flashtriton.flash_attn_varlen_func(qv, kv, vv, cu, cu.to(DEV1), 64, 64),
        "varlen k": lambda: flashtriton.flash_attn_varlen_func(qv, kv.to(DEV1), vv, cu, cu, 64, 64),
    }
    problems = []

    def expect_device_error(name, call):
        try:
            call()
        except RuntimeError as error:
            if "device" not in str(error) or isinstance(error, NotImplementedError):
                problems.append(f"{name}: {type(error).__name__}: {error}")
            return
        except AssertionError as error:  # a patched launcher ran
            problems.append(f"{name}: {error}")
            return
        problems.append(f"{name}: no error")

    for name, call in calls.items():
        expect_device_error(name, call)

    q1, k_cache, v_cache = t(2, 1, 4, 64), t(2, 100, 2, 64), t(2, 100, 2, 64)
    k_new, v_new = t(2, 1, 2, 64), t(2, 1, 2, 64)
    seqlens = torch.tensor([10, 50], dtype=torch.int32, device=DEV0)
    overrides = {
        "k_cache": dict(k_cache=k_cache.to(DEV1)),
        "v_cache": dict(v_cache=v_cache.to(DEV1)),
        "k": dict(k=k_new.to(DEV1)),
        "v": dict(v=v_new.to(DEV1)),
        "cache_seqlens": dict(cache_seqlens=seqlens.to(DEV1)),
        "cache_seqlens-no-append": dict(cache_seqlens=seqlens.to(DEV1), k=None, v=None),
        "cache_batch_idx": dict(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32, device=DEV1)),
        "cache_leftpad": dict(cache_leftpad=torch.tensor([1, 0], dtype=torch.int32, device=DEV1)),
        "alibi_slopes": dict(alibi_slopes=torch.rand(4, device=DEV1)),
    }
    before = (k_cache.clone(), v_cache.clone())
    for name, override in overrides.items():
        args = dict(k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, cache_seqlens=seqlens) | override
        expect_device_error(f"kvcache {name}", lambda: flashtriton.flash_attn_with_kvcache(q1, **args))
        sync(0)
        if not (torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])):
            problems.append(f"kvcache {name}: the cache was written")
            k_cache.copy_(before[0]), v_cache.copy_(before[1])
    assert not problems, "mixed devices not rejected before launch:\n" + "\n".join(problems)


# ------------------------------------------------------------------------------------------------------------
# (d) Repeated calls are bitwise identical (no races between programs, no order effects)
# ------------------------------------------------------------------------------------------------------------


def assert_repeats_equal(run, names):
    first = [t.detach().clone() for t in run()]
    for i in range(REPEATS):
        again = run()
        for name, a, b in zip(names, first, again):
            assert torch.equal(a, b), f"{name} differs on repeat {i + 1} of {REPEATS}"


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("heads_k", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_repeated_dense_fwd_bwd_is_bitwise_identical(causal, heads_k):
    """B=2, S=1024, H=8, d128, bf16, deterministic=True: out, lse, dq, dk and dv equal over 100 repeats."""
    q = torch.randn(2, RACE_SEQLEN, 8, 128, device=GPU, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, RACE_SEQLEN, heads_k, 128, device=GPU, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, RACE_SEQLEN, heads_k, 128, device=GPU, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)

    def run():
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, causal=causal, deterministic=True, return_attn_probs=True)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    assert_repeats_equal(run, ("out", "lse", "dq", "dk", "dv"))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_repeated_dropout_fwd_bwd_is_bitwise_identical(causal):
    """Dropout 0.1 (B=2, S=1024, H=8, GQA 8/2, d128, bf16, deterministic=True, the same seed each call): out, lse,
    dq, dk and dv equal over 100 repeats (the backward regenerates the forward's mask every time)."""
    q = torch.randn(2, RACE_SEQLEN, 8, 128, device=GPU, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, RACE_SEQLEN, 2, 128, device=GPU, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, RACE_SEQLEN, 2, 128, device=GPU, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)

    def run():
        torch.manual_seed(2024)
        out, lse, _ = flashtriton.flash_attn_func(q, k, v, 0.1, causal=causal, deterministic=True,
                                                  return_attn_probs=True)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    assert_repeats_equal(run, ("out", "lse", "dq", "dk", "dv"))


@pytest.mark.gpu
@gpu_only
def test_repeated_varlen_fwd_bwd_is_bitwise_identical():
    """Varlen (lengths 1024, 77, 513, 0, 300, 1; causal; GQA 8/2; d128; bf16; deterministic): 100 equal repeats."""
    lens = [RACE_SEQLEN, 77, 513, 0, 300, 1]
    cu = cu_seqlens(lens, GPU)
    q = torch.randn(sum(lens), 8, 128, device=GPU, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens), 2, 128, device=GPU, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens), 2, 128, device=GPU, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)

    def run():
        out, lse, _ = flashtriton.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                         deterministic=True, return_attn_probs=True)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    assert_repeats_equal(run, ("out", "lse", "dq", "dk", "dv"))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_splits", [3, 8])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_repeated_kvcache_splits_is_bitwise_identical(paged, num_splits):
    """Split-KV causal decode of 2 tokens with a 2-token append (the same positions every time; GQA 8/2, d128,
    bf16): out, lse and the caches equal over 100 repeats."""
    batch, capacity, dtype = 4, 2048, torch.bfloat16
    block_table = None
    if paged:
        block_table = torch.randperm(batch * 32 + 3, device=GPU)[: batch * 32].view(batch, 32).to(torch.int32)
        k_cache = torch.randn(batch * 32 + 3, capacity // 32, 2, 128, device=GPU, dtype=dtype)
    else:
        k_cache = torch.randn(batch, capacity, 2, 128, device=GPU, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, 2, 8, 128, device=GPU, dtype=dtype)
    k_new, v_new = (torch.randn(batch, 2, 2, 128, device=GPU, dtype=dtype) for _ in range(2))
    seqlens = torch.tensor([capacity - 48, 7, capacity // 2, 555], dtype=torch.int32, device=GPU)

    def run():
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                       block_table=block_table, causal=True, num_splits=num_splits,
                                                       return_softmax_lse=True)
        return out, lse, k_cache, v_cache

    assert_repeats_equal(run, ("out", "lse", "k_cache", "v_cache"))


# ------------------------------------------------------------------------------------------------------------
# (d2) Malformed index values (docs/api.md §6): appends outside the cache are dropped, nothing lands outside it
# ------------------------------------------------------------------------------------------------------------

GUARD_ELEMENTS = 1 << 16  # sentinel elements before and after each cache: more than a page of 256 rows' head


def guarded_cache(shape, sentinel=777.0):
    """(buffer, cache): a random fp16 cache of `shape` inside a buffer whose GUARD_ELEMENTS before and after it hold
    the sentinel, in one allocation, so a write past either end lands in the sentinel."""
    numel = 1
    for size in shape:
        numel *= size
    buffer = torch.full((numel + 2 * GUARD_ELEMENTS,), sentinel, device=GPU, dtype=torch.float16)
    cache = buffer[GUARD_ELEMENTS:GUARD_ELEMENTS + numel].view(shape)
    cache.copy_(torch.randn(shape, device=GPU, dtype=torch.float16))
    return buffer, cache


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("variant", ["paged-negative", "paged-past-pool", "batch-idx", "seqlens"])
def test_malformed_kvcache_appends_stay_inside_the_cache(variant):
    """flash_attn_with_kvcache appends with block ids < 0 or >= num_blocks, cache_batch_idx outside the cache's
    batch, cache_seqlens < 0 or past the capacity (host checks off, as outside strict mode): the sentinels around
    both caches survive, the dropped appends leave the cache unchanged, the valid ones land where they belong."""
    from flashtriton.testing import unchecked_indices

    batch, new, page, heads_k, dim = 3, 5, 256, 2, 64
    lengths = [10, 300, 500]
    options = {}
    if variant.startswith("paged"):
        pages_per_row = 4
        num_pages = batch * pages_per_row
        table = torch.arange(num_pages, device=GPU, dtype=torch.int32).view(batch, pages_per_row)
        bad = -1 if variant == "paged-negative" else num_pages + 3
        table[0, 0], table[1, 1], table[2, 1] = bad, bad, 2 * num_pages
        options["block_table"] = table
        shape = (num_pages, page, heads_k, dim)
        lengths = [10, 300, 600]  # rows 0 and 1 append onto a bad page, row 2 onto a good one after a bad one
    else:
        shape = (2 if variant == "batch-idx" else batch, 1024, heads_k, dim)
        if variant == "batch-idx":
            options["cache_batch_idx"] = torch.tensor([1, 2, -1], device=GPU, dtype=torch.int32)
        else:
            lengths = [-3, 1022, 5000]
    (k_buffer, k_cache), (v_buffer, v_cache) = guarded_cache(shape), guarded_cache(shape)
    before = (k_cache.clone(), v_cache.clone())
    q = torch.randn(batch, 1, 8, dim, device=GPU, dtype=torch.float16)
    k_new = torch.randn(batch, new, heads_k, dim, device=GPU, dtype=torch.float16)
    v_new = torch.randn_like(k_new)
    seqlens = torch.tensor(lengths, device=GPU, dtype=torch.int32)
    with unchecked_indices():
        out, lse = flashtriton.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                       return_softmax_lse=True, **options)
    torch.cuda.synchronize()
    for name, buffer in (("k_cache", k_buffer), ("v_cache", v_buffer)):
        outside = torch.cat([buffer[:GUARD_ELEMENTS], buffer[-GUARD_ELEMENTS:]])
        assert bool((outside == 777.0).all()), f"{variant}: an append wrote outside {name}"
    expected_k, expected_v = before[0].clone(), before[1].clone()
    for b, start in enumerate(lengths):
        for t in range(new):
            position = start + t
            if variant.startswith("paged"):
                page_id = int(options["block_table"][b, position // page]) if 0 <= position < 4 * page else -1
                if 0 <= page_id < shape[0]:
                    slot = (page_id, position % page)
                    expected_k[slot], expected_v[slot] = k_new[b, t], v_new[b, t]
            else:
                row = int(options["cache_batch_idx"][b]) if variant == "batch-idx" else b
                if 0 <= row < shape[0] and 0 <= position < shape[1]:
                    expected_k[row, position], expected_v[row, position] = k_new[b, t], v_new[b, t]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v), f"{variant}: cache contents"
    assert bool(torch.isfinite(out).all()), f"{variant}: out"
    if variant == "batch-idx":
        assert torch.equal(out[2], torch.zeros_like(out[2])) and bool(torch.isposinf(lse[2]).all())
