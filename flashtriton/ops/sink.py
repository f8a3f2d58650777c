"""Learnable sinks (docs/api.md §4.11): fold them into a forward's output and LSE, and their gradient.

Every forward path (Triton kernels, the Gluon Hopper kernels, split-KV, the kv cache, the CPU reference path) computes
attention over the keys first; fold_sink then adds the sink to each row's softmax sum in place
(kernels/sink.py, or the same arithmetic in PyTorch where no kernel runs). The backward needs nothing else: with the
LSE that includes the sink, P = exp(S - lse) is already the keys' share, and dS = P * (dP - delta) holds as before.
The sink's own gradient is dsink[h] = -sum over rows of exp(sink[h] - lse) * delta, with delta = rowsum(dout * out)
(the backward's softmax_d).
"""

from __future__ import annotations

import torch

from .. import configs
from ..kernels.sink import attn_fold_sink_kernel
from .launching import compiled_without_line_info, device_guard, launch, triton_cdiv

compiled_without_line_info(attn_fold_sink_kernel)

FOLD_ELEMENTS = 8192  # rows x padded head dim per program


def fold_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, runs_kernels: bool) -> None:
    """Fold sink (H,) into out (B, R, H, D) and lse (B, H, R, rows contiguous), both written in place (views of a
    varlen call's (T, H, D) / (H, T) tensors with B = 1 work)."""
    batch, rows, num_heads, head_dim = out.shape
    if out.numel() == 0:
        return
    if not runs_kernels:
        keys_lse = torch.where(torch.isinf(lse), float("-inf"), lse)
        total = torch.logaddexp(keys_lse, sink.float()[None, :, None])
        kept = torch.exp(keys_lse - total)  # (B, H, R)
        out.copy_((out.float() * kept.transpose(1, 2)[..., None]).to(out.dtype))
        lse.copy_(total)
        return
    sink = sink.contiguous()  # the kernel reads sink[h] at h (a strided view would give other heads' values)
    block_d = configs.block_d(head_dim)
    block_m = max(1, min(128, FOLD_ELEMENTS // block_d))
    grid = (triton_cdiv(rows, block_m), batch * num_heads)
    with device_guard(out):
        launch(
            attn_fold_sink_kernel, grid,
            out, lse, sink, rows, num_heads, out.stride(0), out.stride(1), out.stride(2), lse.stride(0),
            lse.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
        )


def sink_grad(lse: torch.Tensor, softmax_d: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """dsink (H,) in sink's dtype from the forward's lse (B, H, R) (with the sink folded in) and the backward's
    delta softmax_d (B, H, >= R): -sum over batch and rows of exp(sink[h] - lse) * delta."""
    rows = lse.shape[-1]
    sink_share = torch.exp(sink.float()[None, :, None] - lse.float())
    return (-(sink_share * softmax_d[..., :rows].float()).sum(dim=(0, 2))).to(sink.dtype)
