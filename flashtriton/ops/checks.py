"""Argument checks of docs/api.md §6, run before anything is launched. Messages follow flash_attn's."""

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
