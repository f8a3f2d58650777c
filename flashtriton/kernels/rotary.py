"""Rotary position embedding: rotate feature pairs of x by the angle of each token's position (docs/api.md §9.2).

One program per (sequence block, head block, batch entry); grid axis 0 enumerates (batch entry, sequence
block) pairs, so the batch may exceed the 65535 limit of the other grid axes. With r = ROTARY_DIM, pair m < r/2 is
(x[m], x[m + r/2]) (GPT-NeoX, non-interleaved) or (x[2m], x[2m+1]) (GPT-J, INTERLEAVED), and
    y_a = a * cos[t, m] - b * sin[t, m],    y_b = a * sin[t, m] + b * cos[t, m]
in fp32, written in Out's dtype. Token s of a sequence has position t = s + offset. Rows t outside
[0, seqlen_ro) of the table act as cos = 1, sin = 0 (identity). CONJUGATE negates sin (the inverse
rotation, used by backward). COPY_TAIL copies features >= r unchanged (out-of-place calls).

Naming legend: offs_s token offsets inside the sequence, offs_h heads, offs_k pair index m, offs_r
feature index in [0, r) (interleaved loads), offs_t feature index in [r, HEAD_DIM) (the copied tail);
BLOCK_K = r/2 rounded up to a power of two, BLOCK_TAIL = HEAD_DIM - r rounded up likewise.
Varlen (IS_VARLEN): sequence b is rows [CuSeqlens[b], CuSeqlens[b+1]) of a (T, H, D) tensor; the
grid may carry one extra batch slice (index num_batches) that copies the rows past CuSeqlens[-1]
unrotated, so an out-of-place call writes every row.
"""

import triton
import triton.language as tl

from .common import narrow


@triton.jit
def _rotate_pairs(a, b, cos, sin):
    """(a cos - b sin, a sin + b cos) in fp32; a, b are [BLOCK_S, BLOCK_H, BLOCK_K], cos, sin [BLOCK_S, BLOCK_K]."""
    # [BLOCK_S, 1, BLOCK_K]
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return a * cos - b * sin, a * sin + b * cos


