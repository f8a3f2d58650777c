"""The Gluon Hopper forward at head dims 257-512 (tiles 512 wide): the head dim split between two consumers.

A 64 x 512 fp32 output tile would take 256 registers per thread of one warpgroup, so each of the two consumer
warpgroups owns half of the head dim (HALF = 256 columns) of the same 64 query rows: its half of Q, K, V and O.
Per key block of BLOCK_N keys, consumer w computes the partial scores S_w = Q[:, half w] K[:, half w]^T, writes
them to shared memory and adds the other consumer's: S = S_0 + S_1 (fp32 addition commutes, so both hold the same
bits), both run the same online softmax on it, and each accumulates its half of O += P V[:, half w]. Each
consumer issues the next block's partial-score wgmma before it waits for the other's scores, so the tensor cores
work through the exchange and the softmax. A producer warp loads the program's Q once and streams K and V, each
half into its own tile. One program per 64-row query tile of a (batch, head); key blocks from
kernels/common.kv_block_range (causal and local windows, keys past seqlen_k), the masks and the online softmax step
those of the other Gluon forward (fwd_softmax: a block inside every row's keys takes no mask). Dense calls without
softcap, ALiBi, dropout or sinks (ops/hopper.covers and ops/backend say which calls come here).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from .common import arrive_after_wgmma, grouped_tile_of, kv_block_range
from .fwd_softmax import mask_block, mask_local, reciprocal, rescale, softmax_block

ROWS = gl.constexpr(64)    # query rows per program: the wgmmas' M, shared by both consumers
HALF = gl.constexpr(256)   # head-dim columns per consumer (a TMA box is at most 256 wide)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_tiles, k_tiles, v_tiles, q_ready, k_ready, v_ready, k_empty, v_empty, batch,
              head, head_k, m_start, n_lo, n_blocks):
    """One warp: both halves of the program's Q tile once (q_tiles: [1, ROWS, 1, HALF] per half), then K and V of key
    blocks n_lo, n_lo + 1, ... (n_blocks of them) into stage j % STAGES of each half's tiles (k_tiles, v_tiles:
    [STAGES, 1, BLOCK_N, 1, HALF] per half) once both consumers released the stage."""
    STAGES: gl.constexpr = k_tiles[0].shape[0]
    BLOCK_N: gl.constexpr = k_tiles[0].shape[2]
    element_bytes: gl.constexpr = k_tiles[0].dtype.primitive_bitwidth // 8
    mbarrier.expect(q_ready, 2 * ROWS * HALF * element_bytes)
    for half in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [batch, m_start, head, half * HALF], q_ready, q_tiles[half])
    for j in range(n_blocks):
        stage = j % STAGES
        row = (n_lo + j) * BLOCK_N
        mbarrier.wait(k_empty.index(stage), ((j // STAGES) - 1) & 1, pred=j >= STAGES)
        mbarrier.expect(k_ready.index(stage), 2 * BLOCK_N * HALF * element_bytes)
        for half in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [batch, row, head_k, half * HALF], k_ready.index(stage),
                                            k_tiles[half].index(stage))
        mbarrier.wait(v_empty.index(stage), ((j // STAGES) - 1) & 1, pred=j >= STAGES)
        mbarrier.expect(v_ready.index(stage), 2 * BLOCK_N * HALF * element_bytes)
        for half in gl.static_range(2):
            tma.async_copy_global_to_shared(v_desc, [batch, row, head_k, half * HALF], v_ready.index(stage),
                                            v_tiles[half].index(stage))


@gluon.jit
def _consumer(q_tile, k_tiles, v_tiles, o_desc, own_scores, other_scores, own_ready, other_ready, q_ready, k_ready,
              v_ready, k_empty, v_empty, Lse, stride_lse_b, stride_lse_h, batch, head, m_start, n_lo, n_blocks,
              seqlen_q, seqlen_k, qk_scale_log2, window_left, window_right, column, stores_lse, LOCAL: gl.constexpr):
    """One warpgroup, one half of the head dim (columns [column, + HALF)): q_tile [1, ROWS, 1, HALF] its half of Q
    (reused to stage its half of O), k_tiles / v_tiles [STAGES, 1, BLOCK_N, 1, HALF] its halves of K and V;
    own_scores / other_scores [2, ROWS, BLOCK_N] fp32 the two consumers' partial scores of the even and odd key
    blocks, own_ready / other_ready [2] their barriers (one arrival per warpgroup). A consumer writes a block's
    buffer again two blocks later, after the other consumer arrived on its next block's barrier, which it does only
    after reading this one. stores_lse (1 on one
    consumer): it stores the natural-log LSE (+inf for rows that see no key, whose output is 0)."""
    STAGES: gl.constexpr = k_tiles.shape[0]
    BLOCK_N: gl.constexpr = k_tiles.shape[2]
    dtype: gl.constexpr = k_tiles.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    # [ROWS, HALF] this half of Q; [ROWS, BLOCK_N] the S wgmma's zero accumulator; [ROWS, HALF] this half of O
    q = q_tile.reshape([ROWS, HALF])
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([ROWS, HALF], gl.float32, o_layout)
    # [ROWS] running max (log2 units) and row sum; the tile's query rows
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([ROWS], gl.float32, row_s)
    offs_m = m_start + gl.arange(0, ROWS, row_s)
    mbarrier.wait(q_ready, 0)
    # [ROWS, BLOCK_N] this half's partial scores of the next key block, issued a block ahead: its wgmma runs while
    # the current block's scores are exchanged and its softmax computed (the first block's here, waited for)
    s_next = zero_s
    if n_blocks > 0:
        mbarrier.wait(k_ready.index(0), 0)
        s_next = warpgroup_mma(q, k_tiles.index(0).reshape([BLOCK_N, HALF]).permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
        s_next = warpgroup_mma_wait(0, deps=(s_next, ))
        arrive_after_wgmma(k_empty.index(0))
    for j in range(n_blocks):
        stage = j % STAGES
        parity = j % 2
        following = j + 1
        # [ROWS, BLOCK_N] this half's partial scores of block j (complete), to the other consumer
        s = s_next
        own_scores.index(parity).store(s)
        mbarrier.arrive(own_ready.index(parity))
        # after the last block, a product nobody reads on the last block's K, which no load overwrites any more (a
        # wgmma issued under a branch could not be waited for after it)
        next_stage = gl.minimum(following, n_blocks - 1) % STAGES
        mbarrier.wait(k_ready.index(next_stage), (following // STAGES) & 1, pred=following < n_blocks)
        s_next = warpgroup_mma(q, k_tiles.index(next_stage).reshape([BLOCK_N, HALF]).permute((1, 0)), zero_s,
                               use_acc=False, is_async=True)
        # [ROWS, BLOCK_N] the whole scores of block j, masked where the block crosses seqlen_k or a window's edge
        # (fwd_softmax's masks: blocks inside every row's keys come back untouched)
        mbarrier.wait(other_ready.index(parity), (j // 2) & 1)
        s = s + other_scores.index(parity).load(s_layout)
        if LOCAL:
            s = mask_local(s, n_lo + j, m_start, offs_m, seqlen_q, seqlen_k, (window_left, window_right), col_s)
        else:
            s = mask_block(s, n_lo + j, m_start, offs_m, seqlen_q, seqlen_k, 0, (), col_s)
        # [ROWS, BLOCK_N] P relative to the new max; [ROWS] the old max's factor
        p, m_i, l_i, alpha = softmax_block(s, m_i, l_i, qk_scale_log2, ())
        # the previous block's P V completed (waited for below), so acc holds its sum
        acc = rescale(acc, alpha, ())
        mbarrier.wait(v_ready.index(stage), (j // STAGES) & 1)
        v = v_tiles.index(stage).reshape([BLOCK_N, HALF])
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v, acc, is_async=True)
        # the next block's S (issued first) and this block's P V: wgmma groups complete in order
        acc, s_next = warpgroup_mma_wait(0, deps=(acc, s_next))
        arrive_after_wgmma(v_empty.index(stage))
        arrive_after_wgmma(k_empty.index(next_stage), pred=following < n_blocks)
    seen = l_i > 0.0
    # [ROWS] one reciprocal per row (a seen row's sum is >= 1: its max's own term)
    out = rescale(acc, reciprocal(gl.where(seen, l_i, 1.0)), ())
    # this consumer's last S wgmma, the only reader of its Q half, completed: O goes out through that tile
    q.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [batch, m_start, head, column], q_tile)
    if stores_lse != 0:
        lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("inf"))
        gl.store(Lse + batch.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h + offs_m, lse,
                 mask=offs_m < seqlen_q)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["stride_lse_b", "stride_lse_h", "batch", "seqlen_q", "seqlen_k", "heads_per_group",
                              "window_left", "window_right"])
def attn_fwd_hopper_d512_kernel(q_desc, k_desc, v_desc, o_desc, Lse, stride_lse_b, stride_lse_h, batch, num_heads,
                                group_size, seqlen_q, seqlen_k, heads_per_group, qk_scale_log2, window_left,
                                window_right, LOCAL: gl.constexpr, STAGES: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """q_desc, k_desc, v_desc, o_desc: descriptors of (B, S, H, 512-wide tiles) tensors moving [1, rows, 1, HALF]
    boxes (Q / O: ROWS rows, K / V: BLOCK_N); Lse (B, H, Sq) fp32 with (batch, head) strides. One program per 64-row
    query tile of a (batch, head), longest first under a causal-like window, in launch-order groups of
    heads_per_group (batch, head) pairs (kernels/common.grouped_tile_of). LOCAL: a window (window_left,
    window_right, normalized as kernels/common's; causal is (>= seqlen_k, 0)). num_warps (4) is the first
    consumer's; the second consumer (4 warps, CONSUMER_REGS registers) and the producer (1 warp) are workers."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    num_tiles = gl.cdiv(seqlen_q, ROWS)
    tile, batch_head = grouped_tile_of(gl.program_id(0), num_tiles, batch * num_heads, heads_per_group)
    if LOCAL:
        tile = num_tiles - 1 - tile  # the last tiles see the most keys under a causal-like window
    batch_index = batch_head // num_heads
    head = batch_head % num_heads
    m_start = tile * ROWS
    n_lo, _, _, n_hi = kv_block_range(m_start, (seqlen_q, seqlen_k, window_left, window_right), ROWS, BLOCK_N, LOCAL)
    n_blocks = gl.maximum(n_hi - n_lo, 0)
    # per half of the head dim: [1, ROWS, 1, HALF] Q (then O), [STAGES, 1, BLOCK_N, 1, HALF] K and V
    q_tiles = (gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout),
               gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout))
    k_tiles = (gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout),
               gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout))
    v_tiles = (gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout),
               gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout))
    # per consumer: [2, ROWS, BLOCK_N] fp32 partial scores of the even and odd key blocks
    # (pairs of columns XOR-swizzled by row: the wgmma layout's eight rows per store land in different banks, where
    # plain rows of 128 bytes would put them all in the same ones)
    scores_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[1, 0])
    scores = (gl.allocate_shared_memory(gl.float32, [2, ROWS, BLOCK_N], scores_layout),
              gl.allocate_shared_memory(gl.float32, [2, ROWS, BLOCK_N], scores_layout))
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # per consumer: [2] its partial scores of an even / odd block written (mbarrier.arrive: one arrival per
    # warpgroup, after a warpgroup barrier that orders every thread's stores before it)
    scores_ready = (gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()),
                    gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()))
    mbarrier.init(q_ready, count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(stage), count=1)
        mbarrier.init(v_ready.index(stage), count=1)
        mbarrier.init(k_empty.index(stage), count=2)
        mbarrier.init(v_empty.index(stage), count=2)
    for consumer in gl.static_range(2):
        for parity in gl.static_range(2):
            mbarrier.init(scores_ready[consumer].index(parity), count=1)
    common = (o_desc, Lse, stride_lse_b, stride_lse_h, batch_index, head, m_start, n_lo, n_blocks, seqlen_q, seqlen_k,
              qk_scale_log2, window_left, window_right)
    first = (q_tiles[0], k_tiles[0], v_tiles[0], scores[0], scores[1], scores_ready[0], scores_ready[1], q_ready,
             k_ready, v_ready, k_empty, v_empty)
    second = (q_tiles[1], k_tiles[1], v_tiles[1], scores[1], scores[0], scores_ready[1], scores_ready[0], q_ready,
              k_ready, v_ready, k_empty, v_empty)
    producer_args = (q_desc, k_desc, v_desc, q_tiles, k_tiles, v_tiles, q_ready, k_ready, v_ready, k_empty, v_empty,
                     batch_index, head, head // group_size, m_start, n_lo, n_blocks)
    gl.warp_specialize([(_consumer_of, (first, common, 0, 1, LOCAL)),
                        (_consumer_of, (second, common, HALF, 0, LOCAL)),
                        (_producer, producer_args)], [4, 1], [CONSUMER_REGS, 24])


@gluon.jit
def _consumer_of(tiles, common, column, stores_lse, LOCAL: gl.constexpr):
    """_consumer with its tiles and barriers (tiles), what both consumers share (common), its columns and LSE duty."""
    (q_tile, k_tiles, v_tiles, own_scores, other_scores, own_ready, other_ready, q_ready, k_ready, v_ready, k_empty,
     v_empty) = tiles
    (o_desc, Lse, stride_lse_b, stride_lse_h, batch, head, m_start, n_lo, n_blocks, seqlen_q, seqlen_k, qk_scale_log2,
     window_left, window_right) = common
    _consumer(q_tile, k_tiles, v_tiles, o_desc, own_scores, other_scores, own_ready, other_ready, q_ready, k_ready,
              v_ready, k_empty, v_empty, Lse, stride_lse_b, stride_lse_h, batch, head, m_start, n_lo, n_blocks,
              seqlen_q, seqlen_k, qk_scale_log2, window_left, window_right, column, stores_lse, LOCAL)
