"""Fill the rows a packed varlen batch leaves uncovered (rows t >= cu_seqlens[batch]) without reading them.

Varlen outputs are allocated uninitialized; rows past the last sequence must read 0 (outputs, gradients) or
+-inf (LSE). cu_seqlens lives on the device, so the bound is read here rather than on the host (no sync).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["batch", "total_rows", "num_b"])
def fill_uncovered_rows_kernel(
    Ptr, CuSeqlens, batch, total_rows, num_b, stride_row, stride_a, stride_b, fill,
    BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """The tensor seen as [rows, A, B]; one program per (BLOCK_R rows, a). Programs whose rows all lie
    before the end of the last sequence return after one load."""
    first_row = tl.program_id(0) * BLOCK_R
    covered_end = tl.load(CuSeqlens + batch)
    if first_row + BLOCK_R <= covered_end:
        return
    # [BLOCK_R] rows, [BLOCK_B] inner offsets
    rows = first_row + tl.arange(0, BLOCK_R)
    uncovered = (rows >= covered_end) & (rows < total_rows)
    offs_b = tl.arange(0, BLOCK_B)
    base = Ptr + tl.program_id(1).to(tl.int64) * stride_a
    # [BLOCK_R, BLOCK_B]
    values = tl.full([BLOCK_R, BLOCK_B], fill, tl.float32).to(Ptr.dtype.element_ty)
    for b_start in range(0, num_b, BLOCK_B):
        cols = b_start + offs_b
        tl.store(base + rows.to(tl.int64)[:, None] * stride_row + cols[None, :] * stride_b, values,
                 mask=uncovered[:, None] & (cols < num_b)[None, :])
