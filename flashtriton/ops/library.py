"""torch.library custom ops and their fake (meta) implementations: the torch.compile boundary.

Named `flashtriton::*` so they never clash with a real flash_attn installed beside us. The op
objects are callable and serve as flash_attn's low-level `_flash_attn_*` functions (docs/api.md §7).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import backend, checks, kvcache


def _round128(x: int) -> int:
    return backend.round_multiple(x, 128)


@torch.library.custom_op("flashtriton::_flash_attn_forward", mutates_args=(), device_types=None)
def _flash_attn_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    return_softmax: bool,
    learnable_sink: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Dense forward; returns (out, softmax_lse (B, H, Sq) fp32, S_dmask, rng_state (2,) int64). learnable_sink
    (H,): sinks, included in softmax_lse (docs/api.md §4.11); q/k/v_descale: FP8 inputs' (§4.12), out in bf16."""
    return backend.mha_fwd(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                           softcap, alibi_slopes, return_softmax, learnable_sink, q_descale, k_descale, v_descale)


@_flash_attn_forward.register_fake
def _flash_attn_forward_fake(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                             softcap, alibi_slopes, return_softmax, learnable_sink=None, q_descale=None,
                             k_descale=None, v_descale=None):
    checks.check_fwd(q, k, v, dropout_p, softcap, alibi_slopes, return_softmax)
    checks.check_learnable_sink(learnable_sink, q, q.shape[2])
    fp8 = checks.check_fp8(q, (q_descale, k_descale, v_descale), q.shape[0], k.shape[2], dropout_p)
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    out = q.new_empty(batch, seqlen_q, num_heads, v.shape[-1], dtype=torch.bfloat16 if fp8 else q.dtype)
    softmax_lse = q.new_empty(batch, num_heads, seqlen_q, dtype=torch.float32)
    if return_softmax:
        s_dmask = q.new_empty(batch, num_heads, _round128(seqlen_q), _round128(seqlen_k))
    else:
        s_dmask = q.new_empty(0)
    rng_state = q.new_empty(2, dtype=torch.int64)
    return out, softmax_lse, s_dmask, rng_state


@torch.library.custom_op("flashtriton::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types=None)
def _flash_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    deterministic: bool,
    rng_state: Optional[Tensor] = None,
) -> Tensor:
    """Dense backward into dq, dk, dv (written in place); returns softmax_d (B, H, R(Sq)) fp32."""
    return backend.mha_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                           window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state)


