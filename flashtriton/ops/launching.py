"""Small helpers every launcher uses: the device guard and ceiling division."""

from __future__ import annotations

import contextlib

import torch


def device_guard(tensor: torch.Tensor):
    """Run launches on the tensor's CUDA device whatever the current device is; nothing for CPU tensors."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
