"""Prefill forward for Hopper (sm_90) in Gluon, warp-specialized: a one-warp TMA producer feeds K/V stages to two
consumer warpgroups, each owning 64 query rows of a 128-row tile. The consumers share the stages and run out of
phase with each other, so one's softmax overlaps the other's wgmma (what the Triton kernel cannot schedule).

Scope (ops/hopper_fwd.covers and runs_on decide): dense (B, S, H, D) bf16/fp16 tensors addressed by host tensor descriptors,
head dim 64 / 128 / 256, GQA, no window or the causal one (bottom-right aligned), positive softmax scale, no
softcap, ALiBi or dropout; everything else runs kernels/fwd.py. Numerics are those of kernels/fwd.py without the
rescale skip: fp32 scores and accumulators, P rounded to V's dtype, natural-log LSE, +inf for rows that see no key.

Synchronisation: k_ready[s] / v_ready[s] complete when stage s's K / V tile has landed (TMA transaction bytes);
k_empty[s] / v_empty[s] complete when both consumers are done with stage s's K / V tile (count 2: one arrival per
consumer warpgroup), so the producer refills K before V is free. Load j goes to stage j % STAGES and is the
(j // STAGES)-th use of that stage, whose parity the waits check.

Two consumer schedules (HopperFwdConfig.overlap, a constexpr): in order (S_j, softmax j, P_j V_j, each wgmma
waited at once), or overlapped inside the warpgroup (FA3's intra-warpgroup pipelining): S_j and P_{j-1} V_{j-1}
are issued together, the softmax of block j runs while P_{j-1} V_{j-1} is on the tensor cores, and the output
rescale waits for it.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from .common import grouped_tile_and_batch_head

CONSUMER_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M tile); a program covers 2 * CONSUMER_ROWS
_tile_and_batch_head = gluon.jit(grouped_tile_and_batch_head.fn)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, batch,
              head, head_k, m_start, n_blocks):
    """One warp: both consumers' Q tiles, then K and V of block j into stage j % STAGES once both consumers freed
    that stage's K (resp. V)."""
    ROWS: gl.constexpr = q_smem.shape[2]
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    tile_bytes: gl.constexpr = BLOCK_N * HEAD_DIM * k_desc.dtype.primitive_bitwidth // 8
    for consumer in gl.static_range(2):
        mbarrier.expect(q_bars.index(consumer), ROWS * HEAD_DIM * q_desc.dtype.primitive_bitwidth // 8)
        tma.async_copy_global_to_shared(q_desc, [batch, m_start + consumer * ROWS, head, 0], q_bars.index(consumer),
                                        q_smem.index(consumer))
    for j in range(n_blocks):
        stage = j % STAGES
        previous_use_phase = ((j // STAGES) - 1) & 1
        mbarrier.wait(k_empty.index(stage), previous_use_phase, pred=j >= STAGES)
        mbarrier.expect(k_ready.index(stage), tile_bytes)
        tma.async_copy_global_to_shared(k_desc, [batch, j * BLOCK_N, head_k, 0], k_ready.index(stage),
                                        k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), previous_use_phase, pred=j >= STAGES)
        mbarrier.expect(v_ready.index(stage), tile_bytes)
        tma.async_copy_global_to_shared(v_desc, [batch, j * BLOCK_N, head_k, 0], v_ready.index(stage),
                                        v_smem.index(stage))


@gluon.jit
def _mask_block(s, j, row0, offs_m, seqlen_q, seqlen_k, causal, col_s: gl.constexpr):
    """s [ROWS, BLOCK_N] of key block j with keys past seqlen_k (and, causal, past each row's last key: bottom-right
    aligned) set to -inf; blocks that need neither come back untouched without any mask arithmetic."""
    BLOCK_N: gl.constexpr = s.shape[1]
    n_end = (j + 1) * BLOCK_N
    # the last key the tile's first row (row0) sees under the causal mask
    first_row_last_key = row0 + (seqlen_k - seqlen_q)
    if (n_end > seqlen_k) | ((causal != 0) & (n_end - 1 > first_row_last_key)):
        # [BLOCK_N] keys of this block
        offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, col_s)
        # [ROWS, BLOCK_N]
        visible = gl.expand_dims(offs_n < seqlen_k, 0) & gl.expand_dims(offs_m >= 0, 1)
        if causal != 0:
            visible = visible & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m + (seqlen_k - seqlen_q), 1))
        s = gl.where(visible, s, float("-inf"))
    return s


