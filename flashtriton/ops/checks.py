"""Every argument check of docs/api.md §6, run before anything is launched (and by the fake implementations).

Messages follow flash_attn's.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

MAX_HEAD_DIM = 256
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


def check_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check(q.dtype in SUPPORTED_DTYPES, "FlashAttention only support fp16 and bf16 data type")
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")


def check_head_dim(head_dim: int, direction: str = "forward") -> None:
    if head_dim > MAX_HEAD_DIM:
        raise RuntimeError(f"FlashAttention {direction} only supports head dimension at most {MAX_HEAD_DIM}")
    if head_dim < 1:
        raise RuntimeError(f"head dimension must be at least 1, got {head_dim}")


def check_shape(tensor: torch.Tensor, name: str, names, expected) -> None:
    if tuple(tensor.shape) != tuple(expected):  # the message is built only on failure (per-call host time)
        raise RuntimeError(f"{name} must have shape {_shape_str(names, tensor.shape)}")


def check_dim(tensor: torch.Tensor, name: str, names) -> None:
    """tensor has len(names) dimensions; the message names them."""
    if tensor.dim() != len(names):
        raise RuntimeError(f"{name} must have shape {_shape_str(names, tensor.shape)}")


def check_dense_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, direction: str = "forward") -> None:
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D): dtypes, devices, shapes, head counts."""
    check_dtypes(q, k, v)
    check_same_device(q, k=k, v=v)
    check_device_capability(q)
    check_dim(q, "q", ("batch_size", "seqlen_q", "num_heads", "head_size"))
    batch, _, num_heads, head_dim = q.shape
    check(batch > 0, "batch size must be positive")
    check_head_dim(head_dim, direction)
    check_dim(k, "k", ("batch_size", "seqlen_k", "num_heads_k", "head_size"))
    seqlen_k, num_heads_k = k.shape[1], k.shape[2]
    check(num_heads_k > 0 and num_heads % num_heads_k == 0,
          "Number of heads in key/value must divide number of heads in query")
    names = ("batch_size", "seqlen_k", "num_heads_k", "head_size")
    check_shape(k, "k", names, (batch, seqlen_k, num_heads_k, head_dim))
    check_shape(v, "v", names, (batch, seqlen_k, num_heads_k, head_dim))


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


def check_bwd(dout, q, k, v, out, dq, dk, dv, dropout_p: float, softcap: float, alibi_slopes) -> None:
    """Every check of the dense backward; also run by the fake implementation."""
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
        num_heads_k = k.shape[2]
        names = ("num_blocks", "page_block_size", "num_heads_k", "head_size")
    check(num_heads_k > 0 and num_heads % num_heads_k == 0,
          "Number of heads in key/value must divide number of heads in query")
    check_shape(k, "k", names, (*k.shape[:-2], num_heads_k, head_dim))
    check_shape(v, "v", names, k.shape)
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
    check_head_dim(head_dim)
    if k_cache.dim() != 4:
        raise RuntimeError(f"k_cache must have 4 dimensions, got {tuple(k_cache.shape)}")
    num_heads_k = k_cache.shape[2]
    check(num_heads_k > 0 and num_heads % num_heads_k == 0,
          "Number of heads in key/value must divide number of heads in query")
    cache_names = (("num_blocks", "page_block_size") if block_table is not None else ("batch_size_cache", "seqlen_k"))
    check_shape(k_cache, "k_cache", (*cache_names, "num_heads_k", "head_size"),
                (*k_cache.shape[:2], num_heads_k, head_dim))
    check_shape(v_cache, "v_cache", (*cache_names, "num_heads_k", "head_size"), k_cache.shape)
    check(num_splits <= 128, "num_splits > 128 not supported")
    check_options(0.0, softcap, alibi_slopes, batch, num_heads, q)
    capacity = kv_capacity(k_cache, block_table)
    if block_table is not None:
        check(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
        check(cache_leftpad is None, "We don't support Paged KV and leftpad_k running at the same time yet")
        check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
        check(block_table.dim() == 2 and block_table.shape[0] == batch,
              f"block_table must have shape (batch_size, max_num_blocks_per_seq), got {tuple(block_table.shape)}")
    check((k is None) == (v is None), "If key is supplied, value must also be passed in")
    if k is not None:
        check(cache_seqlens is not None, "If key is supplied, seqlens_k must also be passed in")
        check(k.dtype == q.dtype, "Key must have the same dtype as query")
        check(v.dtype == q.dtype, "Value must have the same dtype as query")
        check(k.dim() == 4 and k.shape[1] <= capacity,
              "If key is supplied, it must have seqlen <= the seqlen of the KV cache")
        names = ("batch_size", "seqlen_new", "num_heads_k", "head_size")
        check_shape(k, "k", names, (batch, k.shape[1], num_heads_k, head_dim))
        check_shape(v, "v", names, k.shape)
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
