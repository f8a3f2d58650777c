"""Split-KV combine: merge the per-split partial outputs and LSEs of the forward by LSE weights.

out = sum_s exp(lse_s - lse) * out_s with lse = log(sum_s exp(lse_s)). Splits that saw no key carry
lse_s = -inf and weigh nothing; rows no split saw get out 0 and lse +inf (flash_attn's convention).
"""

import triton
import triton.language as tl

from .common import narrow, tile_and_batch_head


@triton.jit(do_not_specialize=["seqlen_q", "num_splits", "stride_la_split", "stride_la_b", "stride_la_h",
                               "stride_lse_b", "stride_lse_h"])
def attn_combine_kernel(
    OutAccum, LseAccum, Out, Lse,
    stride_oa_split, stride_oa_b, stride_oa_m, stride_oa_h,
    stride_la_split, stride_la_b, stride_la_h,
    stride_ob, stride_om, stride_oh,
    stride_lse_b, stride_lse_h,
    num_heads, seqlen_q, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """One program per (query tile, batch * head); loops twice over the splits (max/sum, then the merge)."""
    m_block, batch_head = tile_and_batch_head(tl.cdiv(seqlen_q, BLOCK_M))
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_in = offs_m < seqlen_q
    lse_rows = LseAccum + batch * stride_la_b + head * stride_la_h + offs_m
    # [BLOCK_M] running max and sum of exp over the splits
    lse_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in range(num_splits):
        lse_max = tl.maximum(lse_max, tl.load(lse_rows + split * stride_la_split, mask=row_in, other=float("-inf")))
    pivot = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight_sum = tl.zeros([BLOCK_M], tl.float32)
    for split in range(num_splits):
        weight_sum += tl.exp(tl.load(lse_rows + split * stride_la_split, mask=row_in, other=float("-inf")) - pivot)
    seen = weight_sum > 0.0
    lse = tl.where(seen, pivot + tl.log(tl.where(seen, weight_sum, 1.0)), float("inf"))
    # [BLOCK_M, BLOCK_D]
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    mask = row_in[:, None] & (offs_d < HEAD_DIM)[None, :]
    out_rows = OutAccum + batch * stride_oa_b + head * stride_oa_h + offs_m[:, None].to(tl.int64) * stride_oa_m
    for split in range(num_splits):
        lse_split = tl.load(lse_rows + split * stride_la_split, mask=row_in, other=float("-inf"))
        scale = tl.where(seen, tl.exp(lse_split - tl.where(seen, lse, 0.0)), 0.0)
        partial = tl.load(out_rows + split * stride_oa_split + offs_d[None, :], mask=mask, other=0.0)
        acc += tl.where(scale[:, None] > 0.0, partial * scale[:, None], 0.0)
    out_ptrs = Out + batch * stride_ob + head * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    tl.store(out_ptrs, narrow(acc, Out.dtype.element_ty), mask=mask)
    tl.store(Lse + batch * stride_lse_b + head * stride_lse_h + offs_m, lse, mask=row_in)