@triton.jit
def _rotary_block(out_rows, x_rows, Cos, Sin, offs_s, row_in, offs_k, k_in, head_in, position_offset, seqlen_ro,
                  use_table, ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_TAIL: tl.constexpr, INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
                  COPY_TAIL: tl.constexpr):
    """Rotate one [BLOCK_S, BLOCK_H] tile of rows; out_rows / x_rows are [BLOCK_S, BLOCK_H, 1] row pointers."""
    ROTARY_DIM_HALF: tl.constexpr = ROTARY_DIM // 2
    # [BLOCK_S] table row of each token; rows outside the table are the identity rotation
    positions = (offs_s + position_offset).to(tl.int64)
    in_table = row_in & (positions >= 0) & (positions < seqlen_ro) & use_table
    # [BLOCK_S, BLOCK_K]
    table_offs = positions[:, None] * ROTARY_DIM_HALF + offs_k[None, :]
    table_mask = in_table[:, None] & k_in[None, :]
    cos = tl.load(Cos + table_offs, mask=table_mask, other=1.0).to(tl.float32)
    sin = tl.load(Sin + table_offs, mask=table_mask, other=0.0).to(tl.float32)
    if CONJUGATE:
        sin = -sin
    # [BLOCK_S, BLOCK_H, 1]
    tile_in = row_in[:, None, None] & head_in[None, :, None]
    if INTERLEAVED:
        # [2 * BLOCK_K] features 2m and 2m+1 of pair m are adjacent; load them together, split in registers
        offs_r = tl.arange(0, 2 * BLOCK_K)
        # [BLOCK_S, BLOCK_H, 2 * BLOCK_K]
        mask = tile_in & (offs_r < ROTARY_DIM)[None, None, :]
        x = tl.load(x_rows + offs_r[None, None, :], mask=mask, other=0.0).to(tl.float32)
        # [BLOCK_S, BLOCK_H, BLOCK_K] each
        x_even, x_odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], BLOCK_K, 2]))
        y_even, y_odd = _rotate_pairs(x_even, x_odd, cos, sin)
        # [BLOCK_S, BLOCK_H, 2 * BLOCK_K]
        y = tl.reshape(tl.join(y_even, y_odd), [x.shape[0], x.shape[1], 2 * BLOCK_K])
        tl.store(out_rows + offs_r[None, None, :], narrow(y, out_rows.dtype.element_ty), mask=mask)
    else:
        # [BLOCK_S, BLOCK_H, BLOCK_K]
        mask = tile_in & k_in[None, None, :]
        x1 = tl.load(x_rows + offs_k[None, None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_rows + ROTARY_DIM_HALF + offs_k[None, None, :], mask=mask, other=0.0).to(tl.float32)
        y1, y2 = _rotate_pairs(x1, x2, cos, sin)
        tl.store(out_rows + offs_k[None, None, :], narrow(y1, out_rows.dtype.element_ty), mask=mask)
        tl.store(out_rows + ROTARY_DIM_HALF + offs_k[None, None, :], narrow(y2, out_rows.dtype.element_ty), mask=mask)
    if COPY_TAIL:
        # [BLOCK_TAIL] features r .. HEAD_DIM-1 pass through unchanged
        offs_t = ROTARY_DIM + tl.arange(0, BLOCK_TAIL)
        # [BLOCK_S, BLOCK_H, BLOCK_TAIL]
        tail_mask = tile_in & (offs_t < HEAD_DIM)[None, None, :]
        tail = tl.load(x_rows + offs_t[None, None, :], mask=tail_mask, other=0.0)
        tl.store(out_rows + offs_t[None, None, :], narrow(tail, out_rows.dtype.element_ty), mask=tail_mask)


@triton.jit(do_not_specialize=["num_s_blocks", "seqlen", "seqlen_ro", "seqlen_offset", "total_tokens"])
def rotary_kernel(
    Out, X, Cos, Sin, CuSeqlens, SeqlenOffsets,
    stride_out_b, stride_out_s, stride_out_h,
    stride_x_b, stride_x_s, stride_x_h,
    num_batches, num_heads, num_s_blocks, seqlen, seqlen_ro, seqlen_offset, total_tokens,
    ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_OFFSET_TENSOR: tl.constexpr, COPY_TAIL: tl.constexpr,
):
    """Out = rotary(X): X and Out are (B, S, H, D), or (T, H, D) with IS_VARLEN. Cos/Sin are (seqlen_ro, r/2).

    Grid: (num_s_blocks * (batch entries), head blocks). seqlen is the (max) sequence length that the
    num_s_blocks blocks of BLOCK_S rows cover; a longer varlen sequence is still covered, since each
    program strides over its sequence by num_s_blocks * BLOCK_S. Out may alias X (in place).
    """
    s_block = tl.program_id(0) % num_s_blocks
    batch = tl.program_id(0) // num_s_blocks
    h_block = tl.program_id(1)
    use_table = batch < num_batches
    if IS_VARLEN:
        seq_start = tl.load(CuSeqlens + batch)
        next_start = tl.load(CuSeqlens + batch + 1, mask=use_table, other=0)
        seq_len = tl.where(use_table, next_start, total_tokens) - seq_start
        batch64 = tl.zeros([], tl.int64)
    else:
        seq_start = 0
        seq_len = seqlen
        batch64 = batch.to(tl.int64)
    if HAS_OFFSET_TENSOR:
        position_offset = tl.load(SeqlenOffsets + tl.minimum(batch, num_batches - 1))
    else:
        position_offset = seqlen_offset

    # [BLOCK_H]
    offs_h = h_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_in = offs_h < num_heads
    # [BLOCK_K]
    offs_k = tl.arange(0, BLOCK_K)
    k_in = offs_k < ROTARY_DIM // 2
    x_base = X + batch64 * stride_x_b
    out_base = Out + batch64 * stride_out_b
    for s_start in range(s_block * BLOCK_S, seq_len, num_s_blocks * BLOCK_S):
        # [BLOCK_S]
        offs_s = s_start + tl.arange(0, BLOCK_S)
        row_in = offs_s < seq_len
        rows = (seq_start + offs_s).to(tl.int64)
        # [BLOCK_S, BLOCK_H, 1]
        x_rows = x_base + rows[:, None, None] * stride_x_s + offs_h.to(tl.int64)[None, :, None] * stride_x_h
        out_rows = out_base + rows[:, None, None] * stride_out_s + offs_h.to(tl.int64)[None, :, None] * stride_out_h
        _rotary_block(out_rows, x_rows, Cos, Sin, offs_s, row_in, offs_k, k_in, head_in, position_offset, seqlen_ro,
                      use_table, ROTARY_DIM, HEAD_DIM, BLOCK_K, BLOCK_TAIL, INTERLEAVED, CONJUGATE, COPY_TAIL)
