"""`apply_rotary`: the rotary-embedding entry point of flash_attn.ops.triton.rotary (docs/api.md §9.2), no autograd.

Where it runs, as for attention (flashtriton.ops.backend): CUDA tensors run the compiled Triton kernel;
CPU tensors run the same kernel through Triton's interpreter when kernels are interpreted
(TRITON_INTERPRET=1 set before flashtriton is imported), and otherwise an exact PyTorch path with the
same fp32 math.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton

from ...kernels.rotary import rotary_kernel
from ..backend import new_empty
from ..launching import compiled_without_line_info, device_guard, launch

compiled_without_line_info(rotary_kernel)

# TRITON_INTERPRET is read when @triton.jit runs, so the kernel object says how it runs.
KERNELS_INTERPRETED = type(rotary_kernel).__name__ == "InterpretedFunction"

MAX_HEAD_DIM = 256
# Elements of one [BLOCK_S, BLOCK_H, BLOCK_K] half-tile. Not measured: a rotation is memory-bound and this
# keeps 2048 fp32 values per half (16 per thread at 4 warps) whatever the head dim.
TILE_ELEMENTS = 2048
MAX_BLOCK_H = 4
NUM_WARPS = 4


def block_sizes(rotary_dim: int, head_dim: int, num_heads: int, copy_tail: bool):
    """(BLOCK_K, BLOCK_TAIL, BLOCK_S, BLOCK_H) for a launch; independent of the sequence length (no recompiles)."""
    block_k = triton.next_power_of_2(max(rotary_dim // 2, 1))
    block_tail = triton.next_power_of_2(head_dim - rotary_dim) if copy_tail else 1
    block_h = min(triton.next_power_of_2(max(num_heads, 1)), MAX_BLOCK_H)
    block_s = max(1, min(64, TILE_ELEMENTS // (block_h * block_k)))
    return block_k, block_tail, block_s, block_h


def _check(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen):
    """The asserts of docs/api.md §9.2; returns (batch, seqlen) where seqlen is max_seqlen for varlen."""
    if cu_seqlens is None:
        assert x.dim() == 4, f"x must have shape (batch, seqlen, nheads, headdim), got {tuple(x.shape)}"
        batch, seqlen = x.shape[0], x.shape[1]
    else:
        assert max_seqlen is not None, "If cu_seqlens is passed in, then max_seqlen must be passed"
        assert x.dim() == 3, f"x must have shape (total_seqlen, nheads, headdim) with cu_seqlens, got {tuple(x.shape)}"
        assert cu_seqlens.dim() == 1 and cu_seqlens.dtype in (torch.int32, torch.int64), (
            f"cu_seqlens must be a 1-D int32/int64 tensor (batch + 1,), "
            f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        batch, seqlen = cu_seqlens.shape[0] - 1, int(max_seqlen)
    assert cos.dim() == 2, f"cos must have shape (seqlen_ro, rotary_dim / 2), got {tuple(cos.shape)}"
    assert sin.shape == cos.shape, f"sin must have the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}"
    seqlen_ro, rotary_dim, head_dim = cos.shape[0], 2 * cos.shape[1], x.shape[-1]
    assert rotary_dim <= head_dim, f"rotary_dim must be <= headdim (rotary_dim {rotary_dim}, headdim {head_dim})"
    assert head_dim <= MAX_HEAD_DIM, f"Only support headdim <= {MAX_HEAD_DIM}, got {head_dim}"
    assert seqlen_ro >= seqlen, f"seqlen_ro must be >= seqlen (seqlen_ro {seqlen_ro}, seqlen {seqlen})"
    if isinstance(seqlen_offsets, torch.Tensor):
        assert tuple(seqlen_offsets.shape) == (batch,), (
            f"seqlen_offsets must have shape (batch,) = ({batch},), got {tuple(seqlen_offsets.shape)}")
        assert seqlen_offsets.dtype in (torch.int32, torch.int64), (
            f"seqlen_offsets must have dtype int32 or int64, got {seqlen_offsets.dtype}")
    else:
        assert seqlen_offsets + seqlen <= seqlen_ro, (
            f"seqlen_offsets + seqlen must be <= seqlen_ro ({seqlen_offsets} + {seqlen} > {seqlen_ro})")
    for name, tensor in (("cos", cos), ("sin", sin), ("seqlen_offsets", seqlen_offsets), ("cu_seqlens", cu_seqlens)):
        if isinstance(tensor, torch.Tensor):
            assert tensor.device == x.device, f"{name} must be on the device of x ({x.device}), got {tensor.device}"
    return batch, seqlen


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 seqlen_offsets: Union[int, torch.Tensor] = 0, cu_seqlens: Optional[torch.Tensor] = None,
                 max_seqlen: Optional[int] = None, interleaved: bool = False, inplace: bool = False,
                 conjugate: bool = False) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] features of x (B, S, H, D), or (T, H, D) with cu_seqlens.

    cos, sin: (seqlen_ro, rotary_dim / 2). Token s of sequence b sits at position s + seqlen_offsets[b]
    (or + seqlen_offsets if an int); positions past the table are left unrotated. conjugate=True
    rotates backwards (sin negated). Returns a new tensor, or x itself when inplace.
    """
    batch, seqlen = _check(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
    if not (x.is_cuda or KERNELS_INTERPRETED):
        rotated = rotary_torch(x, cos, sin, seqlen_offsets, cu_seqlens, interleaved, conjugate)
        return x.copy_(rotated) if inplace else rotated
    if inplace and x.stride(-1) != 1 and x.numel() > 0:
        return x.copy_(apply_rotary(x.contiguous(), cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved,
                                    True, conjugate))
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x if inplace else new_empty(x.shape, x.dtype, x.device)
    launch_rotary(out, x, cos.contiguous(), sin.contiguous(), seqlen_offsets, cu_seqlens, batch, seqlen,
                  interleaved, conjugate)
    return out


def launch_rotary(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  seqlen_offsets: Union[int, torch.Tensor], cu_seqlens: Optional[torch.Tensor], batch: int,
                  seqlen: int, interleaved: bool, conjugate: bool) -> None:
    """Run the kernel into preallocated out (may be x). x, out: contiguous last dim; cos, sin contiguous.

    Out-of-place varlen calls also copy the rows past cu_seqlens[-1] (one extra grid slice), so every
    element of out is written.
    """
    num_heads, head_dim = x.shape[-2], x.shape[-1]
    rotary_dim = 2 * cos.shape[-1]
    is_varlen = cu_seqlens is not None
    inplace = out.data_ptr() == x.data_ptr()
    copy_tail = not inplace and rotary_dim < head_dim
    block_k, block_tail, block_s, block_h = block_sizes(rotary_dim, head_dim, num_heads, copy_tail)
    copy_uncovered_rows = is_varlen and not inplace
    num_s_blocks = max(triton.cdiv(seqlen, block_s), int(copy_uncovered_rows))
    grid = (num_s_blocks * (batch + int(copy_uncovered_rows)), triton.cdiv(num_heads, block_h))
    if x.numel() == 0 or 0 in grid:
        return
    has_offset_tensor = isinstance(seqlen_offsets, torch.Tensor)
    if is_varlen:
        strides = (0, out.stride(0), out.stride(1), 0, x.stride(0), x.stride(1))
    else:
        strides = (out.stride(0), out.stride(1), out.stride(2), x.stride(0), x.stride(1), x.stride(2))
    with device_guard(x):
        launch(
            rotary_kernel, grid,
            out, x, cos, sin, cu_seqlens, seqlen_offsets.contiguous() if has_offset_tensor else None,
            *strides,
            batch, num_heads, num_s_blocks, seqlen, cos.shape[0], 0 if has_offset_tensor else int(seqlen_offsets),
            x.shape[0],
            ROTARY_DIM=rotary_dim, HEAD_DIM=head_dim, BLOCK_K=block_k, BLOCK_TAIL=block_tail,
            BLOCK_S=block_s, BLOCK_H=block_h, INTERLEAVED=interleaved, CONJUGATE=conjugate, IS_VARLEN=is_varlen,
            HAS_OFFSET_TENSOR=has_offset_tensor, COPY_TAIL=copy_tail, num_warps=NUM_WARPS,
        )


def token_positions(x: torch.Tensor, seqlen_offsets: Union[int, torch.Tensor],
                    cu_seqlens: Optional[torch.Tensor]):
    """(positions, covered): int64 position of every token, (B, S) or (T,), and whether a sequence holds it."""
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[0], x.shape[1]
        offsets = torch.as_tensor(seqlen_offsets, device=device).long().reshape(-1, 1)
        positions = torch.arange(seqlen, device=device).expand(batch, seqlen) + offsets
        return positions, torch.ones_like(positions, dtype=torch.bool)
    cu = cu_seqlens.long()
    batch = cu.shape[0] - 1
    tokens = torch.arange(x.shape[0], device=device)
    if batch == 0:
        return tokens, torch.zeros_like(tokens, dtype=torch.bool)
    seq_index = torch.searchsorted(cu[1:], tokens, right=True)
    covered = seq_index < batch
    seq_index = seq_index.clamp(max=batch - 1)
    offsets = torch.as_tensor(seqlen_offsets, device=device).long().expand(batch)
    positions = tokens - cu[seq_index] + offsets[seq_index]
    return positions, covered


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 seqlen_offsets: Union[int, torch.Tensor] = 0, cu_seqlens: Optional[torch.Tensor] = None,
                 interleaved: bool = False, conjugate: bool = False) -> torch.Tensor:
    """The kernel's semantics in PyTorch (fp32 math, x's dtype out): the CPU path when kernels are not interpreted."""
    rotary_dim = 2 * cos.shape[-1]
    out = x.clone(memory_format=torch.contiguous_format)
    if x.numel() == 0 or rotary_dim == 0:
        return out
    positions, covered = token_positions(x, seqlen_offsets, cu_seqlens)
    in_table = covered & (positions >= 0) & (positions < cos.shape[0])
    rows = positions.clamp(0, cos.shape[0] - 1)
    # (..., 1, r/2): one table row per token, broadcast over heads
    cos_t = torch.where(in_table[..., None], cos[rows].float(), 1.0).unsqueeze(-2)
    sin_t = torch.where(in_table[..., None], sin[rows].float(), 0.0).unsqueeze(-2)
    if conjugate:
        sin_t = -sin_t
    x_rot = x[..., :rotary_dim].float()
    a, b = (x_rot[..., 0::2], x_rot[..., 1::2]) if interleaved else x_rot.chunk(2, dim=-1)
    y_a, y_b = a * cos_t - b * sin_t, a * sin_t + b * cos_t
    rotated = torch.stack((y_a, y_b), dim=-1).flatten(-2) if interleaved else torch.cat((y_a, y_b), dim=-1)
    out[..., :rotary_dim] = rotated.to(x.dtype)
    return out