@gluon.jit
def _softmax_block(s, m_i, l_i, qk_scale_log2):
    """Online softmax step of one masked score block s [ROWS, BLOCK_N]: probabilities (scale folded into the exp2
    argument), the new running max (log2 units) and row sum, and alpha, the factor that rescales what was
    accumulated before. Rows that have seen no key yet keep max -inf and get p = 0, alpha = 0."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale_log2)
    pivot = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(pivot, 1))
    alpha = gl.exp2(m_i - pivot)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _consumer_start(q_tile, k_smem, q_bar, row0):
    """A consumer's initial state once its Q tile has landed: the Q tile [ROWS, HEAD_DIM] (shared memory), a zero
    score block [ROWS, BLOCK_N], the output accumulator [ROWS, HEAD_DIM], running max (log2 units) and row sum
    [ROWS], and the query rows [ROWS]."""
    ROWS: gl.constexpr = q_tile.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([ROWS], gl.float32, row_s)
    offs_m = row0 + gl.arange(0, ROWS, row_s)
    mbarrier.wait(q_bar, 0)
    return q_tile.reshape([ROWS, HEAD_DIM]), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), acc, m_i, l_i, offs_m


@gluon.jit
def _consumer_finish(o_desc, Lse, q_tile, acc, m_i, l_i, offs_m, batch, head, lse_row_base, row0, seqlen_q):
    """Normalize and store O (through the consumer's Q tile, free once its last S wgmma completed; TMA clips rows
    past seqlen_q) and the natural-log LSE. Rows that saw no key: out 0, lse +inf (API.md §4.5)."""
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    seen = l_i > 0.0
    out = acc / gl.expand_dims(gl.convert_layout(gl.where(seen, l_i, 1.0), row_o), 1)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("inf"))
    gl.store(Lse + lse_row_base + offs_m, lse, mask=offs_m < seqlen_q)
    q_tile.reshape([acc.shape[0], acc.shape[1]]).store(out.to(q_tile.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [batch, row0, head, 0], q_tile)
    tma.store_wait(0)


@gluon.jit
def _consumer_in_order(o_desc, Lse, q_tile, q_bar, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, batch, head,
                       lse_row_base, row0, n_blocks, seqlen_q, seqlen_k, qk_scale_log2, causal):
    """One warpgroup, query rows [row0, row0 + ROWS): per key block S_j, softmax j, P_j V_j, each wgmma waited."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    q, zero_s, acc, m_i, l_i, offs_m = _consumer_start(q_tile, k_smem, q_bar, row0)
    col_s: gl.constexpr = gl.SliceLayout(0, zero_s.type.layout)
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    for j in range(n_blocks):
        stage = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(stage), phase)
        # [ROWS, BLOCK_N] raw q.k
        s = warpgroup_mma(q, k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s, use_acc=False)
        mbarrier.arrive(k_empty.index(stage))
        p, m_i, l_i, alpha = _softmax_block(_mask_block(s, j, row0, offs_m, seqlen_q, seqlen_k, causal, col_s), m_i,
                                            l_i, qk_scale_log2)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        mbarrier.wait(v_ready.index(stage), phase)
        acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_layout), v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM]),
                            acc)
        mbarrier.arrive(v_empty.index(stage))
    _consumer_finish(o_desc, Lse, q_tile, acc, m_i, l_i, offs_m, batch, head, lse_row_base, row0, seqlen_q)


