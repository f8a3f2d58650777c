"""autograd.Functions of the dense API: save what backward needs, allocate gradients, call the ops.

No kernel is launched here directly; packed variants write their gradients through views of one
packed gradient tensor, so nothing is concatenated.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .backend import empty_like, new_empty
from .checks import has_contiguous_last_dim
from .library import _flash_attn_backward, _flash_attn_forward


def maybe_contiguous(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return x.contiguous() if x is not None and not has_contiguous_last_dim(x) else x


def _window_ints(window_size: Sequence) -> tuple:
    return int(window_size[0]), int(window_size[1])


def _forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
             return_softmax, is_grad_enabled):
    """Shared forward of the three dense Functions; stores what _backward needs on ctx."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    window_left, window_right = _window_ints(window_size)
    q, k, v = maybe_contiguous(q), maybe_contiguous(k), maybe_contiguous(v)
    out, softmax_lse, s_dmask, rng_state = _flash_attn_forward(
        q, k, v, float(dropout_p), float(softmax_scale), bool(causal), window_left, window_right, float(softcap),
        alibi_slopes, bool(return_softmax and dropout_p > 0))
    if is_grad_enabled:
        ctx.save_for_backward(q, k, v, out, softmax_lse, rng_state)
        ctx.options = (float(dropout_p), float(softmax_scale), bool(causal), window_left, window_right,
                       float(softcap), alibi_slopes, bool(deterministic))
    result = (out, softmax_lse, s_dmask) if return_softmax else out
    return result


def _backward(ctx, dout, dq, dk, dv):
    """Run the backward op into the given gradient buffers (views allowed)."""
    q, k, v, out, softmax_lse, rng_state = ctx.saved_tensors
    dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic = ctx.options
    _flash_attn_backward(maybe_contiguous(dout), q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_left, window_right, softcap, alibi_slopes, deterministic, rng_state)


def _needs_grad(is_grad_enabled, *tensors) -> bool:
    return bool(is_grad_enabled) and any(t.requires_grad for t in tensors)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled):
        return _forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_softmax, _needs_grad(is_grad_enabled, q, k, v))

    @staticmethod
    def backward(ctx, dout, *unused_grads):
        q, k, v = ctx.saved_tensors[:3]
        dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
        _backward(ctx, dout, dq, dk, dv)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled):
        qkv = maybe_contiguous(qkv)
        ctx.qkv_shape = qkv.shape
        return _forward(ctx, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                        window_size, softcap, alibi_slopes, deterministic, return_softmax,
                        _needs_grad(is_grad_enabled, qkv))

    @staticmethod
    def backward(ctx, dout, *unused_grads):
        q = ctx.saved_tensors[0]
        dqkv = new_empty(ctx.qkv_shape, q.dtype, q.device)
        _backward(ctx, dout, dqkv[:, :, 0], dqkv[:, :, 1], dqkv[:, :, 2])
        return dqkv, None, None, None, None, None, None, None, None, None


class FlashAttnKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled):
        kv = maybe_contiguous(kv)
        ctx.kv_shape = kv.shape
        return _forward(ctx, q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic, return_softmax, _needs_grad(is_grad_enabled, q, kv))

    @staticmethod
    def backward(ctx, dout, *unused_grads):
        q = ctx.saved_tensors[0]
        dq = empty_like(q)
        dkv = new_empty(ctx.kv_shape, q.dtype, q.device)
        _backward(ctx, dout, dq, dkv[:, :, 0], dkv[:, :, 1])
        return dq, dkv, None, None, None, None, None, None, None, None, None
