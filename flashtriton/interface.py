"""The public flash_attn 2.x functions: argument normalization and documentation only.

Signatures, positional order, defaults and return structures follow flash_attn 2.8 exactly
(docs/api.md §3). Tensors are (batch, seqlen, nheads, headdim); any batch/sequence/head strides
are accepted as long as the last dimension is contiguous (otherwise a copy is made).
"""

from __future__ import annotations

import torch

from .ops.autograd import (FlashAttnFunc, FlashAttnKVPackedFunc, FlashAttnQKVPackedFunc, FlashAttnVarlenFunc,
                           FlashAttnVarlenKVPackedFunc, FlashAttnVarlenQKVPackedFunc, VarlenLayout, apply, fp8_forward,
                           maybe_contiguous)
from .ops.checks import cache_seqlens_int, default_softmax_scale, fp8_requested, window_size_ints
from .ops.library import flash_kvcache

_COMMON_DOC = """
    dropout_p: float, dropout probability (pass 0.0 at evaluation).
    softmax_scale: float, scaling of QK^T before softmax; default 1 / sqrt(headdim).
    causal: bool, bottom-right aligned causal mask.
    window_size: (left, right), sliding-window local attention; -1 means unbounded on that side.
    softcap: float, > 0 enables softcap * tanh(scores / softcap).
    alibi_slopes: (nheads,) or (batch_size, nheads) fp32; adds -slope * |i + seqlen_k - seqlen_q - j|.
    deterministic: bool, bitwise-reproducible backward: dQ is never added in an arbitrary order (without it, the
        Hopper backward at head dims 64 and 128 adds dQ by unordered reductions).
    return_attn_probs: bool, also return (softmax_lse, S_dmask); S_dmask is empty unless dropout_p > 0.
    learnable_sink (keyword only, FA4's name): (nheads,) fp32 / bf16 / fp16 attention sinks: each row's softmax
        also sums exp(learnable_sink[h]), a logit with no value (no scale, softcap or ALiBi applied to it), so
        out = sum_j p_j v_j with sum_j p_j + p_sink = 1; rows that see no key give out 0. softmax_lse includes the
        sink (rows without a key: learnable_sink[h]). Differentiable (dsink).
    q_descale, k_descale, v_descale (keyword only, FA3's names): (batch_size, nheads_k) fp32 each, required with
        torch.float8_e4m3fn q, k, v (FP8): attention of q * q_descale, k * k_descale, v * v_descale, P and V
        entering the P.V product in fp16 (docs/api.md §4.12), out in bf16; forward only (no dropout; inputs must
        not require grad).
Return:
    out, or (out, softmax_lse (batch_size, nheads, seqlen_q) fp32, S_dmask) with return_attn_probs.
"""


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              learnable_sink=None):
    return apply(FlashAttnQKVPackedFunc, (qkv, learnable_sink), qkv, dropout_p, softmax_scale, causal, window_size,
                 softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             learnable_sink=None):
    return apply(FlashAttnKVPackedFunc, (q, kv, learnable_sink), q, kv, dropout_p, softmax_scale, causal, window_size,
                 softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, learnable_sink=None,
                    q_descale=None, k_descale=None, v_descale=None):
    descales = (q_descale, k_descale, v_descale)
    if fp8_requested(q, descales):
        return fp8_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           return_attn_probs, learnable_sink, descales)
    return apply(FlashAttnFunc, (q, k, v, learnable_sink), q, k, v, dropout_p, softmax_scale, causal, window_size,
                 softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink)


flash_attn_qkvpacked_func.__doc__ = """Attention on packed qkv (batch_size, seqlen, 3, nheads, headdim).

Same as flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], ...) but the backward writes one dqkv.
Arguments:""" + _COMMON_DOC
flash_attn_kvpacked_func.__doc__ = """Attention with q (batch_size, seqlen_q, nheads, headdim) and packed kv
(batch_size, seqlen_k, 2, nheads_k, headdim); nheads_k must divide nheads (GQA/MQA).
Arguments:""" + _COMMON_DOC
flash_attn_func.__doc__ = """Attention with q (batch_size, seqlen_q, nheads, headdim), k and v
(batch_size, seqlen_k, nheads_k, headdim); nheads_k must divide nheads (GQA/MQA). v may have its own head dim
headdim_v (then out has it too); head dims up to 512.
Arguments:""" + _COMMON_DOC


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, learnable_sink=None):
    return apply(FlashAttnVarlenQKVPackedFunc, (qkv, learnable_sink), qkv, cu_seqlens, max_seqlen, dropout_p,
                 softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                 learnable_sink)