@gluon.jit
def _consumer_overlapped(o_desc, Lse, q_tile, q_bar, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, batch, head,
                         lse_row_base, row0, n_blocks, seqlen_q, seqlen_k, qk_scale_log2, causal):
    """One warpgroup, query rows [row0, row0 + ROWS): block 0's softmax first, then per block j S_j and
    P_{j-1} V_{j-1} issued together, softmax j while P_{j-1} V_{j-1} runs, then the rescale."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    q, zero_s, acc, m_i, l_i, offs_m = _consumer_start(q_tile, k_smem, q_bar, row0)
    col_s: gl.constexpr = gl.SliceLayout(0, zero_s.type.layout)
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    mbarrier.wait(k_ready.index(0), 0)
    # [ROWS, BLOCK_N] raw q.k of block 0
    s = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s, use_acc=False)
    mbarrier.arrive(k_empty.index(0))
    # [ROWS, BLOCK_N] probabilities of the block whose P.V is pending
    p, m_i, l_i, alpha = _softmax_block(_mask_block(s, 0, row0, offs_m, seqlen_q, seqlen_k, causal, col_s), m_i, l_i,
                                        qk_scale_log2)
    for j in range(1, n_blocks):
        stage = j % STAGES
        previous = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        mbarrier.wait(v_ready.index(previous), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_layout),
                            v_smem.index(previous).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        # S_j done (wgmma groups complete in order); P_{j-1} V_{j-1} may still run
        s = warpgroup_mma_wait(1, deps=(s, ))
        mbarrier.arrive(k_empty.index(stage))
        p, m_i, l_i, alpha = _softmax_block(_mask_block(s, j, row0, offs_m, seqlen_q, seqlen_k, causal, col_s), m_i,
                                            l_i, qk_scale_log2)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(previous))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_layout), v_smem.index(last).reshape([BLOCK_N, HEAD_DIM]),
                        acc)
    mbarrier.arrive(v_empty.index(last))
    _consumer_finish(o_desc, Lse, q_tile, acc, m_i, l_i, offs_m, batch, head, lse_row_base, row0, seqlen_q)


@gluon.jit(do_not_specialize=["stride_lse_b", "stride_lse_h", "seqlen_q", "seqlen_k", "heads_per_group"])
def attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, Lse, stride_lse_b, stride_lse_h, num_heads, group_size,
                           seqlen_q, seqlen_k, heads_per_group, qk_scale_log2,
                           CAUSAL: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One program per (128-row query tile, batch * head), tiles longest first, in launch-order groups of
    heads_per_group (batch, head) pairs like kernels/fwd.py. num_warps (4) is the first consumer's; the second
    consumer (4 warps, CONSUMER_REGS registers) and the producer (1 warp) are worker partitions."""
    ROWS: gl.constexpr = CONSUMER_ROWS
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    num_tiles = gl.cdiv(seqlen_q, 2 * ROWS)
    tile, batch_head = _tile_and_batch_head(num_tiles, heads_per_group)
    m_start = (num_tiles - 1 - tile) * 2 * ROWS
    batch = batch_head // num_heads
    head = batch_head % num_heads
    head_k = head // group_size
    key_end = seqlen_k
    if CAUSAL:
        key_end = gl.minimum(m_start + 2 * ROWS + (seqlen_k - seqlen_q), seqlen_k)
    # at least one block, even for a causal tile whose rows all precede the first key (sq > sk): it comes back fully
    # masked, so those rows see no key, and the overlapped schedule always has a block 0
    n_blocks = gl.maximum(gl.cdiv(key_end, BLOCK_N), 1)
    # [2, 1, ROWS, 1, HEAD_DIM] the consumers' Q tiles (then their O tiles); [STAGES, 1, BLOCK_N, 1, HEAD_DIM] K, V
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, ROWS, 1, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for consumer in gl.static_range(2):
        mbarrier.init(q_bars.index(consumer), count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(stage), count=1)
        mbarrier.init(v_ready.index(stage), count=1)
        mbarrier.init(k_empty.index(stage), count=2)
        mbarrier.init(v_empty.index(stage), count=2)
    # constexprs arrive in partitions as plain ints (Triton 3.6): the flag travels as a tensor
    causal = gl.to_tensor(CAUSAL).to(gl.int32)
    lse_row_base = batch.to(gl.int64) * stride_lse_b + head.to(gl.int64) * stride_lse_h
    consumer_args = (o_desc, Lse, q_smem.index(0), q_bars.index(0), k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                     batch, head, lse_row_base, m_start, n_blocks, seqlen_q, seqlen_k, qk_scale_log2, causal)
    second_args = (o_desc, Lse, q_smem.index(1), q_bars.index(1), k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                   batch, head, lse_row_base, m_start + ROWS, n_blocks, seqlen_q, seqlen_k, qk_scale_log2, causal)
    producer_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, batch,
                     head, head_k, m_start, n_blocks)
    if OVERLAP:
        gl.warp_specialize([(_consumer_overlapped, consumer_args), (_consumer_overlapped, second_args),
                            (_producer, producer_args)], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([(_consumer_in_order, consumer_args), (_consumer_in_order, second_args),
                            (_producer, producer_args)], [4, 1], [CONSUMER_REGS, 24])
