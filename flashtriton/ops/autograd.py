"""autograd.Functions of the dense API: save what backward needs, allocate gradients, call the ops.

No kernel is launched here directly; packed variants write their gradients through views of one
packed gradient tensor, so nothing is concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .backend import empty_like, new_empty
from .checks import default_softmax_scale, has_contiguous_last_dim, window_size_ints
from .library import flash_backward, flash_forward, flash_varlen_backward, flash_varlen_forward
from .sink import sink_grad


def maybe_contiguous(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return x.contiguous() if x is not None and not has_contiguous_last_dim(x) else x


@dataclass(frozen=True)
class VarlenLayout:
    """What the varlen functions add to the dense ones."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: Optional[torch.Tensor] = None


def _forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
             return_softmax, needs_grad, varlen: Optional[VarlenLayout] = None, learnable_sink=None):
    """Shared forward of every Function; stores what _backward needs on ctx (the sink last among the saved
    tensors, when there is one)."""
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1])
    window_left, window_right = window_size_ints(window_size)
    q, k, v = maybe_contiguous(q), maybe_contiguous(k), maybe_contiguous(v)
    options = (float(dropout_p), float(softmax_scale), bool(causal), window_left, window_right, float(softcap),
               alibi_slopes)
    return_softmax_op = bool(return_softmax and dropout_p > 0)
    sink_args = () if learnable_sink is None else (learnable_sink,)
    if varlen is None:
        out, softmax_lse, s_dmask, rng_state = flash_forward(q, k, v, *options, return_softmax_op, *sink_args)
    else:
        sink_args = () if learnable_sink is None else (None, None, False, 0, learnable_sink)
        out, softmax_lse, s_dmask, rng_state = flash_varlen_forward(
            q, k, v, varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.max_seqlen_q, varlen.max_seqlen_k, *options,
            return_softmax_op, varlen.block_table, *sink_args)
    if needs_grad:
        cu_seqlens = () if varlen is None else (varlen.cu_seqlens_q, varlen.cu_seqlens_k)
        ctx.has_sink = learnable_sink is not None
        ctx.save_for_backward(q, k, v, out, softmax_lse, rng_state, *cu_seqlens,
                              *(() if learnable_sink is None else (learnable_sink,)))
        ctx.options = (*options, bool(deterministic))
        ctx.max_seqlens = None if varlen is None else (varlen.max_seqlen_q, varlen.max_seqlen_k)
        ctx.is_paged = varlen is not None and varlen.block_table is not None
    return (out, softmax_lse, s_dmask) if return_softmax else out


def _backward(ctx, saved, dout, dq, dk, dv) -> Optional[torch.Tensor]:
    """Run the backward op into the given gradient buffers (views allowed); saved: ctx.saved_tensors, unpacked
    once by the caller (each access unpacks every saved tensor again). Returns the sink's gradient (None without a
    sink): from the LSE and the backward's softmax_d (ops/sink.py)."""
    q, k, v, out, softmax_lse, rng_state, *rest = saved
    learnable_sink = rest[-1] if ctx.has_sink else None
    cu_seqlens = rest[:-1] if ctx.has_sink else rest  # no list.pop: torch.compile traces the saved tensors as a tuple
    dout = maybe_contiguous(dout)
    if ctx.max_seqlens is None:
        softmax_d = flash_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, *ctx.options, rng_state)
        return None if learnable_sink is None else sink_grad(softmax_lse, softmax_d, learnable_sink)
    if ctx.is_paged:
        raise RuntimeError("flash_attn_varlen_func with block_table (paged K/V) has no backward; "
                           "it is meant for inference")
    softmax_d = flash_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, *cu_seqlens, *ctx.max_seqlens,
                                      *ctx.options, rng_state)
    return None if learnable_sink is None else sink_grad(softmax_lse[None], softmax_d[None], learnable_sink)


def fp8_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax,
                learnable_sink, descales, varlen: Optional[VarlenLayout] = None):
    """The forward of FP8 inputs (docs/api.md §4.12), outside autograd: it has no backward, and refuses inputs that
    need a gradient. Returns what the autograd functions return (out bf16)."""
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v, learnable_sink)):
        raise RuntimeError("FP8 attention is forward only: no input may require grad (run it under torch.no_grad() "
                           "or detach the inputs)")
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1])
    window_left, window_right = window_size_ints(window_size)
    q, k, v = maybe_contiguous(q), maybe_contiguous(k), maybe_contiguous(v)
    options = (float(dropout_p), float(softmax_scale), bool(causal), window_left, window_right, float(softcap),
               alibi_slopes, False)
    if varlen is None:
        out, softmax_lse, s_dmask, _ = flash_forward(q, k, v, *options, learnable_sink, *descales)
    else:
        out, softmax_lse, s_dmask, _ = flash_varlen_forward(
            q, k, v, varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.max_seqlen_q, varlen.max_seqlen_k, *options,
            varlen.block_table, None, None, False, 0, learnable_sink, *descales)
    return (out, softmax_lse, s_dmask) if return_softmax else out


