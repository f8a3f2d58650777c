"""Every argument check of docs/api.md §6, run before anything is launched (and by the fake implementations).

Messages follow flash_attn's. Strict mode (FLASHTRITON_STRICT=1 at import, or set_strict_checks / strict_checks)
extends the index-value checks of CPU calls to calls on other devices, at one host synchronization per call.
"""

from __future__ import annotations

import operator
import os
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

MAX_HEAD_DIM = 512
# flash_attn_with_kvcache's q / k head dim may reach MLA's (DeepSeek) 512 + 64, with V's at most MAX_HEAD_DIM
MAX_KVCACHE_QK_HEAD_DIM = 576
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def check(condition: bool, message: str, exc=RuntimeError) -> None:
    if not condition:
        raise exc(message)


def _shape_str(names, shape) -> str:
    return f"({', '.join(names)}), got {tuple(shape)}"


def has_contiguous_last_dim(tensor: torch.Tensor) -> bool:
    """Stride 1 in the last dim, or a layout where that stride is never used (last dim of 1, no elements)."""
    return tensor.stride(-1) == 1 or tensor.shape[-1] <= 1 or tensor.numel() == 0


def check_same_device(reference: torch.Tensor, **tensors: Optional[torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != reference.device:
            raise RuntimeError(f"{name} must be on the same device as q ({reference.device}), got {tensor.device}")


def check_device_capability(tensor: torch.Tensor) -> None:
    if tensor.is_cuda and torch.version.cuda is not None:
        check(_major_capability(tensor.device.index) >= 8, "FlashAttention only supports Ampere GPUs or newer.")


@lru_cache(maxsize=None)
def _major_capability(device_index: Optional[int]) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


FP8_DTYPE = torch.float8_e4m3fn
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def check_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """fp16 / bf16 (FA2's), or FP8 e4m3 q, k and v together (forward only; check_fp8 checks the rest)."""
    if q.dtype in SUPPORTED_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype:  # the common case, first
        return
    if q.dtype == FP8_DTYPE or k.dtype == FP8_DTYPE or v.dtype == FP8_DTYPE:
        check(q.dtype == k.dtype == v.dtype == FP8_DTYPE,
              f"FP8 attention takes q, k and v all in torch.float8_e4m3fn, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
        return
    check(q.dtype in SUPPORTED_DTYPES, "FlashAttention only support fp16 and bf16 data type")
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")


def check_head_dim(head_dim: int, direction: str = "forward", of: str = "", limit: int = MAX_HEAD_DIM) -> None:
    """1 <= head_dim <= limit; `of` names the tensor where it is not q's (V's head dim)."""
    if head_dim > limit:
        raise RuntimeError(f"FlashAttention {direction} only supports head dimension at most {limit}"
                           + (f", got {head_dim}" + (f" for {of}" if of else "")))
    if head_dim < 1:
        raise RuntimeError(f"head dimension{' of ' + of if of else ''} must be at least 1, got {head_dim}")


def default_softmax_scale(head_dim: int) -> float:
    """1 / sqrt(head_dim), the softmax_scale of a call that passes None; head_dim 0 raises check_head_dim's error."""
    if head_dim < 1:
        raise RuntimeError(f"head dimension must be at least 1, got {head_dim}")
    return head_dim ** (-0.5)


def check_head_counts(num_heads: int, num_heads_k: int) -> None:
    if num_heads_k < 1 or num_heads % num_heads_k != 0:
        raise RuntimeError(f"Number of heads in key/value must divide number of heads in query, got "
                           f"num_heads_k = {num_heads_k} (k's heads) and num_heads = {num_heads} (q's heads)")


def window_size_ints(window_size) -> Tuple[int, int]:
    """(left, right) of window_size: a pair of int-likes (ints, one-element tensors, ...)."""
    try:
        left, right = window_size
        return int(left), int(right)
    except (TypeError, ValueError) as error:
        raise ValueError(f"window_size must be a pair of ints (left, right), -1 meaning unbounded, got "
                         f"{window_size!r}") from error


def check_shape(tensor: torch.Tensor, name: str, names, expected) -> None:
    if tuple(tensor.shape) != tuple(expected):  # the message is built only on failure (per-call host time)
        raise RuntimeError(f"{name} must have shape {_shape_str(names, tensor.shape)}")


def check_dim(tensor: torch.Tensor, name: str, names) -> None:
    """tensor has len(names) dimensions; the message names them."""
    if tensor.dim() != len(names):
        raise RuntimeError(f"{name} must have shape {_shape_str(names, tensor.shape)}")


def check_dense_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, direction: str = "forward") -> None:
    """q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv): dtypes, devices, shapes, head counts (V's head dim
    may differ from q's, docs/api.md §2.4)."""
    check_dtypes(q, k, v)
    check_same_device(q, k=k, v=v)
    check_device_capability(q)
    check_dim(q, "q", ("batch_size", "seqlen_q", "num_heads", "head_size"))
    batch, _, num_heads, head_dim = q.shape
    check(batch > 0, "batch size must be positive")
    check_head_dim(head_dim, direction)
    check_dim(k, "k", ("batch_size", "seqlen_k", "num_heads_k", "head_size"))
    seqlen_k, num_heads_k = k.shape[1], k.shape[2]
    check_head_counts(num_heads, num_heads_k)
    names = ("batch_size", "seqlen_k", "num_heads_k", "head_size")
    check_shape(k, "k", names, (batch, seqlen_k, num_heads_k, head_dim))
    if v.shape == k.shape:  # the common case: k's checks hold for v
        return
    check_dim(v, "v", ("batch_size", "seqlen_k", "num_heads_k", "head_size_v"))
    check_head_dim(v.shape[-1], direction, "v")
    check_shape(v, "v", ("batch_size", "seqlen_k", "num_heads_k", "head_size_v"),
                (batch, seqlen_k, num_heads_k, v.shape[-1]))


def check_options(dropout_p: float, softcap: float, alibi_slopes: Optional[torch.Tensor], batch: int,
                  num_heads: int, q: torch.Tensor) -> None:
    """dropout range, softcap/dropout exclusion, ALiBi dtype, stride and shape."""
    if not 0.0 <= dropout_p < 1.0:
        check(dropout_p < 1.0, f"dropout_p must be < 1 (failed check p_dropout < 1.f), got {dropout_p}")
        raise RuntimeError(f"dropout_p must be >= 0, got {dropout_p}")
    if softcap > 0.0:
        check(dropout_p == 0.0, "Softcapping does not support dropout for now")
    if alibi_slopes is not None:
        check_same_device(q, alibi_slopes=alibi_slopes)
        check(alibi_slopes.dtype == torch.float32, "ALiBi slopes must have dtype fp32")
        check(alibi_slopes.stride(-1) == 1, "ALiBi slopes tensor must have contiguous last dimension")
        check(tuple(alibi_slopes.shape) in ((num_heads,), (batch, num_heads)),
              f"alibi_slopes must have shape (num_heads) or (batch_size, num_heads) = ({num_heads}) or "
              f"({batch}, {num_heads}), got {tuple(alibi_slopes.shape)}")


SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_learnable_sink(learnable_sink: Optional[torch.Tensor], q: torch.Tensor, num_heads: int) -> None:
    """learnable_sink (docs/api.md §4.11): None, or a (nheads,) fp32 / bf16 / fp16 tensor on q's device."""
    if learnable_sink is None:
        return
    check(isinstance(learnable_sink, torch.Tensor),
          f"learnable_sink must be a tensor of shape (nheads,), got {type(learnable_sink).__name__}", TypeError)
    check(tuple(learnable_sink.shape) == (num_heads,),
          f"learnable_sink must have shape (nheads,) = ({num_heads},), got {tuple(learnable_sink.shape)}")
    check(learnable_sink.dtype in SINK_DTYPES,
          f"learnable_sink must be float32, bfloat16 or float16, got {learnable_sink.dtype}")
    check_same_device(q, learnable_sink=learnable_sink)


def fp8_requested(q: torch.Tensor, descales) -> bool:
    """Whether a call asks for FP8 attention: e4m3 q, or any of the three descales given (check_fp8 then checks it
    all, and rejects descales with 16-bit inputs)."""
    return q.dtype == FP8_DTYPE or descales[0] is not None or descales[1] is not None or descales[2] is not None


def check_fp8(q: torch.Tensor, descales, batch: int, num_heads_k: int, dropout_p: float = 0.0) -> bool:
    """Whether this forward is FP8 (docs/api.md §4.12): e4m3 q (check_dtypes saw k and v) with the three descales,
    each (batch_size, num_heads_k) fp32 on q's device, an sm_89+ GPU or a CPU, no dropout. Descales without FP8
    inputs raise too."""
    descales = tuple(descales) if descales is not None else (None, None, None)
    if not fp8_requested(q, descales):
        return False  # the common case, in O(1)
    given = [name for name, d in zip(DESCALE_NAMES, descales) if d is not None]
    if q.dtype != FP8_DTYPE:
        check(not given,
              f"{', '.join(given)} apply to FP8 (torch.float8_e4m3fn) q, k, v only, got q of dtype {q.dtype}")
        return False
    missing = [name for name, d in zip(DESCALE_NAMES, descales) if d is None]
    check(not missing, f"FP8 (torch.float8_e4m3fn) q, k, v need q_descale, k_descale and v_descale ((batch_size, "
                       f"num_heads_k) = ({batch}, {num_heads_k}) fp32), missing {', '.join(missing)}")
    for name, descale in zip(DESCALE_NAMES, descales):
        check(isinstance(descale, torch.Tensor) and tuple(descale.shape) == (batch, num_heads_k)
              and descale.dtype == torch.float32,
              f"{name} must be a (batch_size, num_heads_k) = ({batch}, {num_heads_k}) float32 tensor, got "
              + (f"{tuple(descale.shape)} {descale.dtype}" if isinstance(descale, torch.Tensor)
                 else type(descale).__name__))
        check_same_device(q, **{name: descale})
    check(dropout_p == 0.0, f"FP8 attention takes no dropout, got dropout_p={dropout_p}")
    if q.is_cuda and torch.version.cuda is not None:
        capability = torch.cuda.get_device_capability(q.device)
        check(capability >= (8, 9), f"FP8 attention needs an sm_89 or newer GPU (FP8 tensor cores), got sm_"
                                    f"{capability[0]}{capability[1]}")
    return True


def check_fwd(q, k, v, dropout_p: float, softcap: float, alibi_slopes, return_softmax: bool) -> None:
    """Every check of the dense forward (docs/api.md §6); also run by the fake implementation."""
    check_dense_qkv(q, k, v)
    check_options(dropout_p, softcap, alibi_slopes, q.shape[0], q.shape[2], q)
    check(not return_softmax or dropout_p > 0.0, "return_softmax is only supported when p_dropout > 0.0")


def _check_bwd_outputs(dout, q, out, dq, dk, dv, k, v) -> None:
    check(out.dtype == q.dtype, "query and out must have the same dtype")
    check(dout.dtype == q.dtype, "query and dout must have the same dtype")
    check(has_contiguous_last_dim(dout), "dout tensor must have contiguous last dimension")
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        # messages are built only on failure (host time per backward call)
        if grad.shape != like.shape:
            raise RuntimeError(f"{name} must have the shape of its input {tuple(like.shape)}, got {tuple(grad.shape)}")
        if grad.dtype != q.dtype:
            raise RuntimeError(f"{name} must have the dtype of q ({q.dtype}), got {grad.dtype}")
        if not has_contiguous_last_dim(grad):
            raise RuntimeError(f"{name} must have contiguous last dimension")
    check_same_device(q, dout=dout, out=out, dq=dq, dk=dk, dv=dv)


def check_no_fp8_backward(q: torch.Tensor) -> None:
    check(q.dtype != FP8_DTYPE, "FP8 attention is forward only: there is no backward for torch.float8_e4m3fn inputs "
                                "(train in bf16 / fp16)")


def check_bwd(dout, q, k, v, out, dq, dk, dv, dropout_p: float, softcap: float, alibi_slopes) -> None:
    """Every check of the dense backward; also run by the fake implementation."""
    check_no_fp8_backward(q)
    check_dense_qkv(q, k, v, direction="backward")
    _check_bwd_outputs(dout, q, out, dq, dk, dv, k, v)
    check_options(dropout_p, softcap, alibi_slopes, q.shape[0], q.shape[2], q)


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, direction: str = "forward") -> int:
    """Checks of docs/api.md §6 for the varlen layout; returns the batch size."""
    check_dtypes(q, k, v)
    check_same_device(q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table)
    check_device_capability(q)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check(cu.dtype == torch.int32, f"{name} must have dtype int32")
        check(cu.is_contiguous(), f"{name} must be contiguous")
        check_dim(cu, name, ("batch_size + 1",))
    batch = cu_seqlens_q.numel() - 1
    check(batch > 0, "batch size must be positive")
    check(cu_seqlens_k.numel() == batch + 1, "cu_seqlens_k must have shape (batch_size + 1)")
    check_dim(q, "q", ("total_q", "num_heads", "head_size"))
    _, num_heads, head_dim = q.shape
    check_head_dim(head_dim, direction)
    if block_table is None:
        check_dim(k, "k", ("total_k", "num_heads_k", "head_size"))
        num_heads_k = k.shape[1]
        names = ("total_k", "num_heads_k", "head_size")
    else:
        check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
        check(block_table.dim() == 2 and block_table.shape[0] == batch,
              f"block_table must have shape (batch_size, max_num_blocks_per_seq), got {tuple(block_table.shape)}")
        check(k.dim() == 4, "k must have shape (num_blocks, page_block_size, num_heads_k, head_size) "
                            f"with block_table, got {tuple(k.shape)}")
        check(k.shape[1] >= 1, f"page_block_size (k.shape[1]) must be at least 1, got k of shape {tuple(k.shape)}")
        num_heads_k = k.shape[2]
        names = ("num_blocks", "page_block_size", "num_heads_k", "head_size")
    check_head_counts(num_heads, num_heads_k)
    check_shape(k, "k", names, (*k.shape[:-2], num_heads_k, head_dim))
    check_dim(v, "v", (*names[:-1], "head_size_v"))
    check_head_dim(v.shape[-1], direction, "v")
    check_shape(v, "v", (*names[:-1], "head_size_v"), (*k.shape[:-1], v.shape[-1]))
    return batch


def _optional_int32(name: str, tensor: Optional[torch.Tensor], batch: int, q: torch.Tensor) -> None:
    if tensor is not None:
        check_same_device(q, **{name: tensor})
        check(tensor.dtype == torch.int32, f"{name} must have dtype int32")
        check(tensor.is_contiguous(), f"{name} must be contiguous")
        check(tuple(tensor.shape) == (batch,), f"{name} must have shape (batch_size), got {tuple(tensor.shape)}")


def check_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p: float, softcap: float, alibi_slopes,
                     return_softmax: bool, block_table, leftpad_k, seqused_k, num_splits: int) -> int:
    """Every check of the varlen forward; returns the batch size. Also run by the fake implementation."""
    batch = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table)
    check_options(dropout_p, softcap, alibi_slopes, batch, q.shape[1], q)
    check(not return_softmax or dropout_p > 0.0, "return_softmax is only supported when p_dropout > 0.0")
    check(block_table is None or leftpad_k is None,
          "We don't support Paged KV and leftpad_k running at the same time yet")
    check(block_table is None or num_splits <= 1, "num_splits > 1 is not supported for varlen paged KV")
    _optional_int32("leftpad_k", leftpad_k, batch, q)
    _optional_int32("seqused_k", seqused_k, batch, q)
    return batch


