"""flash_attn_with_kvcache's backend (docs/api.md §5): validate, rotate, append into the cache, attend.

The attention itself runs the prefill forward kernel with per-row key bounds (seqused_k / leftpad_k),
cache_batch_idx and paged addressing. Split-KV: each row's keys are cut into num_splits parts (the heuristic
picks the count when num_splits <= 0) whose partial results the combine kernel merges by LSE.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import configs
from ..kernels.append import kv_append_kernel
from ..reference import kvcache_reference
from . import checks
from .backend import fwd_tile_grid, launch_fwd, new_empty, runs_triton, score_params
from .launching import compiled_without_line_info, device_guard, triton_cdiv

compiled_without_line_info(kv_append_kernel)
from .triton.rotary import apply_rotary

APPEND_BLOCK = 32


def _capacity(k_cache: torch.Tensor, block_table: Optional[torch.Tensor]) -> int:
    return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


def check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, softcap, alibi_slopes, num_splits) -> None:
    """Every check of docs/api.md §6 for flash_attn_with_kvcache that needs no host synchronization."""
    if k_cache.stride(-1) != 1:
        raise AssertionError("k_cache must have contiguous last dimension")
    if v_cache.stride(-1) != 1:
        raise AssertionError("v_cache must have contiguous last dimension")
    checks.check_dtypes(q, k_cache, v_cache)
    checks.check_same_device(q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos,
                             rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                             block_table=block_table, cache_seqlens=cache_seqlens)
    checks.check_device_capability(q)
    checks.check_dim(q, "q", ("batch_size", "seqlen_q", "num_heads", "head_size"))
    batch, _, num_heads, head_dim = q.shape
    checks.check(batch > 0, "batch size must be positive")
    checks.check_head_dim(head_dim)
    if k_cache.dim() != 4:
        raise RuntimeError(f"k_cache must have 4 dimensions, got {tuple(k_cache.shape)}")
    num_heads_k = k_cache.shape[2]
    checks.check(num_heads_k > 0 and num_heads % num_heads_k == 0,
                 "Number of heads in key/value must divide number of heads in query")
    cache_names = (("num_blocks", "page_block_size") if block_table is not None else ("batch_size_cache", "seqlen_k"))
    checks.check_shape(k_cache, "k_cache", (*cache_names, "num_heads_k", "head_size"),
                       (*k_cache.shape[:2], num_heads_k, head_dim))
    checks.check_shape(v_cache, "v_cache", (*cache_names, "num_heads_k", "head_size"), k_cache.shape)
    checks.check(num_splits <= 128, "num_splits > 128 not supported")
    checks.check_options(0.0, softcap, alibi_slopes, batch, num_heads, q)
    capacity = _capacity(k_cache, block_table)
    if block_table is not None:
        checks.check(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
        checks.check(cache_leftpad is None, "We don't support Paged KV and leftpad_k running at the same time yet")
        checks.check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        checks.check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
        checks.check(block_table.dim() == 2 and block_table.shape[0] == batch,
                     f"block_table must have shape (batch_size, max_num_blocks_per_seq), got {tuple(block_table.shape)}")
    checks.check((k is None) == (v is None), "If key is supplied, value must also be passed in")
    if k is not None:
        checks.check(cache_seqlens is not None, "If key is supplied, seqlens_k must also be passed in")
        checks.check(k.dtype == q.dtype, "Key must have the same dtype as query")
        checks.check(v.dtype == q.dtype, "Value must have the same dtype as query")
        checks.check(k.dim() == 4 and k.shape[1] <= capacity,
                     "If key is supplied, it must have seqlen <= the seqlen of the KV cache")
        names = ("batch_size", "seqlen_new", "num_heads_k", "head_size")
        checks.check_shape(k, "k", names, (batch, k.shape[1], num_heads_k, head_dim))
        checks.check_shape(v, "v", names, k.shape)
    if isinstance(cache_seqlens, torch.Tensor):
        checks.check(cache_seqlens.dtype in (torch.int32, torch.int64),
                     "seqlens_k must have dtype int32 (int64 is converted)")
        checks.check(tuple(cache_seqlens.shape) == (batch,), "seqlens_k must have shape (batch_size)")
        checks.check(cache_seqlens.is_contiguous(), "seqlens_k must be contiguous")
    for name, tensor, message in (("cache_leftpad", cache_leftpad, "leftpad_k must have dtype int32"),
                                  ("cache_batch_idx", cache_batch_idx, "cache_batch_idx must have dtype int32")):
        if tensor is not None:
            checks.check(tensor.dtype == torch.int32, message)
            checks.check(tuple(tensor.shape) == (batch,), f"{name} must have shape (batch_size), got {tuple(tensor.shape)}")
    if rotary_cos is not None or rotary_sin is not None:
        checks.check(k is not None, "If rotary cos/sin are provided, new key / value to be appended to KV cache must "
                                    "also be provided")
        checks.check(rotary_cos is not None and rotary_sin is not None,
                     "If rotary cos is provided, rotary sin must also be provided")
        rotary_dim = 2 * rotary_cos.shape[1]
        checks.check(rotary_dim <= head_dim, "rotary_dim must be <= headdim")
        checks.check(rotary_dim % 16 == 0, "Only rotary dimensions divisible by 16 are currently supported")
        checks.check(rotary_cos.shape[0] >= capacity and rotary_sin.shape[0] >= capacity,
                     "cos/sin seqlen must be at least the seqlen of KV cache")
        checks.check(rotary_cos.dtype == q.dtype and rotary_sin.dtype == q.dtype,
                     "rotary_cos must have the same dtype as query")
        checks.check(rotary_sin.shape == rotary_cos.shape, "rotary_sin must have the shape of rotary_cos")


def _check_paged_capacity(cache_seqlens: torch.Tensor, seqlen_new: int, capacity: int) -> None:
    """flash_attn's paged-capacity check (docs/api.md §5.2); one host synchronization, as upstream.

    Skipped while a CUDA graph is being captured (a capture cannot read device values). The kernels stay
    in bounds without it: appends past the capacity are not written and reads stop at the capacity.
    """
    if cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    needed = int(cache_seqlens.max()) + seqlen_new
    checks.check(needed <= capacity,
                 f"Paged KV cache: max(seqlens_k) + seqlen_knew (= {needed}) exceeds the capacity addressable by "
                 f"block_table (max_num_blocks_per_seq * page_block_size = {capacity}). Grow block_table or "
                 f"reduce the sequence lengths.")


def _rotate_queries(q, rotary_cos, rotary_sin, cache_seqlens, interleaved: bool, per_row_positions: bool):
    """Queries at positions cache_seqlens + i (causal/local) or all at cache_seqlens (docs/api.md §5.5)."""
    if per_row_positions:
        return apply_rotary(q, rotary_cos, rotary_sin, seqlen_offsets=cache_seqlens, interleaved=interleaved)
    batch, seqlen_q = q.shape[:2]
    one_per_row = q.reshape(batch * seqlen_q, 1, *q.shape[2:])
    offsets = cache_seqlens.repeat_interleave(seqlen_q)
    return apply_rotary(one_per_row, rotary_cos, rotary_sin, seqlen_offsets=offsets,
                        interleaved=interleaved).view(q.shape)


def _append(k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, capacity: int) -> None:
    batch, seqlen_new, num_heads_k, head_dim = k.shape
    if seqlen_new == 0:
        return
    page_args = (block_table.stride(0), k_cache.shape[1]) if block_table is not None else (0, 1)
    grid = (triton_cdiv(seqlen_new, APPEND_BLOCK) * batch * num_heads_k,)
    with device_guard(k):
        kv_append_kernel[grid](
            k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), *page_args, num_heads_k, seqlen_new, capacity,
            HEAD_DIM=head_dim, BLOCK_D=configs.block_d(head_dim), BLOCK_S=APPEND_BLOCK,
            HAS_BATCH_IDX=cache_batch_idx is not None, IS_PAGED=block_table is not None,
        )


def mha_fwd_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens: Optional[torch.Tensor],
                    cache_batch_idx, cache_leftpad, block_table, softmax_scale: float, causal: bool,
                    window_size_left: int, window_size_right: int, softcap: float, rotary_interleaved: bool,
                    alibi_slopes, num_splits: int):
    """Append k/v (rotated) into the caches in place, then attend. Returns (out (B, Sq, H, D), lse (B, H, Sq)).

    cache_seqlens is None (every row holds `capacity` keys) or an int32 (B,) tensor.
    """
    check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, softcap, alibi_slopes, num_splits)
    batch, seqlen_q, num_heads, head_dim = q.shape
    capacity = _capacity(k_cache, block_table)
    seqlen_new = 0 if k is None else k.shape[1]
    q, k, v = (t if t is None or checks.has_contiguous_last_dim(t) else t.contiguous() for t in (q, k, v))
    if cache_seqlens is not None:
        if cache_seqlens.dtype != torch.int32:
            cache_seqlens = cache_seqlens.to(torch.int32)
        if block_table is not None:
            _check_paged_capacity(cache_seqlens, seqlen_new, capacity)
    window = (window_size_left, window_size_right)

    if not runs_triton(q):
        out, lse, new_k_cache, new_v_cache = kvcache_reference(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window, softcap, rotary_interleaved, alibi_slopes,
            compute_dtype=torch.float32)
        k_cache.copy_(new_k_cache)
        v_cache.copy_(new_v_cache)
        return out, lse

    params = score_params(softmax_scale, causal, window_size_left, window_size_right, softcap, capacity)
    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    if k is not None:
        if rotary_cos is not None:
            k = apply_rotary(k, rotary_cos, rotary_sin, seqlen_offsets=cache_seqlens, interleaved=rotary_interleaved)
        _append(k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, capacity)
    if rotary_cos is not None:
        q = _rotate_queries(q, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved,
                            per_row_positions=causal or params.is_local)
    # Keys past the capacity were not written, so they are never read either.
    seqused = torch.clamp(cache_seqlens + seqlen_new if seqlen_new else cache_seqlens, max=capacity)  # int32
    leftpad = None if cache_leftpad is None else torch.clamp(cache_leftpad, min=0)
    out = new_empty((batch, seqlen_q, num_heads, head_dim), q.dtype, q.device)
    lse = new_empty((batch, num_heads, seqlen_q), torch.float32, q.device)
    launch_fwd(q, k_cache, v_cache, out, lse, params, alibi_slopes, (lse.stride(0), lse.stride(1)), seqlen_q,
               capacity, batch, seqused_k=seqused, leftpad_k=leftpad, block_table=block_table,
               cache_batch_idx=cache_batch_idx,
               num_splits=splits_for(q, k_cache.shape[-2], seqlen_q, capacity, num_splits,
                                     params.causal_like, 0 if block_table is None else k_cache.shape[1]))
    return out, lse


def splits_for(q: torch.Tensor, num_heads_k: int, seqlen_q: int, capacity: int, num_splits: int,
               causal_like: bool = False, page_size: int = 0) -> int:
    """The caller's num_splits, or the heuristic's choice for <= 0 (from shapes only: no host sync).

    causal_like must be what launch_fwd keys its tile config on (ScoreParams.causal_like), and page_size the
    paged cache's page (0: contiguous), so the key-block count matches the launch
    (configs.forward_launch_config serves both).
    """
    if num_splits > 0:
        return min(num_splits, 128)
    config = configs.forward_launch_config(configs.arch_class(q.device), q.shape[-1], causal_like, seqlen_q,
                                           page_size=page_size)
    slots = configs.multiprocessor_count(q.device)
    if page_size:
        slots *= configs.PAGED_PROGRAMS_PER_SM
    query_tiles, batch_heads = fwd_tile_grid(seqlen_q, q.shape[0], q.shape[2], num_heads_k, config.block_m)
    programs = query_tiles * batch_heads
    return configs.num_splits_heuristic(programs, triton_cdiv(capacity, config.block_n), slots)
