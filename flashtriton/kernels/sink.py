"""Fold learnable sinks into a finished forward's output and LSE, in place (docs/api.md §4.11).

A sink adds one logit per query head to every row's softmax sum and carries no value: with the row's LSE over its
keys, lse, the new LSE is logaddexp(lse, sink) and the output shrinks by exp(lse - new LSE). Rows that saw no key
(LSE +inf, or -inf: zero_tensors' fill and split partials' convention) have only the sink: LSE = sink, out 0.
"""

import triton
import triton.language as tl

from .common import narrow


@triton.jit(do_not_specialize=["rows", "stride_ob", "stride_om", "stride_oh", "stride_lse_b", "stride_lse_h"])
def attn_fold_sink_kernel(
    Out, Lse, Sink, rows, num_heads, stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Out seen as [batch, rows, heads, HEAD_DIM] (strides stride_ob, stride_om, stride_oh, last dim contiguous),
    Lse as [batch, heads, rows] (rows contiguous); one program per (BLOCK_M rows, batch * heads)."""
    batch_head = tl.program_id(1)
    batch = batch_head // num_heads
    head = batch_head % num_heads
    # [BLOCK_M] rows of this program
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    inside = offs_m < rows
    lse_ptrs = Lse + batch.to(tl.int64) * stride_lse_b + head.to(tl.int64) * stride_lse_h + offs_m
    lse = tl.load(lse_ptrs, mask=inside, other=float("-inf"))
    # [BLOCK_M] the keys' LSE, -inf where the row saw none
    keys_lse = tl.where((lse == float("inf")) | (lse == float("-inf")), float("-inf"), lse)
    sink = tl.load(Sink + head).to(tl.float32)
    top = tl.maximum(keys_lse, sink)
    total = top + tl.log(tl.exp(keys_lse - top) + tl.exp(sink - top))
    # [BLOCK_M] what the keys keep of each row's probability mass
    kept = tl.exp(keys_lse - total)
    tl.store(lse_ptrs, total, mask=inside)
    offs_d = tl.arange(0, BLOCK_D)
    # [BLOCK_M, BLOCK_D]
    out_ptrs = (Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
                + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :])
    mask = inside[:, None] & (offs_d < HEAD_DIM)[None, :]
    out = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, narrow(out * kept[:, None], Out.dtype.element_ty), mask=mask)