def check_varlen_bwd(dout, q, k, v, out, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, dropout_p: float, softcap: float,
                     alibi_slopes) -> int:
    """Every check of the varlen backward; returns the batch size. Also run by the fake implementation."""
    check_no_fp8_backward(q)
    batch = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, None, direction="backward")
    _check_bwd_outputs(dout, q, out, dq, dk, dv, k, v)
    check_options(dropout_p, softcap, alibi_slopes, batch, q.shape[1], q)
    return batch


def kv_capacity(k_cache: torch.Tensor, block_table: Optional[torch.Tensor]) -> int:
    """Keys a kv-cache row can hold: its length, or max_num_blocks_per_seq * page_block_size when paged."""
    return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


def check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, softcap, alibi_slopes, num_splits) -> None:
    """Every check of docs/api.md §6 for flash_attn_with_kvcache that needs no host synchronization."""
    if k_cache.stride(-1) != 1:
        raise AssertionError("k_cache must have contiguous last dimension")
    if v_cache.stride(-1) != 1:
        raise AssertionError("v_cache must have contiguous last dimension")
    check_dtypes(q, k_cache, v_cache)
    check_same_device(q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                      cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
                      cache_seqlens=cache_seqlens)
    check_device_capability(q)
    check_dim(q, "q", ("batch_size", "seqlen_q", "num_heads", "head_size"))
    batch, _, num_heads, head_dim = q.shape
    check(batch > 0, "batch size must be positive")
    check_head_dim(head_dim, limit=MAX_KVCACHE_QK_HEAD_DIM)
    if k_cache.dim() != 4:
        raise RuntimeError(f"k_cache must have 4 dimensions, got {tuple(k_cache.shape)}")
    num_heads_k = k_cache.shape[2]
    check_head_counts(num_heads, num_heads_k)
    cache_names = (("num_blocks", "page_block_size") if block_table is not None else ("batch_size_cache", "seqlen_k"))
    check_shape(k_cache, "k_cache", (*cache_names, "num_heads_k", "head_size"),
                (*k_cache.shape[:2], num_heads_k, head_dim))
    if v_cache.dim() != 4:
        raise RuntimeError(f"v_cache must have 4 dimensions, got {tuple(v_cache.shape)}")
    check_head_dim(v_cache.shape[-1], of="v_cache")
    check_shape(v_cache, "v_cache", (*cache_names, "num_heads_k", "head_size_v"),
                (*k_cache.shape[:-1], v_cache.shape[-1]))
    check(num_splits <= 128, "num_splits > 128 not supported")
    check_options(0.0, softcap, alibi_slopes, batch, num_heads, q)
    if block_table is not None:
        check(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
        check(cache_leftpad is None, "We don't support Paged KV and leftpad_k running at the same time yet")
        check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
        check(block_table.dim() == 2 and block_table.shape[0] == batch,
              f"block_table must have shape (batch_size, max_num_blocks_per_seq), got {tuple(block_table.shape)}")
        check(k_cache.shape[1] >= 1,
              f"page_block_size (k_cache.shape[1]) must be at least 1, got k_cache of shape {tuple(k_cache.shape)}")
    capacity = kv_capacity(k_cache, block_table)
    check((k is None) == (v is None), "If key is supplied, value must also be passed in")
    if k is not None:
        check(cache_seqlens is not None, "If key is supplied, seqlens_k must also be passed in")
        check(k.dtype == q.dtype, "Key must have the same dtype as query")
        check(v.dtype == q.dtype, "Value must have the same dtype as query")
        check(k.dim() == 4 and k.shape[1] <= capacity,
              "If key is supplied, it must have seqlen <= the seqlen of the KV cache")
        names = ("batch_size", "seqlen_new", "num_heads_k", "head_size")
        check_shape(k, "k", names, (batch, k.shape[1], num_heads_k, head_dim))
        check(v.dim() == 4, f"v must have shape (batch_size, seqlen_new, num_heads_k, head_size_v), got "
                            f"{tuple(v.shape)}")
        check_shape(v, "v", (*names[:-1], "head_size_v"), (*k.shape[:-1], v_cache.shape[-1]))
    if isinstance(cache_seqlens, torch.Tensor):
        check(cache_seqlens.dtype in (torch.int32, torch.int64), "seqlens_k must have dtype int32 (int64 is converted)")
        check(tuple(cache_seqlens.shape) == (batch,), "seqlens_k must have shape (batch_size)")
        check(cache_seqlens.is_contiguous(), "seqlens_k must be contiguous")
    for name, tensor, message in (("cache_leftpad", cache_leftpad, "leftpad_k must have dtype int32"),
                                  ("cache_batch_idx", cache_batch_idx, "cache_batch_idx must have dtype int32")):
        if tensor is not None:
            check(tensor.dtype == torch.int32, message)
            check(tuple(tensor.shape) == (batch,), f"{name} must have shape (batch_size), got {tuple(tensor.shape)}")
    if rotary_cos is not None or rotary_sin is not None:
        check(k is not None, "If rotary cos/sin are provided, new key / value to be appended to KV cache must "
                             "also be provided")
        check(rotary_cos is not None and rotary_sin is not None,
              "If rotary cos is provided, rotary sin must also be provided")
        rotary_dim = 2 * rotary_cos.shape[1]
        check(rotary_dim <= head_dim, "rotary_dim must be <= headdim")
        check(rotary_dim % 16 == 0, "Only rotary dimensions divisible by 16 are currently supported")
        check(rotary_cos.shape[0] >= capacity and rotary_sin.shape[0] >= capacity,
              "cos/sin seqlen must be at least the seqlen of KV cache")
        check(rotary_cos.dtype == q.dtype and rotary_sin.dtype == q.dtype,
              "rotary_cos must have the same dtype as query")
        check(rotary_sin.shape == rotary_cos.shape, "rotary_sin must have the shape of rotary_cos")


def check_paged_capacity(cache_seqlens: torch.Tensor, seqlen_new: int, capacity: int) -> None:
    """flash_attn's paged-capacity check (docs/api.md §5.2); one host synchronization, as upstream.

    Skipped while a CUDA graph is being captured (a capture cannot read device values). The kernels stay
    in bounds without it: appends past the capacity are not written and reads stop at the capacity.
    """
    if cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    needed = int(cache_seqlens.max()) + seqlen_new
    check(needed <= capacity,
          f"Paged KV cache: max(seqlens_k) + seqlen_knew (= {needed}) exceeds the capacity addressable by "
          f"block_table (max_num_blocks_per_seq * page_block_size = {capacity}). Grow block_table or "
          f"reduce the sequence lengths.")


def cache_seqlens_int(cache_seqlens) -> int:
    """The value of an int cache_seqlens (docs/api.md §5.1: an int or an int32 / int64 (batch_size,) tensor)."""
    try:
        value = operator.index(cache_seqlens)
    except TypeError:
        raise TypeError(f"cache_seqlens must be an int or an int32 / int64 tensor of shape (batch_size), got "
                        f"{type(cache_seqlens).__name__}") from None
    check(value >= 0, f"cache_seqlens must be >= 0, got {value}")
    return value


# ----------------------------------------------------------------------------------------------------------------
# Index values (docs/api.md §6). The kernels and the reference path address memory with these values, so a bad one
# would read or write out of bounds (the interpreter) or cut a sequence silently (the reference path). A CPU
# tensor's values are in host memory already: reading them synchronizes nothing, so CPU calls are always checked.
# Other devices' index tensors are read only in strict mode, copied to the host in one transfer per call (one host
# synchronization), and never while a CUDA graph is being captured: a capture cannot synchronize, and the values
# present at capture time are not the ones a replay uses.
# ----------------------------------------------------------------------------------------------------------------

STRICT_VARIABLE = "FLASHTRITON_STRICT"
_STRICT_ON, _STRICT_OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def parse_strict(value: Optional[str]) -> bool:
    """The strict flag a FLASHTRITON_STRICT value sets: 1/true/yes/on (any case) on; unset, empty, 0/false/no/off
    off; anything else raises ValueError (a typo must not silently leave the checks off)."""
    text = (value or "").strip().lower()
    if text in _STRICT_ON:
        return True
    if text in _STRICT_OFF:
        return False
    raise ValueError(f"{STRICT_VARIABLE} must be 1 (strict index checks on) or 0 (off), got {value!r}")


_strict = parse_strict(os.environ.get(STRICT_VARIABLE))


def strict_checks_enabled() -> bool:
    """Whether strict mode is on: index values of calls on every device are checked on the host."""
    return _strict


def set_strict_checks(enabled: bool) -> bool:
    """Turn strict mode on or off for the whole process; returns the previous setting.

    On, every varlen and kv-cache call on a GPU copies its index tensors (cu_seqlens, seqused_k, leftpad_k,
    block_table, cache_seqlens, cache_batch_idx, cache_leftpad) to the host in one transfer, one synchronization,
    and runs the checks CPU calls run, raising the same RuntimeErrors. Off (the default unless FLASHTRITON_STRICT=1
    was set at import), GPU calls never read index values on the host. Calls made while a CUDA graph is being
    captured are not checked in either mode.
    """
    global _strict
    if not isinstance(enabled, bool):
        raise TypeError(f"set_strict_checks(enabled) takes a bool, got {type(enabled).__name__}")
    previous, _strict = _strict, enabled
    return previous


@contextmanager
def strict_checks(enabled: bool = True) -> Iterator[None]:
    """`with flashtriton.strict_checks():` strict mode on inside the block (off with enabled=False); the previous
    setting comes back on exit. The setting is process-wide, not per thread."""
    previous = set_strict_checks(enabled)
    try:
        yield
    finally:
        set_strict_checks(previous)


def reads_index_values(device_type: str, strict: bool, capturing: bool) -> bool:
    """Whether a call on `device_type` has its index values checked: always on the CPU; elsewhere in strict mode
    only, and not while a CUDA graph is being captured."""
    return device_type == "cpu" or (strict and not capturing)


def copy_index_tensors_to_host(tensors: Dict[str, Optional[torch.Tensor]]) -> Dict[str, Optional[torch.Tensor]]:
    """The tensors (name -> index tensor or None), on the host, with their shapes and dtypes: flattened, widened to
    int64 and concatenated on their device, then copied in one transfer (one synchronization) and split."""
    present = [tensor for tensor in tensors.values() if tensor is not None]
    if not present:
        return dict(tensors)
    flat = torch.cat([tensor.reshape(-1).long() for tensor in present]).cpu()
    host, offset = {}, 0
    for name, tensor in tensors.items():
        if tensor is not None:
            host[name] = flat[offset:offset + tensor.numel()].view(tensor.shape).to(tensor.dtype)
            offset += tensor.numel()
        else:
            host[name] = None
    return host


def index_tensors_to_check(device: torch.device,
                           tensors: Dict[str, Optional[torch.Tensor]]) -> Optional[Dict[str, Optional[torch.Tensor]]]:
    """The index tensors of a call on `device` as host tensors to check, or None where the call is not checked
    (reads_index_values). CPU tensors come back as they are; other devices' are copied to the host at once."""
    if device.type == "cpu":
        return tensors
    strict = _strict
    capturing = strict and device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not reads_index_values(device.type, strict, capturing):
        return None
    return copy_index_tensors_to_host(tensors)


def _first_true(mask: torch.Tensor) -> Optional[tuple]:
    """Index of the first True element of mask, or None."""
    hits = mask.nonzero()
    return tuple(hits[0].tolist()) if hits.shape[0] else None


def _cu_length_name(name: str) -> Callable[[int], str]:
    return lambda b: f"{name}[{b + 1}] - {name}[{b}]"


def check_cu_seqlens_values(name: str, cu_seqlens: torch.Tensor, rows: Optional[int],
                            rows_name: str = "") -> torch.Tensor:
    """cu_seqlens starts at 0, never decreases and (rows given) ends at most at `rows`, the rows of the packed
    tensor (named rows_name in the message). Returns the sequence lengths, (batch_size,) int64."""
    cu = cu_seqlens.long()
    if int(cu[0]) != 0:
        raise RuntimeError(f"{name} must start at 0, got {name}[0] = {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    bad = _first_true(lengths < 0)
    if bad is not None:
        i = bad[0] + 1
        raise RuntimeError(f"{name} must be non-decreasing, got {name}[{i}] = {int(cu[i])} < "
                           f"{name}[{i - 1}] = {int(cu[i - 1])}")
    last = int(cu[-1])
    if rows is not None and last > rows:
        raise RuntimeError(f"{name} must end at most at {rows_name} = {rows}, got {name}[{cu.numel() - 1}] = {last}")
    return lengths


def check_max_seqlen(name: str, max_seqlen: int, lengths: torch.Tensor, length_name: Callable[[int], str]) -> None:
    """max_seqlen is at least every sequence length (lengths[b], named length_name(b) in the message)."""
    longest, b = (int(x) for x in lengths.max(0))
    if max_seqlen < longest:
        raise RuntimeError(f"{name} must be >= the length of every sequence, got {name} = {max_seqlen} < "
                           f"{length_name(b)} = {longest} (sequence {b})")


def check_seqused_k_values(seqused_k: torch.Tensor, lengths_k: torch.Tensor) -> None:
    """seqused_k[b] in [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]]: a sequence uses at most the keys it has."""
    bad = _first_true((seqused_k < 0) | (seqused_k > lengths_k))
    if bad is not None:
        b = bad[0]
        raise RuntimeError(f"seqused_k[{b}] must be in [0, {_cu_length_name('cu_seqlens_k')(b)}] = "
                           f"[0, {int(lengths_k[b])}], got seqused_k[{b}] = {int(seqused_k[b])}")


def check_leftpad_values(name: str, leftpad: torch.Tensor, limits: torch.Tensor,
                         limit_name: Callable[[int], str]) -> None:
    """leftpad[b] in [0, limits[b]]: a row's first key lies inside its keys (limit_name(b) names limits[b])."""
    bad = _first_true((leftpad < 0) | (leftpad > limits))
    if bad is not None:
        b = bad[0]
        raise RuntimeError(f"{name}[{b}] must be in [0, {limit_name(b)}] = [0, {int(limits[b])}], got "
                           f"{name}[{b}] = {int(leftpad[b])}")


def check_cache_batch_idx_values(cache_batch_idx: torch.Tensor, cache_batch: int) -> None:
    """cache_batch_idx[b] in [0, batch_size_cache): it names a row of k_cache / v_cache."""
    bad = _first_true((cache_batch_idx < 0) | (cache_batch_idx >= cache_batch))
    if bad is not None:
        b = bad[0]
        raise RuntimeError(f"cache_batch_idx must be in [0, batch_size_cache) = [0, {cache_batch}) (the rows of "
                           f"k_cache), got cache_batch_idx[{b}] = {int(cache_batch_idx[b])}")


def check_cache_seqlens_values(cache_seqlens: torch.Tensor, seqlen_new: int, capacity: int) -> None:
    """cache_seqlens[b] >= 0 and cache_seqlens[b] + seqlen_new <= capacity: the appended keys fit in the row."""
    bad = _first_true(cache_seqlens < 0)
    if bad is not None:
        raise RuntimeError(f"cache_seqlens must be >= 0, got cache_seqlens[{bad[0]}] = {int(cache_seqlens[bad[0]])}")
    bad = _first_true(cache_seqlens > capacity - seqlen_new)
    if bad is not None:
        b = bad[0]
        raise RuntimeError(f"cache_seqlens[b] + seqlen_new (k.shape[1]) must be <= the capacity of a cache row "
                           f"({capacity}), got cache_seqlens[{b}] + {seqlen_new} = "
                           f"{int(cache_seqlens[b]) + seqlen_new}")


def check_block_table_capacity(block_table: torch.Tensor, lengths: torch.Tensor, page_size: int,
                               length_name: Callable[[int], str]) -> None:
    """Sequence b's lengths[b] keys fit in its row of block_table (max_num_blocks_per_seq pages)."""
    capacity = block_table.shape[1] * page_size
    bad = _first_true(lengths > capacity)
    if bad is not None:
        b = bad[0]
        raise RuntimeError(f"sequence {b} has {length_name(b)} = {int(lengths[b])} keys, more than block_table "
                           f"addresses (max_num_blocks_per_seq * page_block_size = {block_table.shape[1]} * "
                           f"{page_size} = {capacity})")


def check_block_table_values(block_table: torch.Tensor, lengths: torch.Tensor, page_size: int,
                             num_blocks: int) -> None:
    """The entries of block_table that address sequence b's lengths[b] keys (its first ceil(lengths[b] / page_size)
    entries) are in [0, num_blocks). Entries past them are never read and may hold anything, as in flash_attn."""
    pages_used = (lengths + page_size - 1) // page_size
    used = torch.arange(block_table.shape[1]) < pages_used[:, None]
    bad = _first_true(used & ((block_table < 0) | (block_table >= num_blocks)))
    if bad is not None:
        b, j = bad
        raise RuntimeError(f"block_table entries must be in [0, num_blocks) = [0, {num_blocks}) for the pages a "
                           f"sequence uses, got block_table[{b}, {j}] = {int(block_table[b, j])} (sequence {b} uses "
                           f"its first {int(pages_used[b])} entries)")


def _minus_leftpad(name: Callable[[int], str], leftpad_name: str) -> Callable[[int], str]:
    return lambda b: f"{name(b)} - {leftpad_name}[{b}]"


def check_varlen_index_values(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
                              seqused_k: Optional[torch.Tensor] = None) -> None:
    """The index values of a varlen call (forward or backward), read on the host where index_tensors_to_check says
    so (CPU tensors; other devices in strict mode); after check_varlen_fwd/bwd.

    k's rows bound cu_seqlens_k; with block_table, each sequence's cu_seqlens_k length fits in its block_table row
    and the entries for the keys it uses (seqused_k[b], else its length) name pages of k. max_seqlen_k bounds the
    keys a sequence attends: the keys it uses minus leftpad_k.
    """
    host = index_tensors_to_check(q.device, dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                                 block_table=block_table, leftpad_k=leftpad_k, seqused_k=seqused_k))
    if host is None:
        return
    cu_seqlens_q, cu_seqlens_k, block_table, leftpad_k, seqused_k = (
        host[name] for name in ("cu_seqlens_q", "cu_seqlens_k", "block_table", "leftpad_k", "seqused_k"))
    lengths_q = check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q.shape[0] (total_q)")
    paged = block_table is not None
    lengths_k = check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0],
                                        "k.shape[0] (total_k)")
    check_max_seqlen("max_seqlen_q", max_seqlen_q, lengths_q, _cu_length_name("cu_seqlens_q"))
    keys, keys_name = lengths_k, _cu_length_name("cu_seqlens_k")
    if paged:
        check_block_table_capacity(block_table, lengths_k, k.shape[1], keys_name)
    if seqused_k is not None:
        check_seqused_k_values(seqused_k, lengths_k)
        keys, keys_name = seqused_k.long(), (lambda b: f"seqused_k[{b}]")
    if paged:
        check_block_table_values(block_table, keys, k.shape[1], k.shape[0])
    if leftpad_k is not None:
        check_leftpad_values("leftpad_k", leftpad_k, keys, keys_name)
        keys, keys_name = keys - leftpad_k.long(), _minus_leftpad(keys_name, "leftpad_k")
    check_max_seqlen("max_seqlen_k", max_seqlen_k, keys, keys_name)


