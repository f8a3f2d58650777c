"""Dropout plumbing: the RNG state of a call, the keep mask as a tensor, and S_dmask (docs/api.md §4.7).

rng_state is a (2,) int64 tensor (seed, offset) drawn from PyTorch's default generator of q's device with
torch.randint, on that device: no host synchronization, CUDA-graph capturable, reproducible under
torch.manual_seed, different on every call. The kernels key Philox by (seed, offset, batch * heads + head,
query row, key column); the backward regenerates the same mask from the saved rng_state.
Without kernels (CPU reference path) the mask comes from a torch.Generator seeded with rng_state instead:
the same distribution and reproducibility, but not the kernels' bits.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.dropout import dropout_mask_kernel
from ..reference import attention_probabilities, row_slopes, sequence_slices
from .launching import compiled_without_line_info, device_guard, triton_cdiv

compiled_without_line_info(dropout_mask_kernel)

MASK_BLOCK = 64


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
        return (torch.rand(batch, heads, rows, cols, generator=generator) >= dropout_p).to(device)
    keep = torch.empty(batch, heads, rows, cols, dtype=torch.int8, device=device)
    if keep.numel():
        grid = (triton_cdiv(rows, MASK_BLOCK) * batch * heads,)
        with device_guard(keep):
            dropout_mask_kernel[grid](rng_state, keep, keep.stride(0), keep.stride(1), keep.stride(2), heads, rows,
                                      cols, dropout_p, BLOCK_M=MASK_BLOCK, BLOCK_N=MASK_BLOCK)
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
