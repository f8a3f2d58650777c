"""Dropout plumbing: the RNG state of a call, the keep mask as a tensor, and S_dmask (docs/api.md §4.7).

rng_state is a (2,) int64 tensor (seed, offset) drawn from PyTorch's default generator of q's device with
torch.randint, on that device: no host synchronization, CUDA-graph capturable, reproducible under
torch.manual_seed, different on every call. The kernels key Philox by (seed, offset, batch * heads + head,
query row, key column) (kernels/common.dropout_keep, kernels/hopper/dropout.py); the backward regenerates the same
mask from the saved rng_state.
FA2's convention: one random byte per element, kept where byte <= keep_threshold(dropout_p), so an element is kept
with probability keep_probability(dropout_p) = (floor((1 - p) * 255) + 1) / 256 (0.8984 for p = 0.1), and kept
values are scaled by 1 / (1 - p) in fp32 (kernels/common.dropout_keep).
Without kernels (CPU reference path) the mask comes from a torch.Generator seeded with rng_state instead:
the same distribution and reproducibility, but not the kernels' bits.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Tuple

import numpy as np
import torch

from ..kernels.dropout import dropout_mask_kernel
from ..reference import attention_probabilities, row_slopes, sequence_slices
from .launching import compiled_without_line_info, device_guard, launch, triton_cdiv

compiled_without_line_info(dropout_mask_kernel)

MASK_BLOCK = 64


@lru_cache(maxsize=64)
def keep_threshold(dropout_p: float) -> int:
    """The byte threshold of dropout_p: floor(keep * 255) with keep = 1 - p computed in fp32, as FA2 does."""
    keep = np.float32(1.0) - np.float32(dropout_p)
    return int(np.floor(np.float64(keep) * 255.0))


def keep_probability(dropout_p: float) -> float:
    """The exact probability that an element is kept: (keep_threshold + 1) / 256."""
    return (keep_threshold(dropout_p) + 1) / 256


@lru_cache(maxsize=64)
def kernel_dropout(dropout_p: float) -> Tuple[float, float]:
    """The kernels' `dropout` argument group: (keep_threshold, scale of kept values 1 / (1 - p) in fp32)."""
    keep = np.float32(1.0) - np.float32(dropout_p)
    return float(keep_threshold(dropout_p)), float(np.float32(1.0) / keep)


def new_rng_state(device) -> torch.Tensor:
    return torch.randint(0, 2 ** 62, (2,), dtype=torch.int64, device=device)


def require_rng_state(rng_state: Optional[torch.Tensor], dropout_p: float) -> None:
    if dropout_p > 0.0 and rng_state is None:
        raise RuntimeError("dropout_p > 0 in backward needs the rng_state returned by the forward "
                           "(without it the backward would use a different dropout mask)")


def keep_mask(rng_state: torch.Tensor, batch: int, heads: int, rows: int, cols: int, dropout_p: float,
              use_kernels: bool) -> torch.Tensor:
    """Bool (B, H, rows, cols): True where the attention probability is kept."""
    device = rng_state.device
    if not use_kernels:
        seed, offset = (int(x) for x in rng_state.tolist())
        generator = torch.Generator(device="cpu").manual_seed((seed ^ (offset << 1)) & (2 ** 63 - 1))
        random_bytes = torch.randint(0, 256, (batch, heads, rows, cols), generator=generator, dtype=torch.int16)
        return (random_bytes <= keep_threshold(dropout_p)).to(device)
    keep = torch.empty(batch, heads, rows, cols, dtype=torch.int8, device=device)
    if keep.numel():
        grid = (triton_cdiv(rows, MASK_BLOCK) * batch * heads,)
        with device_guard(keep):
            launch(dropout_mask_kernel, grid, rng_state, keep, keep.stride(0), keep.stride(1), keep.stride(2), heads,
                   rows, cols, kernel_dropout(dropout_p)[0], BLOCK_M=MASK_BLOCK, BLOCK_N=MASK_BLOCK)
    return keep.bool()


def s_dmask(probs: torch.Tensor, keep: torch.Tensor, out: torch.Tensor) -> None:
    """Write probabilities (B, H, Sq, Sk), negated where dropped, into the top-left corner of `out`."""
    signed = torch.where(keep | (probs == 0), probs, -probs)
    out[:, :, : probs.shape[2], : probs.shape[3]] = signed.to(out.dtype)


def dense_s_dmask(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, keep, shape,
                  learnable_sink=None) -> torch.Tensor:
    """S_dmask (B, H, R(Sq), R(Sk)) of a dense call: normalized P, negated where dropped, 0 elsewhere."""
    out = torch.zeros(shape, dtype=q.dtype, device=q.device)
    probs = attention_probabilities(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes,
                                    learnable_sink=learnable_sink)
    s_dmask(probs, keep[:, :, : q.shape[1], : k.shape[1]], out)
    return out


def varlen_s_dmask(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale, causal, window, softcap,
                   alibi_slopes, keep, shape, learnable_sink=None) -> torch.Tensor:
    """S_dmask (B, H, R(max_seqlen_q), R(max_seqlen_k)) of a varlen call, in each sequence's local indices.

    A testing aid: it reads cu_seqlens on the host (one synchronization per call that asks for it).
    """
    out = torch.zeros(shape, dtype=q.dtype, device=q.device)
    for b, rows_q, rows_k in sequence_slices(cu_seqlens_q, cu_seqlens_k):
        probs = attention_probabilities(q[None, rows_q], k[None, rows_k], v[None, rows_k], softmax_scale, causal,
                                        window, softcap, row_slopes(alibi_slopes, b), seqlen_k_star=max_seqlen_k,
                                        learnable_sink=learnable_sink)
        s_dmask(probs, keep[b: b + 1, :, : probs.shape[2], : probs.shape[3]], out[b: b + 1])
    return out
