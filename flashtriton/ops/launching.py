"""Small helpers every launcher uses: the device guard, ceiling division, the tensor-descriptor test."""

from __future__ import annotations

import contextlib

import torch


def device_guard(tensor: torch.Tensor):
    """Run launches on the tensor's CUDA device whatever the current device is; nothing for CPU tensors."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def tma_compatible(tensor: torch.Tensor) -> bool:
    """A tensor TMA descriptors can address: 16-byte aligned base and strides, contiguous last dim.

    Every row and head of it then starts 16-byte aligned too, as in-kernel descriptors need.
    """
    *outer, last = tensor.stride()
    elements_per_16_bytes = 16 // tensor.element_size()
    return last == 1 and tensor.data_ptr() % 16 == 0 and not any(s % elements_per_16_bytes for s in outer)