def check_kvcache_index_values(q: torch.Tensor, k_cache: torch.Tensor, seqlen_new: int,
                               cache_seqlens: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],
                               cache_leftpad: Optional[torch.Tensor], block_table: Optional[torch.Tensor]) -> None:
    """The index values of a flash_attn_with_kvcache call; after check_kvcache. First flash_attn's paged-capacity
    check (its message), on every device; then, where index_tensors_to_check says so (CPU tensors; other devices in
    strict mode), the checks of docs/api.md §6 on host values, read with the paged-capacity check's in one transfer."""
    host = index_tensors_to_check(q.device, dict(cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                                                 cache_leftpad=cache_leftpad, block_table=block_table))
    capacity = kv_capacity(k_cache, block_table)
    if cache_seqlens is not None and block_table is not None:
        check_paged_capacity(cache_seqlens if host is None else host["cache_seqlens"], seqlen_new, capacity)
    if host is None:
        return
    cache_seqlens, cache_batch_idx, cache_leftpad, block_table = (
        host[name] for name in ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table"))
    if cache_batch_idx is not None:
        check_cache_batch_idx_values(cache_batch_idx, k_cache.shape[0])
    if cache_seqlens is None:  # every row holds `capacity` keys
        ends, ends_name = torch.full((q.shape[0],), capacity), (lambda b: "the capacity")
    else:
        check_cache_seqlens_values(cache_seqlens, seqlen_new, capacity)
        ends, ends_name = cache_seqlens.long(), (lambda b: f"cache_seqlens[{b}]")
    if cache_leftpad is not None:
        check_leftpad_values("cache_leftpad", cache_leftpad, ends, ends_name)
    if block_table is not None:
        check_block_table_values(block_table, ends + seqlen_new, k_cache.shape[1], k_cache.shape[0])