def _needs_grad(is_grad_enabled, *tensors) -> bool:
    return bool(is_grad_enabled) and any(getattr(t, "requires_grad", False) for t in tensors)


class _InferenceContext:
    """Stands in for autograd's ctx when nothing needs a gradient; forward() may set attributes on it."""


def apply(function, differentiable: tuple, *args):
    """function.apply(*args, is_grad_enabled), or only its forward when no tensor in `differentiable` needs a
    gradient: the outputs are the same, and inference calls skip autograd.Function's host cost (~20 us)."""
    if _needs_grad(torch.is_grad_enabled(), *differentiable):
        return function.apply(*args, True)
    return function.forward(_InferenceContext(), *args, False)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, learnable_sink, is_grad_enabled):
        return _forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_softmax, _needs_grad(is_grad_enabled, q, k, v, learnable_sink),
                        learnable_sink=learnable_sink)

    @staticmethod
    def backward(ctx, dout, *unused_grads):
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
        dsink = _backward(ctx, saved, dout, dq, dk, dv)
        return dq, dk, dv, None, None, None, None, None, None, None, None, dsink, None


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, learnable_sink, is_grad_enabled):
        needs_grad = _needs_grad(is_grad_enabled, qkv, learnable_sink)
        qkv = maybe_contiguous(qkv)
        ctx.qkv_shape = qkv.shape
        return _forward(ctx, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                        window_size, softcap, alibi_slopes, deterministic, return_softmax, needs_grad,
                        learnable_sink=learnable_sink)

    @staticmethod
    def backward(ctx, dout, *unused_grads):
        saved = ctx.saved_tensors
        q = saved[0]
        dqkv = new_empty(ctx.qkv_shape, q.dtype, q.device)
        dsink = _backward(ctx, saved, dout, dqkv[:, :, 0], dqkv[:, :, 1], dqkv[:, :, 2])
        return dqkv, None, None, None, None, None, None, None, None, dsink, None


class FlashAttnKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, learnable_sink, is_grad_enabled):
        needs_grad = _needs_grad(is_grad_enabled, q, kv, learnable_sink)
        kv = maybe_contiguous(kv)
        ctx.kv_shape = kv.shape
        return _forward(ctx, q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic, return_softmax, needs_grad, learnable_sink=learnable_sink)

    @staticmethod
    def backward(ctx, dout, *unused_grads):
        saved = ctx.saved_tensors
        q = saved[0]
        dq = empty_like(q)
        dkv = new_empty(ctx.kv_shape, q.dtype, q.device)
        dsink = _backward(ctx, saved, dout, dq, dkv[:, :, 0], dkv[:, :, 1])
        return dq, dkv, None, None, None, None, None, None, None, None, dsink, None


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, window_size, softcap, alibi_slopes, deterministic, return_softmax, block_table,
                learnable_sink, is_grad_enabled):
        varlen = VarlenLayout(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), block_table)
        return _forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_softmax, _needs_grad(is_grad_enabled, q, k, v, learnable_sink), varlen,
                        learnable_sink)

    @staticmethod
    def backward(ctx, dout, *unused_grads):
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
        dsink = _backward(ctx, saved, dout, dq, dk, dv)
        return (dq, dk, dv) + (None,) * 13 + (dsink, None)


class FlashAttnVarlenQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax, learnable_sink, is_grad_enabled):
        needs_grad = _needs_grad(is_grad_enabled, qkv, learnable_sink)
        qkv = maybe_contiguous(qkv)
        ctx.qkv_shape = qkv.shape
        varlen = VarlenLayout(cu_seqlens, cu_seqlens, int(max_seqlen), int(max_seqlen))
        return _forward(ctx, qkv[:, 0], qkv[:, 1], qkv[:, 2], dropout_p, softmax_scale, causal, window_size,
                        softcap, alibi_slopes, deterministic, return_softmax, needs_grad, varlen, learnable_sink)

    @staticmethod
    def backward(ctx, dout, *unused_grads):
        saved = ctx.saved_tensors
        q = saved[0]
        dqkv = new_empty(ctx.qkv_shape, q.dtype, q.device)
        dsink = _backward(ctx, saved, dout, dqkv[:, 0], dqkv[:, 1], dqkv[:, 2])
        return (dqkv,) + (None,) * 10 + (dsink, None)


class FlashAttnVarlenKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, window_size, softcap, alibi_slopes, deterministic, return_softmax, learnable_sink,
                is_grad_enabled):
        needs_grad = _needs_grad(is_grad_enabled, q, kv, learnable_sink)
        kv = maybe_contiguous(kv)
        ctx.kv_shape = kv.shape
        varlen = VarlenLayout(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
        return _forward(ctx, q, kv[:, 0], kv[:, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic, return_softmax, needs_grad, varlen, learnable_sink)

    @staticmethod
    def backward(ctx, dout, *unused_grads):
        saved = ctx.saved_tensors
        q = saved[0]
        dq = empty_like(q)
        dkv = new_empty(ctx.kv_shape, q.dtype, q.device)
        dsink = _backward(ctx, saved, dout, dq, dkv[:, 0], dkv[:, 1])
        return (dq, dkv) + (None,) * 12 + (dsink, None)
