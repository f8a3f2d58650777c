"""The merge of the Hopper forward's cut tail (fwd.py, SPLIT_TAIL; ops/hopper.tail_split): the partial results of
a tail tile's pieces combined by their LSEs into its output rows."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .schedule import item_tiles, tile_work


# query rows x head dim (rounded up to a power of two) per program of attn_tail_merge_kernel: 32 rows at head dim
# 128 (80, 96), 16 at 256 (192; 32 rows of 256 would need 254 registers)
TAIL_MERGE_ELEMENTS = gl.constexpr(4096)


def tail_merge_rows(head_dim: int) -> int:
    """Query rows per program of attn_tail_merge_kernel at head_dim."""
    return TAIL_MERGE_ELEMENTS.value // _block_d(head_dim)


@gluon.constexpr_function
def _block_d(head_dim):
    """head_dim rounded up to a power of two (the columns of the merge's tiles)."""
    return 1 << (int(head_dim) - 1).bit_length()


@gluon.jit
def _programs_upto(x, tail):
    """How many tail programs' shares (tail_range) start at or before tail position x."""
    return gl.minimum(tail[1], ((x + 1) * tail[1] + tail[2] - 1) // tail[2])


@gluon.jit
def _load_partial(Partial, PartialLse, program, first, tail, rows, columns, TILE_ROWS: gl.constexpr,
                  HEAD_DIM: gl.constexpr):
    """Tail program `program`'s partial result of the tail tile starting at position `first`: its LSE [ROWS] and
    output [ROWS, BLOCK_D] at `rows` of the tile (slot 2 p + 1 where p's share started before the tile, else 2 p:
    next_piece), the workspace's rows HEAD_DIM wide (columns past it read as 0)."""
    slot = 2 * program + (program * tail[2] // tail[1] < first).to(gl.int32)
    slot_rows = slot.to(gl.int64) * TILE_ROWS + rows
    return (gl.load(PartialLse + slot_rows),
            gl.load(Partial + gl.expand_dims(slot_rows * HEAD_DIM, 1) + gl.expand_dims(columns, 0),
                    mask=gl.expand_dims(columns < HEAD_DIM, 0), other=0.0))


# named apart from the attn_fwd_* kernels: kernel_inspect's forward gates ask those for wgmma, which a merge has none of
@gluon.jit(do_not_specialize=["stride_ob", "stride_om", "stride_oh", "stride_lse_b", "stride_lse_h", "batch",
                              "seqlen_q", "seqlen_k", "heads_per_group", "paired", "full_items", "tail_programs",
                              "tail_blocks", "item_blocks"])
def attn_tail_merge_kernel(Partial, PartialLse, Out, Lse, stride_ob, stride_om, stride_oh, stride_lse_b,
                           stride_lse_h, batch, num_heads, seqlen_q, seqlen_k, heads_per_group, paired, full_items,
                           tail_programs, tail_blocks, item_blocks, CAUSAL: gl.constexpr, TILE_ROWS: gl.constexpr,
                           BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, num_warps: gl.constexpr):
    """The tail's merge, after attn_fwd_hopper_kernel (same work arguments): program i takes ROWS =
    TAIL_MERGE_ELEMENTS / BLOCK_D rows (BLOCK_D: HEAD_DIM rounded up to a power of two; tail_merge_rows) of tail tile i // (TILE_ROWS / ROWS) (tail tiles: item full_items + t // (1 +
    paired)'s tiles in turn). A
    tile cut among programs p_first .. p_last gets out = sum_p exp(lse_p - lse) out_p with lse = log(sum_p
    exp(lse_p)) over their partial results (kernels/combine.py's rule: rows no piece saw, out 0 and lse +inf), in
    one pass with a running max and the next piece's loads issued ahead (a pass per statistic would wait for each
    load in turn); p's slot is 2 p + 1 where its share started before the tile (the
    piece at its share's end), else 2 p. A tile its program ran whole is left as written."""
    BLOCK_D: gl.constexpr = _block_d(HEAD_DIM)
    ROWS: gl.constexpr = TAIL_MERGE_ELEMENTS // BLOCK_D
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    tail = (full_items, tail_programs, tail_blocks, item_blocks)
    num_tiles = gl.cdiv(seqlen_q, TILE_ROWS)
    chunks: gl.constexpr = TILE_ROWS // ROWS
    tail_tile = gl.program_id(0) // chunks
    offset = tail_tile // (1 + paired)
    second = tail_tile - offset * (1 + paired)
    batch_head, first_tile, end_tile, tile_step = item_tiles(full_items + offset, num_tiles, batch * num_heads,
                                                              heads_per_group, paired)
    first_blocks = tile_work(first_tile, batch_head, num_tiles, num_heads, seqlen_q, seqlen_k, CAUSAL, (), (),
                             TILE_ROWS, BLOCK_N)[4]
    batch_index, head, m_start, _, n_blocks, _ = tile_work(first_tile + second * tile_step, batch_head, num_tiles,
                                                           num_heads, seqlen_q, seqlen_k, CAUSAL, (), (), TILE_ROWS,
                                                           BLOCK_N)
    # the tile's positions in the tail: [first, first + n_blocks)
    first = offset * item_blocks + second * first_blocks
    first_program = _programs_upto(first, tail) - 1
    last_program = _programs_upto(first + n_blocks - 1, tail) - 1
    if last_program > first_program:
        # [ROWS] rows of the tile; [BLOCK_D] columns
        rows = gl.program_id(0) % chunks * ROWS + gl.arange(0, ROWS, rows_layout)
        columns = gl.arange(0, BLOCK_D, gl.SliceLayout(0, layout))
        # one pass, the running max and sum per row, the next piece's loads issued ahead of this one's merge
        lse_max = gl.full([ROWS], float("-inf"), gl.float32, rows_layout)
        weight_sum = gl.zeros([ROWS], gl.float32, rows_layout)
        acc = gl.zeros([ROWS, BLOCK_D], gl.float32, layout)
        piece_lse, partial = _load_partial(Partial, PartialLse, first_program, first, tail, rows, columns, TILE_ROWS,
                                           HEAD_DIM)
        for program in range(first_program + 1, last_program + 2):
            # [ROWS], [ROWS, BLOCK_D] the next piece's (the last one's again at the end: the workspace ends there)
            next_lse, next_partial = _load_partial(Partial, PartialLse, gl.minimum(program, last_program), first, tail,
                                                   rows, columns, TILE_ROWS, HEAD_DIM)
            new_max = gl.maximum(lse_max, piece_lse)
            pivot = gl.where(new_max == float("-inf"), 0.0, new_max)
            # [ROWS] what the rows' sums so far are worth under the new max, and this piece's weight
            kept = gl.exp(lse_max - pivot)
            weight = gl.exp(piece_lse - pivot)
            weight_sum = weight_sum * kept + weight
            acc = acc * gl.expand_dims(kept, 1) + partial * gl.expand_dims(weight, 1)
            lse_max = new_max
            piece_lse, partial = next_lse, next_partial
        seen = weight_sum > 0.0
        lse = gl.where(seen, lse_max + gl.log(gl.where(seen, weight_sum, 1.0)), float("inf"))
        acc = acc * gl.expand_dims(gl.where(seen, 1.0 / gl.where(seen, weight_sum, 1.0), 0.0), 1)
        query_rows = m_start + rows
        inside = query_rows < seqlen_q
        out_rows = (Out + batch_index.to(gl.int64) * stride_ob + head.to(gl.int64) * stride_oh
                    + query_rows.to(gl.int64) * stride_om)
        gl.store(gl.expand_dims(out_rows, 1) + gl.expand_dims(columns, 0), acc.to(Out.dtype.element_ty),
                 mask=gl.expand_dims(inside, 1) & gl.expand_dims(columns < HEAD_DIM, 0))
        gl.store(Lse + batch_index.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h + query_rows, lse,
                 mask=inside)
