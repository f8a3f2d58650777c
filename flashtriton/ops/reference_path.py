"""The path without kernels: CPU tensors when TRITON_INTERPRET was not set at import (backend.runs_triton is False).

Each entry point computes what its backend counterpart returns with the exact PyTorch reference
(flashtriton.reference) in float32, writing into the same preallocated gradients. Dropout masks come from
ops/dropout.keep_mask's CPU generator (the kernels' distribution, not their bits).

The backward uses the out and softmax_lse it is given, as FA2's does (P = exp(S - lse), delta = rowsum(dout * out)),
never ones recomputed from q, k, v: a blockwise caller (ring attention) runs each key block's backward with the
out and lse of the whole sequence, and the block's gradients are then its share of the whole's.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..reference import (attention_reference, attention_reference_backward, attention_reference_varlen,
                         attention_reference_varlen_backward, kvcache_reference)
from . import dropout


def dense_forward(q, k, v, softmax_scale: float, causal: bool, window: Tuple[int, int], softcap: float, alibi_slopes,
                  dropout_p: float, keep: Optional[torch.Tensor], descales=None):
    """(out, lse) of mha_fwd; keep: the (B, H, R(Sq), R(Sk)) keep mask when dropout_p > 0; descales: FP8's."""
    dropout_mask = None if keep is None else keep[:, :, :q.shape[1], :k.shape[1]]
    return attention_reference(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, dropout_p, dropout_mask,
                               compute_dtype=torch.float32, descales=descales)


def dense_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p: float, softmax_scale: float, causal: bool,
                   window: Tuple[int, int], softcap: float, alibi_slopes, rng_state, mask_shape,
                   softmax_d_shape) -> torch.Tensor:
    """mha_bwd: gradients into dq, dk, dv from the given out and softmax_lse (B, H, Sq); returns softmax_d
    (B, H, R(Sq)). mask_shape: (B, H, R(Sq), R(Sk)) of the forward's keep mask."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    softmax_d = torch.zeros(softmax_d_shape, dtype=torch.float32, device=q.device)
    keep = None
    if dropout_p > 0.0:
        keep = dropout.keep_mask(rng_state, *mask_shape, dropout_p, False)[:, :, :seqlen_q, :seqlen_k]
    grads = attention_reference_backward(dout, q, k, v, softmax_scale, causal, window, softcap, alibi_slopes,
                                         dropout_p, keep, out=out, lse=softmax_lse, seqlen_k_star=seqlen_k)
    for target, grad in zip((dq, dk, dv), grads):
        target.copy_(grad)
    softmax_d[:, :, :seqlen_q] = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    return softmax_d


def _gather_paged(cache: torch.Tensor, block_table: torch.Tensor, cu_seqlens_k: torch.Tensor,
                  seqused_k: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(Tk, Hk, D) keys of a paged cache laid out as cu_seqlens_k describes. With seqused_k only each sequence's
    first seqused_k[b] keys are read (the block-table entries past them may hold anything); the rest are zeros,
    which no query sees."""
    page_size = cache.shape[1]
    rows = []
    starts = cu_seqlens_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else None
    for b in range(len(starts) - 1):
        length = starts[b + 1] - starts[b]
        read = length if used is None else min(length, used[b])
        positions = torch.arange(read, device=cache.device)
        pages = block_table[b, positions // page_size].long()
        rows.append(cache[pages, positions % page_size])
        rows.append(cache.new_zeros(length - read, *cache.shape[2:]))
    return torch.cat(rows) if rows else cache.new_empty(0, *cache.shape[2:])


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k: int, softmax_scale: float, causal: bool,
                   window: Tuple[int, int], softcap: float, alibi_slopes, block_table, leftpad_k, seqused_k,
                   dropout_p: float, keep: Optional[torch.Tensor], descales=None):
    """(out, lse) of mha_varlen_fwd: per-sequence reference (a host loop); paged K/V gathered, seqused_k / leftpad_k
    applied by cutting each sequence's keys."""
    cu_k = cu_seqlens_k
    if block_table is not None:
        k, v = _gather_paged(k, block_table, cu_k, seqused_k), _gather_paged(v, block_table, cu_k, seqused_k)
    if seqused_k is not None or leftpad_k is not None:
        starts = cu_k[:-1] + (leftpad_k if leftpad_k is not None else 0)
        ends = cu_k[:-1] + seqused_k if seqused_k is not None else cu_k[1:]
        index = torch.cat([torch.arange(int(s), int(e)) for s, e in zip(starts.tolist(), ends.tolist())]).long()
        k, v = k[index], v[index]
        cu_k = torch.nn.functional.pad((ends - starts).cumsum(0), (1, 0)).to(torch.int32)
    return attention_reference_varlen(q, k, v, cu_seqlens_q, cu_k, max_seqlen_k, softmax_scale, causal, window,
                                      softcap, alibi_slopes, dropout_p=dropout_p, dropout_mask=keep,
                                      compute_dtype=torch.float32, descales=descales)


def varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_k: int,
                    dropout_p: float, softmax_scale: float, causal: bool, window: Tuple[int, int], softcap: float,
                    alibi_slopes, rng_state, mask_shape, softmax_d: torch.Tensor) -> torch.Tensor:
    """mha_varlen_bwd: gradients into dq, dk, dv from the given out and softmax_lse (H, Tq), one sequence at a time
    (rows no sequence covers get 0); rowsum(dout * out) into the zeroed softmax_d (H, Tq + 128 * B), which it
    returns. mask_shape: (B, H, R(max Sq), R(max Sk)) of the forward's keep mask."""
    keep = None
    if dropout_p > 0.0:
        keep = dropout.keep_mask(rng_state, *mask_shape, dropout_p, False)
    grads = attention_reference_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k,
                                                softmax_scale, causal, window, softcap, alibi_slopes,
                                                dropout_p=dropout_p, dropout_mask=keep, out=out, lse=softmax_lse)
    for target, grad in zip((dq, dk, dv), grads):
        target.copy_(grad)
    softmax_d[:, :q.shape[0]] = (dout.float() * out.float()).sum(-1).t()
    return softmax_d


def kvcache_forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, softmax_scale: float, causal: bool, window: Tuple[int, int], softcap: float,
                    rotary_interleaved: bool, alibi_slopes, descales=None):
    """(out, lse) of mha_fwd_kvcache; k / v are appended into k_cache / v_cache in place, as the kernels do."""
    out, lse, new_k_cache, new_v_cache = kvcache_reference(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, window, softcap, rotary_interleaved, alibi_slopes,
        compute_dtype=torch.float32, descales=descales)
    k_cache.copy_(new_k_cache)
    v_cache.copy_(new_v_cache)
    return out, lse