def _distinct_inputs(cu_seqlens_q, cu_seqlens_k):
    """cu_seqlens_k as a separate tensor object when it is cu_seqlens_q (self-attention passes one tensor twice):
    torch.compile cannot trace an autograd.Function that receives one tensor in two inputs."""
    return cu_seqlens_q.view(cu_seqlens_q.shape) if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    learnable_sink=None):
    cu_seqlens_k = _distinct_inputs(cu_seqlens_q, cu_seqlens_k)
    return apply(FlashAttnVarlenKVPackedFunc, (q, kv, learnable_sink), q, kv, cu_seqlens_q, cu_seqlens_k,
                 max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                 deterministic, return_attn_probs, learnable_sink)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           learnable_sink=None, q_descale=None, k_descale=None, v_descale=None):
    cu_seqlens_k = _distinct_inputs(cu_seqlens_q, cu_seqlens_k)
    descales = (q_descale, k_descale, v_descale)
    if fp8_requested(q, descales):
        varlen = VarlenLayout(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), block_table)
        return fp8_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           return_attn_probs, learnable_sink, descales, varlen)
    return apply(FlashAttnVarlenFunc, (q, k, v, learnable_sink), q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 return_attn_probs, block_table, learnable_sink)


_VARLEN_DOC = """
    cu_seqlens_q / cu_seqlens_k: (batch_size + 1,) int32 cumulative sequence starts; sequence b is rows
        cu_seqlens[b]:cu_seqlens[b+1]. max_seqlen_q / max_seqlen_k: upper bounds on the lengths (ints).
    Masks, ALiBi positions and windows are per sequence, bottom-right aligned.
""" + _COMMON_DOC.replace("(batch_size, nheads, seqlen_q)", "(nheads, total_q)")

flash_attn_varlen_qkvpacked_func.__doc__ = """Varlen attention on packed qkv (total, 3, nheads, headdim) with one
cu_seqlens / max_seqlen for queries and keys.
Arguments:""" + _VARLEN_DOC
flash_attn_varlen_kvpacked_func.__doc__ = """Varlen attention with q (total_q, nheads, headdim) and packed kv
(total_k, 2, nheads_k, headdim).
Arguments:""" + _VARLEN_DOC
flash_attn_varlen_func.__doc__ = """Varlen attention with q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim)
(v may have its own head dim headdim_v, then out has it too).
With block_table (batch_size, max_blocks_per_seq) int32, k/v are paged caches (num_blocks, page_block_size,
nheads_k, headdim), any page size; key t of sequence b is k[block_table[b, t // page_size], t % page_size].
This paged form is forward-only (its backward raises).
Arguments:""" + _VARLEN_DOC


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            learnable_sink=None, q_descale=None, k_descale=None, v_descale=None):
    """Attention over a KV cache, appending new keys/values in place first (inference; no autograd).

    q (batch_size, seqlen_q, nheads, headdim); k_cache/v_cache (batch_size_cache, seqlen_cache, nheads_k,
    headdim), or paged (num_blocks, page_block_size, nheads_k, headdim) with block_table
    (batch_size, max_num_blocks_per_seq) int32 (any page size). k/v (batch_size, seqlen_new, nheads_k,
    headdim) are written at positions cache_seqlens[b] ... (after rotary for k, with rotary_cos/sin of shape
    (seqlen_ro, rotary_dim / 2)); cache_seqlens (int or (batch_size,) int32) is not incremented.
    cache_batch_idx picks the cache row of each batch row; cache_leftpad is where each row's keys start.
    Causal/window/ALiBi are bottom-right aligned to the valid keys. num_splits (split-KV: 0 = heuristic,
    1 = none, n <= 128 parts) only affects speed; each fixed value is deterministic.
    learnable_sink (keyword only): (nheads,) attention sinks, as flash_attn_func's (included in softmax_lse).
    q_descale, k_descale, v_descale (keyword only): FP8 q / caches' descales, as flash_attn_func's (out in bf16).
    v_cache and v may have their own head dim (the output's), e.g. MLA's q / k 576 and v 512.
    Return: out, or (out, softmax_lse (batch_size, nheads, seqlen_q)) with return_softmax_lse.
    """
    assert k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
    assert v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension"
    q, k, v = (maybe_contiguous(t) for t in (q, k, v))
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1])
    window_left, window_right = window_size_ints(window_size)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens_int(cache_seqlens), dtype=torch.int32,
                                   device=k_cache.device)
    cache_seqlens, cache_batch_idx, block_table = (maybe_contiguous(t) for t in (cache_seqlens, cache_batch_idx,
                                                                                 block_table))
    with torch.no_grad():
        out, softmax_lse = flash_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                         cache_batch_idx, cache_leftpad, block_table, float(softmax_scale),
                                         bool(causal), window_left, window_right, float(softcap),
                                         bool(rotary_interleaved), alibi_slopes, int(num_splits),
                                         *(() if learnable_sink is None and q_descale is None and k_descale is None
                                           and v_descale is None
                                           else (learnable_sink, q_descale, k_descale, v_descale)))
    return (out, softmax_lse) if return_softmax_lse else out
