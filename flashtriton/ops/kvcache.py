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
from ..scores import score_params
from . import call_plans, checks, reference_path, sink
from .backend import launch_fwd, new_empty, runs_triton, splits_for
from .launching import compiled_without_line_info, device_guard, launch, triton_cdiv
from .triton.rotary import apply_rotary

compiled_without_line_info(kv_append_kernel)

APPEND_BLOCK = 32


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
    head_dim_v = v.shape[-1]
    if seqlen_new == 0:
        return
    page_args = (block_table.stride(0), k_cache.shape[1]) if block_table is not None else (0, 1)
    grid = (triton_cdiv(seqlen_new, APPEND_BLOCK) * batch * num_heads_k,)
    with device_guard(k):
        launch(
            kv_append_kernel, grid,
            k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), *page_args, num_heads_k, seqlen_new, capacity,
            k_cache.shape[0] if block_table is not None or cache_batch_idx is not None else None,
            HEAD_DIM=head_dim, BLOCK_D=configs.block_d(head_dim), HEAD_DIM_V=head_dim_v,
            BLOCK_DV=configs.block_d(head_dim_v), BLOCK_S=APPEND_BLOCK,
            HAS_BATCH_IDX=cache_batch_idx is not None, IS_PAGED=block_table is not None,
        )


def mha_fwd_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens: Optional[torch.Tensor],
                    cache_batch_idx, cache_leftpad, block_table, softmax_scale: float, causal: bool,
                    window_size_left: int, window_size_right: int, softcap: float, rotary_interleaved: bool,
                    alibi_slopes, num_splits: int, learnable_sink=None, q_descale=None, k_descale=None,
                    v_descale=None):
    """Append k/v (rotated) into the caches in place, then attend. Returns (out (B, Sq, H, D), lse (B, H, Sq)).

    cache_seqlens is None (every row holds `capacity` keys) or an int32 (B,) tensor. learnable_sink (H,): sinks
    folded into out and lse (docs/api.md §4.11). A repeated signature runs its call plan (ops/call_plans).
    """
    return call_plans.run_planned(
        "kvcache", _mha_fwd_kvcache,
        (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
         alibi_slopes, learnable_sink, q_descale, k_descale, v_descale),
        (float(softmax_scale), bool(causal), int(window_size_left), int(window_size_right), float(softcap),
         bool(rotary_interleaved), int(num_splits)),
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        softmax_scale, causal, window_size_left, window_size_right, softcap, rotary_interleaved, alibi_slopes,
        num_splits, learnable_sink, q_descale, k_descale, v_descale)


def _mha_fwd_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                     block_table, softmax_scale, causal, window_size_left, window_size_right, softcap,
                     rotary_interleaved, alibi_slopes, num_splits, learnable_sink, q_descale, k_descale, v_descale):
    """mha_fwd_kvcache's whole call: checks, appends, allocations, the launcher."""
    checks.check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, softcap, alibi_slopes, num_splits)
    checks.check_learnable_sink(learnable_sink, q, q.shape[2])
    descales = (q_descale, k_descale, v_descale)
    fp8 = checks.check_fp8(q, descales, q.shape[0], k_cache.shape[2])
    checks.check(not (fp8 and rotary_cos is not None), "rotary embedding is not supported with FP8 inputs")
    batch, seqlen_q, num_heads, head_dim = q.shape
    capacity = checks.kv_capacity(k_cache, block_table)
    seqlen_new = 0 if k is None else k.shape[1]
    q, k, v = (t if t is None or checks.has_contiguous_last_dim(t) else t.contiguous() for t in (q, k, v))
    checks.check_kvcache_index_values(q, k_cache, seqlen_new, cache_seqlens, cache_batch_idx, cache_leftpad,
                                      block_table)
    if cache_seqlens is not None and cache_seqlens.dtype != torch.int32:
        cache_seqlens = cache_seqlens.to(torch.int32)
    window = (window_size_left, window_size_right)

    if not runs_triton(q):
        out, lse = reference_path.kvcache_forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                                  cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                                  window, softcap, rotary_interleaved, alibi_slopes,
                                                  descales if fp8 else None)
        if learnable_sink is not None:
            sink.fold_sink(out, lse, learnable_sink, runs_kernels=False)
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
    # the keys each row attends (int32); the kernel clamps them into the capacity (backend.fwd_row_bounds: the keys
    # past it were not written, so they are never read either), so no clamp launches here
    seqused = cache_seqlens + seqlen_new if seqlen_new else cache_seqlens
    leftpad = None if cache_leftpad is None else torch.clamp(cache_leftpad, min=0)
    out = new_empty((batch, seqlen_q, num_heads, v_cache.shape[-1]), torch.bfloat16 if fp8 else q.dtype, q.device)
    lse = new_empty((batch, num_heads, seqlen_q), torch.float32, q.device)
    launch_fwd(q, k_cache, v_cache, out, lse, params, alibi_slopes, (lse.stride(0), lse.stride(1)), seqlen_q,
               capacity, batch, seqused_k=seqused, leftpad_k=leftpad, block_table=block_table,
               cache_batch_idx=cache_batch_idx,
               num_splits=splits_for(q, k_cache.shape[-2], seqlen_q, capacity, num_splits,
                                     params.causal_like, 0 if block_table is None else k_cache.shape[1],
                                     v_cache.shape[-1]), descales=descales if fp8 else None)
    if learnable_sink is not None:
        sink.fold_sink(out, lse, learnable_sink, runs_kernels=True)
    return out, lse
