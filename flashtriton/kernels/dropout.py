"""The dropout keep mask as a tensor, for S_dmask (return_attn_probs with dropout; testing only).

It evaluates the same dropout_keep as the attention kernels, so S_dmask shows exactly the mask they used.
"""

import triton
import triton.language as tl

from .common import dropout_keep, tile_and_batch_head


@triton.jit(do_not_specialize=["rows", "cols"])
def dropout_mask_kernel(RngState, Keep, stride_kb, stride_kh, stride_km, num_heads, rows, cols, keep_threshold,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keep[b, h, i, j] = 1 where attention probability (i, j) of stream b * heads + h is kept."""
    m_block, batch_head = tile_and_batch_head(tl.cdiv(rows, BLOCK_M))
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    base = Keep + (batch_head // num_heads).to(tl.int64) * stride_kb + (batch_head % num_heads).to(tl.int64) * stride_kh
    for n_start in range(0, cols, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        # [BLOCK_M, BLOCK_N]
        keep = dropout_keep(RngState, batch_head, offs_m, n_start, keep_threshold, BLOCK_N)
        mask = (offs_m < rows)[:, None] & (offs_n < cols)[None, :]
        tl.store(base + offs_m[:, None].to(tl.int64) * stride_km + offs_n[None, :], keep.to(tl.int8), mask=mask)