@_flash_attn_backward.register_fake
def _flash_attn_backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                              window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                              rng_state=None):
    checks.check_bwd(dout, q, k, v, out, dq, dk, dv, dropout_p, softcap, alibi_slopes)
    batch, seqlen_q, num_heads, _ = q.shape
    return q.new_empty(batch, num_heads, _round128(seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flashtriton::_flash_attn_varlen_forward", mutates_args=(), device_types=None)
def _flash_attn_varlen_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[Tensor] = None,
    leftpad_k: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    zero_tensors: bool = False,
    num_splits: int = 0,
    learnable_sink: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Varlen forward; returns (out (Tq, H, D), softmax_lse (H, Tq) fp32, S_dmask, rng_state)."""
    return backend.mha_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                  return_softmax, block_table, leftpad_k, seqused_k, zero_tensors, num_splits,
                                  learnable_sink, q_descale, k_descale, v_descale)


@_flash_attn_varlen_forward.register_fake
def _flash_attn_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                    softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                    alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                                    seqused_k=None, zero_tensors=False, num_splits=0, learnable_sink=None,
                                    q_descale=None, k_descale=None, v_descale=None):
    batch = checks.check_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softcap, alibi_slopes,
                                    return_softmax, block_table, leftpad_k, seqused_k, num_splits)
    checks.check_learnable_sink(learnable_sink, q, q.shape[1])
    fp8 = checks.check_fp8(q, (q_descale, k_descale, v_descale), batch, k.shape[-2], dropout_p)
    total_q, num_heads, head_dim = q.shape
    out = q.new_empty(total_q, num_heads, v.shape[-1], dtype=torch.bfloat16 if fp8 else q.dtype)
    softmax_lse = q.new_empty(num_heads, total_q, dtype=torch.float32)
    if return_softmax:
        s_dmask = q.new_empty(batch, num_heads, _round128(max_seqlen_q), _round128(max_seqlen_k))
    else:
        s_dmask = q.new_empty(0)
    return out, softmax_lse, s_dmask, q.new_empty(2, dtype=torch.int64)


@torch.library.custom_op("flashtriton::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                         device_types=None)
def _flash_attn_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    deterministic: bool,
    rng_state: Optional[Tensor] = None,
    zero_tensors: bool = False,
) -> Tensor:
    """Varlen backward into dq, dk, dv (in place); returns softmax_d (H, Tq + 128 * B) fp32."""
    return backend.mha_varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                  window_size_right, softcap, alibi_slopes, deterministic, rng_state, zero_tensors)


@_flash_attn_varlen_backward.register_fake
def _flash_attn_varlen_backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                     window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                     zero_tensors=False):
    batch = checks.check_varlen_bwd(dout, q, k, v, out, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, dropout_p, softcap,
                                    alibi_slopes)
    return q.new_empty(q.shape[1], q.shape[0] + 128 * batch, dtype=torch.float32)


@torch.library.custom_op("flashtriton::fwd_kvcache", mutates_args=("k_cache", "v_cache"), device_types=None)
def fwd_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    cache_seqlens: Optional[Tensor],
    cache_batch_idx: Optional[Tensor],
    cache_leftpad: Optional[Tensor],
    block_table: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    rotary_interleaved: bool,
    alibi_slopes: Optional[Tensor],
    num_splits: int,
    learnable_sink: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """KV-cache forward: appends k/v into the caches (in place), returns (out, softmax_lse (B, H, Sq))."""
    return kvcache.mha_fwd_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                   cache_leftpad, block_table, softmax_scale, causal, window_size_left,
                                   window_size_right, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                   learnable_sink, q_descale, k_descale, v_descale)


@fwd_kvcache.register_fake
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      cache_leftpad, block_table, softmax_scale, causal, window_size_left, window_size_right, softcap,
                      rotary_interleaved, alibi_slopes, num_splits, learnable_sink=None, q_descale=None,
                      k_descale=None, v_descale=None):
    checks.check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, softcap, alibi_slopes, num_splits)
    checks.check_learnable_sink(learnable_sink, q, q.shape[2])
    fp8 = checks.check_fp8(q, (q_descale, k_descale, v_descale), q.shape[0], k_cache.shape[2])
    batch, seqlen_q, num_heads, _ = q.shape
    out = q.new_empty(batch, seqlen_q, num_heads, v_cache.shape[-1], dtype=torch.bfloat16 if fp8 else q.dtype)
    return out, q.new_empty(batch, num_heads, seqlen_q, dtype=torch.float32)


def eager_or_op(op, implementation):
    """What the public functions call: the custom op while torch.compile traces (it needs the op boundary and
    the fake implementation) or for tensor subclasses (fake tensors, wrappers); in plain eager mode the
    implementation itself, which skips torch.library's Python dispatch layers (about 0.1 ms of host time per call,
    as much as a whole decode step's GPU time)."""
    def call(*args):
        if torch.compiler.is_compiling() or type(args[0]) is not torch.Tensor:
            return op(*args)
        return implementation(*args)

    call.__name__ = call.__qualname__ = implementation.__name__
    return call


flash_forward = eager_or_op(_flash_attn_forward, backend.mha_fwd)
flash_backward = eager_or_op(_flash_attn_backward, backend.mha_bwd)
flash_varlen_forward = eager_or_op(_flash_attn_varlen_forward, backend.mha_varlen_fwd)
flash_varlen_backward = eager_or_op(_flash_attn_varlen_backward, backend.mha_varlen_bwd)
flash_kvcache = eager_or_op(fwd_kvcache, kvcache.mha_fwd_kvcache)
